"""The router's command line: what it accepts, and a clear error for what it does not."""

from __future__ import annotations

import argparse

import pytest

from pdd.control.secret import ENV_SECRET
from pdd.router.config import build_parser, config_from_args

BASE = ["--prefill", "http://10.0.0.1:30000", "8998", "--relay", "http://10.0.0.1:30001",
        "--main", "http://10.0.0.2:30002", "17000"]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(argparse.ArgumentParser()).parse_args([*BASE, *argv])


def test_defaults_are_production_values() -> None:
    cfg = config_from_args(parse())
    assert cfg.path == "auto" and cfg.md_feed_after_tokens == 0
    assert not cfg.test_controls and config_from_args(parse("--test-controls")).test_controls
    assert cfg.main[0].control_addr == "tcp://10.0.0.2:17000"


def test_a_negative_md_feed_delay_is_rejected() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        config_from_args(parse("--md-feed-after-tokens", "-5"))


def test_a_bad_path_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--path", "sideways")
    assert "invalid choice: 'sideways'" in capsys.readouterr().err


def test_router_refuses_an_unauthenticated_control_socket_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    with pytest.raises(ValueError, match="binds 10.0.0.1.*--secret-file.*--control-insecure"):
        config_from_args(parse("--control-host", "10.0.0.1"))
    assert config_from_args(parse("--control-host", "10.0.0.1", "--control-insecure")).path
    monkeypatch.setenv(ENV_SECRET, "s")
    assert config_from_args(parse("--control-host", "10.0.0.1")).secret == b"s"


def test_main_dp_is_one_md_per_dp_rank_on_its_own_control_port() -> None:
    cfg = config_from_args(parse("--main-dp", "http://10.0.0.3:30002", "17100", "2"))
    dp = [(m.dp_rank, m.control_addr) for m in cfg.main if m.url == "http://10.0.0.3:30002"]
    assert dp == [(0, "tcp://10.0.0.3:17100"), (1, "tcp://10.0.0.3:17101")]
    assert [m.dp_rank for m in cfg.main if m.url == "http://10.0.0.2:30002"] == [None]


@pytest.mark.parametrize(("port", "size", "error"), [
    ("17100", "0", "DP size must be in 1-64, got '0'"),
    ("17100", "two", "DP size must be in 1-64, got 'two'"),
    ("65535", "2", "DP rank 1's control port must be in 1-65535, got 65536"),
])  # fmt: skip
def test_a_bad_main_dp_names_what_is_wrong(port: str, size: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        config_from_args(parse("--main-dp", "http://10.0.0.3:30002", port, size))
