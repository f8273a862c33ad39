"""The --pdd-* flag logic, without a server: parsing, validation, the environment hand-over."""

from __future__ import annotations

import argparse

import pytest

from pdd.srt.flags import ENV_ROLE, PddConfig, add_args, config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disaggregation-mode", default="null")
    add_args(parser)
    return parser.parse_args(list(argv))


def test_no_role_is_a_plain_sglang_server() -> None:
    assert config_from_args(parse()) == PddConfig(role=None)


@pytest.mark.parametrize(("role", "mode"), [("prefill", "prefill"), ("relay", "decode"),
                                            ("main", "decode")])  # fmt: skip
def test_each_role_with_its_mode(role: str, mode: str) -> None:
    args = parse("--pdd-role", role, "--disaggregation-mode", mode)
    assert config_from_args(args).role == role


def test_wrong_mode_exits_with_a_clear_message() -> None:
    with pytest.raises(SystemExit, match="--pdd-role main needs --disaggregation-mode decode"):
        config_from_args(parse("--pdd-role", "main", "--disaggregation-mode", "prefill"))


def test_config_travels_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_ROLE, raising=False)
    PddConfig(role="relay").to_env()
    assert PddConfig.from_env() == PddConfig(role="relay")
    PddConfig(role=None).to_env()
    assert PddConfig.from_env() == PddConfig(role=None)
