"""The WAN leg inside an encrypted tunnel: WireGuard between the two datacenters.

Everything PDD sends across datacenters (Mooncake's KV writes, P's bootstrap, the control
plane, the router's HTTP to MD) can cross a WireGuard tunnel instead of the bare WAN: each
datacenter's servers bind to and announce their tunnel address, and only WireGuard's UDP
(ChaCha20-Poly1305, authenticated by the peers' keys) is on the line. Production does this on
each host or gateway with the kernel's WireGuard; the testbed's kernel has none, so each
datacenter runs wireguard-go (the userspace implementation, on a TUN device; it insists on
WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1 on Linux, set here), which costs CPU
per byte that the kernel module costs far less of: `pdd.eval.bench_tunnel` measures it.

Testbed layout (`Testbed(tunnel=True)`, `testbed up --tunnel`): in each namespace a WireGuard
device NAME-w{a,b} with address NET.4.{1,2}/24 (`Testbed.ip` then returns it), its peer's
endpoint the other side's WAN address, UDP port 51820, MTU the link's less WireGuard's 80 bytes.
Keys are made at each bring-up (`wg genkey`) and kept, mode 0600, in the testbed's run folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Protocol

from pdd.launch import netns

PORT = 51820
OVERHEAD = 80  # WireGuard's bytes per packet: outer IPv6 40, UDP 8, its header 16, tag 16
PACKAGES = "wireguard-go wireguard-tools"
SOCKET_DIR = Path("/var/run/wireguard")  # where wireguard-go's control sockets are
READY_TIMEOUT_S = 10.0


class TunnelSides(Protocol):
    """What the tunnel needs of the testbed."""

    name: str
    net: str
    mtu: int
    run_dir: Path

    def ns(self, side: str) -> str: ...

    def wan_ip(self, side: str) -> str: ...


def missing() -> str | None:
    """Why this machine cannot run the testbed's tunnel, or None."""
    absent = [tool for tool in ("wireguard-go", "wg") if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (apt-get install {PACKAGES})"
    return None


def device(tb: TunnelSides, side: str) -> str:
    return f"{tb.name}-w{side}"


def address(net: str, side: str) -> str:
    return f"{net}.4.{'ab'.index(side) + 1}"


def up(tb: TunnelSides) -> None:
    """Starts both ends and waits until each has its device; raises with the cause."""
    why = missing()
    if why is not None:
        raise RuntimeError(f"the tunnel needs WireGuard: {why}")
    keys = {side: _keypair(tb.run_dir / f"wg-{side}.key") for side in "ab"}
    for side, other in (("a", "b"), ("b", "a")):
        ns, dev = tb.ns(side), device(tb, side)
        with open(tb.run_dir / f"wg-{side}.log", "wb") as log:
            subprocess.Popen(
                netns.exec_argv(ns, ["wireguard-go", "--foreground", dev]), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"},
            )  # fmt: skip
        _wait_for(SOCKET_DIR / f"{dev}.sock")
        netns.run(netns.exec_argv(ns, [
            "wg", "set", dev, "private-key", str(keys[side][0]), "listen-port", str(PORT),
            "peer", keys[other][1], "endpoint", f"{tb.wan_ip(other)}:{PORT}",
            "allowed-ips", f"{address(tb.net, other)}/32",
        ]))  # fmt: skip
        ip = ["ip", "-n", ns]
        netns.run([*ip, "link", "set", dev, "mtu", str(tb.mtu - OVERHEAD), "up"])
        netns.run([*ip, "addr", "add", f"{address(tb.net, side)}/24", "dev", dev])


def down(tb: TunnelSides) -> list[str]:
    """Removes control sockets wireguard-go left (its processes end with their namespace)."""
    removed = []
    for side in "ab":
        sock = SOCKET_DIR / f"{device(tb, side)}.sock"
        if sock.exists():
            sock.unlink()
            removed.append(f"socket {sock}")
    return removed


def cpu_seconds(tb: TunnelSides) -> float:
    """CPU time both wireguard-go processes used so far."""
    total = 0.0
    for side in "ab":
        for pid in netns.pids(tb.ns(side)):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() != "wireguard-go":
                    continue
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _keypair(path: Path) -> tuple[Path, str]:
    """A fresh private key written to `path` (0600) and its public key."""
    private = netns.run(["wg", "genkey"]).strip()
    path.write_text(private + "\n")
    path.chmod(0o600)
    return path, netns.run(["wg", "pubkey"], stdin=private).strip()


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"wireguard-go made no control socket {path} in "
                               f"{READY_TIMEOUT_S:.0f}s")  # fmt: skip
        time.sleep(0.05)
