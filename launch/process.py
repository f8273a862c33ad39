"""Start, watch and stop server processes, each in its own process group (so no orphans)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdd.launch.forkserver import ForkedServer, spawn

STOP_TIMEOUT_S = 10.0
# Log lines after which a server never becomes ready, although its process may stay alive.
FATAL_LOG_MARKERS = ("error while attempting to bind on address",)  # uvicorn, our port


# Ports we hand out: above the range SGLang draws its own internal ports from (22000-29999) and
# below the kernel's ephemeral range (32768+), so neither can take one between our pick and the
# server's bind.
PORT_RANGE = range(30000, 32700)
# Runs sharing a machine (parallel test workers) each take a disjoint part of it, "LO-HI": a
# port is checked free by binding it, and its server binds it seconds later.
PORT_RANGE_ENV = "PDD_PORT_RANGE"
# A server with DP attention binds its internal sockets at its HTTP port + 233 (the torch
# rendezvous) and the 6 ports after it (SGLang's ZMQ_TCP_PORT_DELTA): its port is handed out
# with these, or a port handed out to another server may be one of them.
DP_ATTENTION_PORTS = range(233, 240)
_handed_out: set[int] = set()


def free_port(derived: range = range(0)) -> int:
    """A port no server of this process was given and nothing binds now; with `derived`
    offsets, those ports above it as well (all handed out together)."""
    ours = port_range()
    for port in random.sample(ours, min(64, len(ours))):
        ports = [port, *(port + d for d in derived)]
        if any(p in _handed_out or p not in ours for p in ports):
            continue
        if all(_bindable(p) for p in ports):
            _handed_out.update(ports)
            return port
    raise RuntimeError(f"no free port in {ours.start}-{ours.stop - 1}")


def port_range() -> range:
    """The ports this process hands out: PORT_RANGE, or the part of it PDD_PORT_RANGE names."""
    given = os.environ.get(PORT_RANGE_ENV)
    if not given:
        return PORT_RANGE
    lo, _, hi = given.partition("-")
    try:
        ours = range(int(lo), int(hi) + 1)
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={given!r}: expected LO-HI, e.g. 30000-31349") from None
    if not ours or ours.start < PORT_RANGE.start or ours.stop > PORT_RANGE.stop:
        raise ValueError(
            f"{PORT_RANGE_ENV}={given!r}: must lie within {PORT_RANGE.start}-{PORT_RANGE.stop - 1}"
        )
    return ours


def check_reserved(port: int, derived: range) -> None:
    """A port this process handed out must have come with the `derived` ports its server will
    bind too (`free_port(derived)`): otherwise one of them may be another server's port."""
    if port in _handed_out and any(port + d not in _handed_out for d in derived):
        raise ValueError(
            f"port {port} was handed out without the ports its server derives from it "
            f"(+{derived.start}..{derived.stop - 1}): take it from free_port({derived!r})"
        )


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `finally` blocks stop the servers a launcher started.
    Later SIGTERMs (e.g. from `timeout` as well as `kill`) are ignored: they would abort that
    cleanup halfway."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def reap(pid: int) -> None:
    """Collect an exited child of ours, which would otherwise keep its group looking alive."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def group_alive(pgid: int) -> bool:
    reap(pgid)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_groups(pgids: list[int], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each group's leader (SGLang then stops its own children), SIGKILL what remains.

    All groups are signalled first and waited for together, so stopping N servers takes as long
    as the slowest one, not the sum.
    """
    for pgid in pgids:
        try:
            os.kill(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for wait, sig in ((timeout, signal.SIGKILL), (5.0, None)):
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(group_alive(g) for g in pgids):
                return
            time.sleep(0.1)
        if sig is not None:
            for pgid in pgids:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
    survivors = [g for g in pgids if group_alive(g)]
    raise RuntimeError(f"process groups {survivors} survived SIGKILL")


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    # The started process: our child, or an SGLang server the fork server forked for us
    # (pdd.launch.forkserver), which behaves as one.
    popen: subprocess.Popen[bytes] | ForkedServer | None = None
    log_start: int = 0  # where this start's output begins in the log

    @property
    def pgid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid  # a session leader's pid is its group id

    def start(self, log_mode: str = "wb") -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, log_mode) as log:
            self.log_start = log.tell()
            self.popen = spawn(self.argv, env, self.log_path, append=log_mode == "ab")
            if self.popen is not None:
                return
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def restart(self) -> float:
        """Stop what is left of the group and start again, appending to the same log (so the
        failed start stays readable); returns the seconds the stop took."""
        start = time.monotonic()
        self.stop()
        self.start(log_mode="ab")
        return time.monotonic() - start

    def exited(self) -> bool:
        return self.popen is not None and self.popen.poll() is not None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_http_ok(self, url: str, timeout: float) -> float:
        """Poll `url` until it answers 200; returns the seconds it took. Fails fast on exit."""
        start = time.monotonic()
        while True:
            if self.exited():
                raise RuntimeError(
                    f"{self.name} exited with code {self.popen.returncode if self.popen else '?'} "
                    f"before {url} was ready; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            tail = self.log_tail(50)
            if any(marker in tail for marker in FATAL_LOG_MARKERS):
                raise RuntimeError(f"{self.name} cannot serve; log {self.log_path}:\n{tail}")
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"{self.name} not ready at {url} after {timeout:.0f}s; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        if self.popen is None:
            return
        stop_groups([self.pgid])
        self.popen.wait(timeout=5)

    def crash(self) -> None:
        """SIGKILL the whole group at once: a crash, with no chance to drain or say goodbye
        (SGLang finishes its running requests on SIGTERM)."""
        if self.popen is None:
            return
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)
        stop_groups([self.pgid])  # returns at once unless a child outlived the signal
