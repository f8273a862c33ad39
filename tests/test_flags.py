"""The --pdd-* flag logic, without a server: parsing, validation, the environment hand-over."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from pdd.router.config import Timeouts
from pdd.srt.flags import ENV_ROLE, ENV_SECRET, PddConfig, add_args, config_from_args
from pdd.srt.wan_transfer import (
    ENV_FLOWS,
    ENV_RELEASE_HOLD,
    _around_poison_unsettled_send,
    adjust_wan_args,
    flows,
)
from pdd.srt.wan_write import watchdog_s


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
    args = parse("--pdd-role", role, "--disaggregation-mode", mode, "--pdd-control-port", "31000")
    assert config_from_args(args).role == role


def test_main_decode_needs_a_control_port() -> None:
    with pytest.raises(SystemExit, match="--pdd-role main needs --pdd-control-port"):
        config_from_args(parse("--pdd-role", "main", "--disaggregation-mode", "decode"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pdd-control-port", "70000"], "is not a port number"),
        (["--pdd-park-timeout", "0"], "must be positive"),
        (["--pdd-secret-file", "/nonexistent/secret"], "does not exist"),
        (["--pdd-wan-flows", "0"], "--pdd-wan-flows must be 'auto' or in 1-16, not '0'"),
        (["--pdd-wan-flows", "17"], "--pdd-wan-flows must be 'auto' or in 1-16"),
        (["--pdd-wan-flows", "many"], "--pdd-wan-flows must be 'auto' or in 1-16"),
    ],
)
def test_bad_values_exit_with_a_clear_message(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        base = ("--pdd-role", "main", "--disaggregation-mode", "decode", "--pdd-control-port", "1")
        config_from_args(parse(*base, *argv))


def test_wan_flows_reach_mooncake_unless_the_user_set_its_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in (
        "MC_TCP_LANES_PER_PEER",
        "MC_TCP_ENABLE_CONNECTION_POOL",
        ENV_FLOWS,
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
        "MC_TCP_PROGRESS_TIMEOUT_SEC",
        "MC_TCP_STATUS_TIMEOUT_SEC",
    ):  # monkeypatch removes them again
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MC_TCP_ADMISSION_TIMEOUT_MS", "5")
    adjust_wan_args(parse("--pdd-wan-flows", "6"))
    assert os.environ[ENV_FLOWS] == "6" and flows() == 6
    assert os.environ["MC_TCP_LANES_PER_PEER"] == "6"
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "1"
    assert os.environ["MC_TCP_ADMISSION_TIMEOUT_MS"] == "5"  # the user's value stands
    # A piece lasts as long as its write: Mooncake's 30 s would cut a slow one the router waits on
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == os.environ["MC_TCP_STATUS_TIMEOUT_SEC"]
    assert float(os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"]) > Timeouts.ready


def test_a_tcp_decoder_holds_abandoned_kv_slots_past_ps_write_watchdog(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for key in (ENV_RELEASE_HOLD, "MC_FORCE_TCP", "MOONCAKE_PROTOCOL", "PDD_WAN_WRITE_WATCHDOG_S"):
        monkeypatch.delenv(key, raising=False)
    tcp = ("--disaggregation-transfer-backend", "mooncake_tcp")
    for mode in ("null", "prefill"):  # only a decoder frees slots it asked P to fill
        adjust_wan_args(decoder_args(mode, *tcp))
        assert ENV_RELEASE_HOLD not in os.environ, mode
    adjust_wan_args(decoder_args("decode", "--disaggregation-transfer-backend", "mooncake"))
    assert ENV_RELEASE_HOLD not in os.environ  # RDMA: pdd's write and its watchdog do not run
    adjust_wan_args(decoder_args("decode", *tcp))
    hold = float(os.environ[ENV_RELEASE_HOLD])
    assert hold > watchdog_s(0) >= 360, hold  # SGLang's own default is 30 s
    monkeypatch.setenv(ENV_RELEASE_HOLD, "45")
    adjust_wan_args(decoder_args("decode", *tcp))
    assert os.environ[ENV_RELEASE_HOLD] == "45"  # the user's value stands, with a warning
    assert "shorter than P's write watchdog" in caplog.text


def test_p_acknowledges_a_decoders_abort_after_its_own_failed_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang withholds the acknowledgement after a failed send (its write can return with
    pieces running); pdd's write cannot, so on TCP the decoder gets it and frees its slots."""
    poisoned: list[int] = []

    def poison(manager: object, room: int) -> None:  # SGLang's, unpatched
        poisoned.append(room)

    for key in ("MC_FORCE_TCP", "MOONCAKE_PROTOCOL"):
        monkeypatch.delenv(key, raising=False)
    _around_poison_unsettled_send(poison, object(), 7)  # RDMA: SGLang's own write ran
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    _around_poison_unsettled_send(poison, object(), 8)  # TCP: pdd's write ran, and settled
    assert poisoned == [7]


