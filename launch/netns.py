"""Network-namespace helpers: run `ip`/`tc`, enter a namespace in-process, list its processes.

Namespaces are the named ones of iproute2 (`ip netns add NAME`, a bind mount in NETNS_DIR), so
they can be listed and removed by name after a crash of whatever created them.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
COMMAND_TIMEOUT_S = 10.0

_libc = ctypes.CDLL(None, use_errno=True)


class CommandError(RuntimeError):
    pass


def run(
    argv: list[str], check: bool = True, timeout: float = COMMAND_TIMEOUT_S, stdin: str = ""
) -> str:
    """Run a short system command; returns stdout, raises CommandError with its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and proc.returncode != 0:
        raise CommandError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def names(prefix: str) -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def exec_argv(name: str, argv: list[str]) -> list[str]:
    """`argv` run inside namespace `name` (for subprocess or ManagedProcess)."""
    return ["ip", "netns", "exec", name, *argv]


def pids(name: str) -> list[int]:
    if not exists(name):
        return []
    return [int(p) for p in run(["ip", "netns", "pids", name], check=False).split()]


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def enter(name: str) -> None:
    """Move this thread into namespace `name` for good (e.g. a forked server's)."""
    target = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        _setns(target)
    finally:
        os.close(target)


@contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the block with this thread inside namespace `name`.

    Sockets, TUN devices and /proc/sys/net files opened in the block belong to that namespace
    and keep doing so after the block, which is what makes this useful.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(name)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def write_sysctl(name: str, key: str, value: str) -> None:
    """Set a per-namespace sysctl such as net.ipv4.tcp_rmem inside namespace `name`."""
    with entered(name):
        Path("/proc/sys", *key.split(".")).write_text(value)
