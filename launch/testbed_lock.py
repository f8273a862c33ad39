"""One run per testbed name: the process that brings a testbed up holds its name.

A testbed is named machine-wide (its namespaces, devices and run folder), and `down` removes it
by name, stopping every process in its namespaces: that is how a run clears what a crashed one
left. A second run on the same machine using the same name (a test session while another runs,
or a demo and a benchmark) would stop the first one's servers mid-request. So the process that
runs `up` holds an advisory lock on the name until its `down` or its exit, and `up` or `down`
from any other process is refused while it does, naming the holder. A testbed brought up by the
`testbed up` command outlives that command, and with it the lock: anyone may take it down.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_DIR = Path("/run/lock")
_held: dict[str, int] = {}  # name -> the open lock file of each name this process holds


class TestbedInUse(RuntimeError):
    __test__ = False  # pytest would take the name for a test class


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"pdd-testbed-{name}.lock"


def hold(name: str) -> None:
    """Take `name` for this process until `release` or exit; TestbedInUse if another has it."""
    if name in _held:
        return
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise TestbedInUse(
            f"testbed {name} is in use by {holder}: let that run finish or stop it, or give "
            f"this one another name"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} ({_command()})\n".encode(), 0)
    _held[name] = fd


def release(name: str) -> None:
    fd = _held.pop(name, None)
    if fd is not None:
        os.close(fd)  # drops the lock (a child forked meanwhile keeps it until it exits)


def _command() -> str:
    try:
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in argv if a)[:200]