def decoder_args(mode: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disaggregation-mode", default="null")
    parser.add_argument("--disaggregation-transfer-backend", default="mooncake")
    add_args(parser)
    return parser.parse_args(["--disaggregation-mode", mode, *argv])


@pytest.mark.parametrize(
    ("role", "mode", "needed"),
    [("prefill", "decode", "prefill"), ("relay", "prefill", "decode"), ("main", "null", "decode"),
     ("main", "prefill", "decode")],
)  # fmt: skip
def test_wrong_mode_exits_with_a_clear_message(role: str, mode: str, needed: str) -> None:
    """SGLang's launcher runs this check: tests/test_plugin_flags.py starts one such server."""
    with pytest.raises(SystemExit, match=f"--pdd-role {role} needs --disaggregation-mode {needed}"):
        config_from_args(parse("--pdd-role", role, "--disaggregation-mode", mode,
                               "--pdd-control-port", "31000"))  # fmt: skip


def test_an_unknown_role_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse("--pdd-role", "colocated")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--pdd-role" in err and "invalid choice: 'colocated'" in err, err


def test_config_travels_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_ROLE, raising=False)
    PddConfig(role="relay").to_env()
    assert PddConfig.from_env() == PddConfig(role="relay")
    full = PddConfig(role="main", control_host="10.0.0.2", control_port=31000, park_timeout_s=9.5)
    full.to_env()
    assert PddConfig.from_env() == full
    PddConfig(role=None).to_env()
    assert PddConfig.from_env() == PddConfig(role=None)


def test_secret_from_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    assert PddConfig().secret() is None
    monkeypatch.setenv(ENV_SECRET, "from-env")
    assert PddConfig().secret() == b"from-env"
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    assert PddConfig(secret_file=str(path)).secret() == b"from-file"


def test_an_empty_secret_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        PddConfig(secret_file=str(path)).secret()


def test_the_extend_kernel_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ("--pdd-role", "main", "--disaggregation-mode", "decode", "--pdd-control-port", "1")
    assert config_from_args(parse(*base)).extend_kernel == "auto"
    assert config_from_args(parse(*base, "--pdd-extend-kernel", "sglang")).extend_kernel == "sglang"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse(*base, "--pdd-extend-kernel", "cuda")
    forced = parse(*base, "--pdd-extend-kernel", "triton")
    forced.device = "cpu"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU, or TRITON_INTERPRET=1"):
        config_from_args(forced)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = config_from_args(forced)
    assert config.extend_kernel == "triton"
    config.to_env()
    assert PddConfig.from_env().extend_kernel == "triton"
    PddConfig(role=None).to_env()


@pytest.mark.parametrize(
    ("ranks", "cpus", "bind"),
    [(2, [0, 1], "0|1"), (2, [0, 1, 2, 3], "0-1|2-3"), (4, [0, 1], "0|1|0|1"),
     (2, [0, 2, 4, 6], "0,2|4,6"), (3, [0, 1, 2, 3, 4, 5, 6], "0-1|2-3|4-5")],
)  # fmt: skip
def test_cpu_tp_ranks_get_disjoint_cpu_slices(ranks: int, cpus: list[int], bind: str) -> None:
    from pdd.srt.cpu_tp import threads_bind

    assert threads_bind(ranks, cpus) == bind


def test_another_sglang_version_is_named_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from pdd.srt import hooks

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.99")
    with pytest.raises(SystemExit, match=r"pdd needs sglang==0.5.23, but 0.5.99 is installed"):
        hooks.check_startup("here")


MAIN = ("--pdd-role", "main", "--disaggregation-mode", "decode", "--pdd-control-port", "31000")


def public(*argv: str) -> argparse.Namespace:
    args = parse(*MAIN, *argv)
    args.host = "10.0.0.2"  # SGLang's --host: MD's control socket binds it unless told otherwise
    return args


def test_md_refuses_an_unauthenticated_control_socket_beyond_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    assert config_from_args(parse(*MAIN)).control_host == "127.0.0.1"
    with pytest.raises(SystemExit, match="binds 10.0.0.2.*--pdd-secret-file.*-insecure"):
        config_from_args(public())
    with pytest.raises(SystemExit, match="binds 0.0.0.0"):
        config_from_args(parse(*MAIN, "--pdd-control-host", "0.0.0.0"))
    assert config_from_args(public("--pdd-control-insecure")).control_host == "10.0.0.2"
    assert "without a secret (--pdd-control-insecure)" in caplog.text
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    assert config_from_args(public("--pdd-secret-file", str(secret))).secret() == b"s3cret"
    assert "readable by others (mode 644): chmod 600" in caplog.text
    monkeypatch.setenv(ENV_SECRET, "from-env")
    assert config_from_args(public()).control_host == "10.0.0.2"


def test_each_dp_ranks_control_port_must_be_a_port() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disaggregation-mode", default="null")
    parser.add_argument("--enable-dp-attention", action="store_true")
    parser.add_argument("--dp-size", type=int, default=1)
    add_args(parser)
    base = ["--pdd-role", "main", "--disaggregation-mode", "decode", "--enable-dp-attention"]
    ok = parser.parse_args([*base, "--dp-size", "4", "--pdd-control-port", "65532"])
    assert config_from_args(ok).control_port == 65532
    bad = parser.parse_args([*base, "--dp-size", "4", "--pdd-control-port", "65533"])
    with pytest.raises(SystemExit, match="DP rank 3 would listen on 65536, beyond 65535"):
        config_from_args(bad)
