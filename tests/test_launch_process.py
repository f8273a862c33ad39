"""Start-up of a managed server: a start that lost a port race is retried, other failures are not.

The "server" is a real process serving real HTTP; its start-up failures are scripted."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.launch import process
from pdd.launch.process import (
    DP_ATTENTION_PORTS,
    PORT_RANGE,
    PORT_RANGE_ENV,
    ManagedProcess,
    check_reserved,
    free_port,
    port_range,
)
from pdd.launch.servers import LOCAL, PORT_RACE_RETRIES, HttpService, Placement, SGLangServer

# Counts its starts in a file; fails the first `fails` of them with `message`, then serves /health.
SERVER = """
import http.server, pathlib, sys
port, fails, message = int(sys.argv[1]), int(sys.argv[3]), sys.argv[4]
starts_file = pathlib.Path(sys.argv[2])
starts = int(starts_file.read_text()) + 1 if starts_file.exists() else 1
starts_file.write_text(str(starts))
if starts <= fails:
    print(message, flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@dataclass
class Fake(HttpService):
    name: str
    port: int
    log_dir: Path
    placement: Placement = LOCAL
    process: ManagedProcess | None = None


RACE = "torch.distributed.DistNetworkError: port: 22028, code: -98, name: EADDRINUSE"


def start(tmp_path: Path, fails: int, message: str) -> Fake:
    port = free_port()
    service = Fake(name="fake", port=port, log_dir=tmp_path)
    argv = [sys.executable, "-c", SERVER, str(port), str(tmp_path / "starts"), str(fails), message]
    service.launch(argv)
    return service


def starts(tmp_path: Path) -> int:
    return int((tmp_path / "starts").read_text())


def test_a_start_that_lost_a_port_race_is_retried_and_serves(tmp_path: Path) -> None:
    service = start(tmp_path, fails=1, message=RACE)
    try:
        service.wait_ready(timeout=60)
        assert starts(tmp_path) == 2
        assert RACE in (tmp_path / "fake.log").read_text(), "the failed start's log was kept"
    finally:
        assert service.process is not None
        service.process.stop()


def test_port_race_retries_are_bounded(tmp_path: Path) -> None:
    service = start(tmp_path, fails=PORT_RACE_RETRIES + 1, message=RACE)
    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        service.wait_ready(timeout=60)
    assert starts(tmp_path) == PORT_RACE_RETRIES + 1


def test_any_other_start_failure_is_not_retried(tmp_path: Path) -> None:
    service = start(tmp_path, fails=1, message="ValueError: bad model")
    with pytest.raises(RuntimeError, match="bad model"):
        service.wait_ready(timeout=60)
    assert starts(tmp_path) == 1


def test_a_dp_attention_servers_derived_ports_are_never_handed_to_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang with DP attention binds its HTTP port + 233..239: a port handed out later must
    not be one of them, nor a port whose block would cover one handed out before."""
    port = free_port(DP_ATTENTION_PORTS)
    taken = [port + d for d in DP_ATTENTION_PORTS]

    def usable(p: int, derived: range) -> bool:  # as free_port would find it, on this machine
        ports = [p, *(p + d for d in derived)]
        return all(q in port_range() and q not in process._handed_out and process._bindable(q)
                   for q in ports)  # fmt: skip

    away = [p for p in port_range() if abs(p - port) > 300]
    later = next(p for p in away if usable(p, DP_ATTENTION_PORTS))
    other = next(p for p in reversed(away) if abs(p - later) > 300 and usable(p, range(0)))
    monkeypatch.setattr(process.random, "sample", lambda *_: [*taken, other])
    assert free_port() == other  # every port of the block was skipped
    # `port - 1` is free itself, but its block (port + 232..238) covers ports handed out.
    monkeypatch.setattr(process.random, "sample", lambda *_: [port - 1, later])
    assert free_port(DP_ATTENTION_PORTS) == later


def test_a_dp_attention_server_refuses_a_port_handed_out_without_its_block(
    tmp_path: Path,
) -> None:
    """A new test that forgets `free_port(DP_ATTENTION_PORTS)` fails at once, naming the fix,
    rather than now and then when another server's port falls in its block."""
    dp = ["--dp-size", "2", "--enable-dp-attention"]
    server = SGLangServer("dp", tmp_path, free_port(), tmp_path, extra_args=dp)
    with pytest.raises(ValueError, match=r"take it from free_port\(range\(233, 240\)\)"):
        server.start()
    assert server.process is None  # nothing was started
    check_reserved(free_port(DP_ATTENTION_PORTS), DP_ATTENTION_PORTS)  # reserved: accepted
    check_reserved(PORT_RANGE.stop, DP_ATTENTION_PORTS)  # a port chosen elsewhere: not ours


def test_port_range_env_gives_each_run_its_own_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs on one machine (parallel test workers) hand out ports from disjoint parts."""
    monkeypatch.setattr(process, "_handed_out", set())
    monkeypatch.setenv(PORT_RANGE_ENV, "31000-31099")
    ports = [free_port() for _ in range(20)]
    assert all(31000 <= p <= 31099 for p in ports) and len(set(ports)) == 20
    for bad, why in [("31000", "expected LO-HI"), ("x-y", "expected LO-HI"),
                     ("29000-29999", "must lie within 30000-32699"),
                     ("31099-31000", "must lie within")]:  # fmt: skip
        monkeypatch.setenv(PORT_RANGE_ENV, bad)
        with pytest.raises(ValueError, match=why):
            free_port()
