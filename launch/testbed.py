"""Two datacenters on one machine: network namespaces joined by an emulated WAN link.

    python -m pdd.launch.testbed up [--rate-mbit 200 --delay-ms 20 --jitter-ms 0 --loss 0]
                                    [--flow-window-mb W] [--tunnel]
    python -m pdd.launch.testbed status
    python -m pdd.launch.testbed exec a -- CMD...        # run CMD inside datacenter A (or b)
    python -m pdd.launch.testbed fault cut [--seconds N] # also: rate --mbit X, delay --ms D,
    python -m pdd.launch.testbed fault restore           #   each with optional --seconds N
    python -m pdd.launch.testbed down                    # removes everything, also after a crash

Layout for the default name `pdd` and net `10.201` (`--name`, `--net` choose others):

    namespace pdd-a (datacenter A)                     namespace pdd-b (datacenter B)
      wan0 10.201.0.1  <====== emulated WAN ======>      wan0 10.201.0.2
      mgmt0 10.201.1.2                                   mgmt0 10.201.2.2
          |  (unshaped veth)                                 |  (unshaped veth)
      root namespace: pdd-ma 10.201.1.1                  pdd-mb 10.201.2.1

Servers bind to their datacenter's WAN address (`Testbed.ip(side)`). Inside a datacenter,
processes reach each other on that address over loopback, unshaped (standing in for RDMA).
A and B reach each other only over the WAN link: neither namespace has a route to the other's
management subnet, and the root namespace does not forward. The root namespace reaches both WAN
addresses through the management veths (host routes), so a router or a test in the root
namespace talks to servers in A and B without crossing the WAN.

The link: rate, one-way delay, jitter (uniform, order preserved), random loss, a drop-tail queue of
one round trip (`--queue-ms`; its bytes, kept under a rate fault). With netem in the kernel it is a
veth pair with netem on both ends; without it (`--backend tun`, chosen automatically) a user-space
forwarder (`pdd.launch.wan_forwarder`) moves packets between a TUN device in each namespace. Limits
of the forwarder, measured on a 2-core VM: it is Python, so it costs CPU (this includes the kernel's
work to deliver each packet into the far namespace): 20-35% of a core at 200 Mbit/s with MTU 9000,
~75% at MTU 1500; ~75% at 1 Gbit/s (MTU 9000), ~26% at MTU 65000; ~90% at 2 Gbit/s, near its
ceiling. Keep the MTU large (default 9000) so the packet rate stays low. Rates come out within ~1%
(TCP goodput 198-199 of 200 Mbit/s); a packet is released within ~0.2 ms of its time (RTT 40.2-40.4
ms for 40 ms set), later when the machine is overloaded: the daemon runs at real-time priority for
that reason (nice -10 where refused). Jitter with order preserved lowers TCP throughput noticeably.
TCP on a long fat link needs large socket buffers: each namespace gets net.ipv4.tcp_rmem/tcp_wmem
max of 64 MiB (with the kernel defaults a flow stalls near 450 Mbit/s on 1 Gbit/s at 60 ms RTT).

`--flow-window-mb W` caps them at W MB instead, in both namespaces: one TCP flow then carries
at most about W MB per round trip, as a production WAN's flows do with stock Linux windows
(a few MB against a 10-100 Gbit/s line at 25-80 ms RTT). A testbed scaled down in rate must
scale the window with it to keep that ratio (`scaled_window_mb`; the demo and the benchmarks
that run PDD take `--flow-window-mb`, by default production's 64 MB scaled like their link).

`--tunnel` puts the WAN leg inside WireGuard (`pdd.launch.tunnel`): servers bind to each
side's tunnel address (NET.4.1, NET.4.2), and only WireGuard's UDP crosses the link.

Faults (`Testbed.cut/restore/set_rate/add_delay`, or `fault ...`) go to the WAN daemon's control
socket (`pdd.launch.wan`). Everything is named after the testbed, so `down` removes it by name:
the daemon, processes left inside the namespaces, the namespaces and devices, the run folder.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pdd.launch import netns, testbed_lock, tunnel
from pdd.launch.cli import command_parser
from pdd.launch.servers import Placement
from pdd.launch.wan import LinkParams, WanClient, WanError
from pdd.launch.wan_forwarder import DaemonConfig

RUN_ROOT = Path("/run/pdd-testbed")
WAN_DEVICE = "wan0"
MGMT_DEVICE = "mgmt0"
SIDES = ("a", "b")
TCP_BUFFER_MAX = 64 << 20
TXQUEUELEN = 10000  # the kernel's queue in front of the forwarder; it must not drop first
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
MAX_NAME = 12  # root-side device names are NAME-ma / NAME-mb, at most 15 characters
DAEMON_MODULE = "pdd.launch.wan_forwarder"


WAN_SCALE = 1000.0  # a 2-core CPU is ~1000x slower than GPUs: the testbed's links are too
PRODUCTION_WINDOW_MB = 64.0  # the socket-buffer maximum docs/wan.md sets on every host


def scaled_window_mb(scale: float = WAN_SCALE) -> float:
    """The per-flow window of a testbed link `scale` times slower than the production line it
    stands for, at the same RTT: production's ratio of line rate to one flow's rate (window /
    RTT) stays. At 1000x, 64 MB becomes 64 KB, about the smallest window TCP runs well with."""
    return PRODUCTION_WINDOW_MB / scale


def add_flow_window_argument(parser: argparse.ArgumentParser) -> None:
    """`--flow-window-mb` of the demo and the WAN benchmarks, scaled like their link."""
    parser.add_argument(
        "--flow-window-mb", type=float, default=scaled_window_mb(),
        help="TCP window per flow in both datacenters (default %(default)g: production's "
             f"{PRODUCTION_WINDOW_MB:g} MB socket buffers scaled like the link, "
             f"{WAN_SCALE:g}x)",
    )  # fmt: skip


def require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError(
            "the testbed needs root: it creates network namespaces, veth and TUN devices "
            "(run it as root, e.g. with sudo)"
        )


def netem_available(namespace: str) -> bool:
    """Try netem on the namespace's loopback: the only dependable test for the qdisc."""
    probe = ["tc", "-n", namespace, "qdisc"]
    try:
        netns.run([*probe, "add", "dev", "lo", "root", "netem", "delay", "0ms"])
    except netns.CommandError:
        return False
    netns.run([*probe, "del", "dev", "lo", "root"])
    return True


def daemon_pids(socket_path: Path) -> list[int]:
    """WAN daemons serving `socket_path`: found by their command line, so a lost state is fine."""
    needle = f'"{socket_path}"'.encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if DAEMON_MODULE.encode() in cmdline and needle in cmdline:
            found.append(int(proc.name))
    return found


def terminate(pids: list[int], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL what is still there after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
            if not pids:
                return
            time.sleep(0.05)
    raise RuntimeError(f"processes {pids} survived SIGKILL")


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    if stat.rsplit(")", 1)[1].split()[0] != "Z":
        return False
    try:
        os.waitpid(pid, os.WNOHANG)  # our own child: collect it
    except ChildProcessError:
        pass
    return True


@dataclass
class Testbed:
    __test__: ClassVar[bool] = False  # pytest: a testbed, not a test class

    name: str = "pdd"
    link: LinkParams = field(default_factory=LinkParams)
    mtu: int = 9000
    backend: str = "auto"  # "netem" when the kernel has it, else "tun"; or force either
    net: str = "10.201"  # first two octets of the testbed's addresses
    flow_window_mb: float | None = None  # per-flow TCP window cap; None: 64 MiB (uncapped)
    tunnel: bool = False  # the WAN leg inside WireGuard (pdd.launch.tunnel)

    def __post_init__(self) -> None:
        if not 0 < len(self.name) <= MAX_NAME or not self.name.replace("-", "").isalnum():
            raise ValueError(f"name must be 1-{MAX_NAME} letters, digits or '-': {self.name!r}")
        if self.backend not in ("auto", "netem", "tun"):
            raise ValueError(f"backend must be auto, netem or tun, not {self.backend!r}")
        if self.flow_window_mb is not None and not 0.0625 <= self.flow_window_mb <= 1024:
            raise ValueError(f"flow window must be 0.0625-1024 MB, not {self.flow_window_mb}")

    # Names and addresses.
    def ns(self, side: str) -> str:
        return f"{self.name}-{self._check(side)}"

    def ip(self, side: str) -> str:
        """What servers in datacenter `side` bind to and announce: its WAN address, or its
        tunnel address when the WAN leg is tunnelled."""
        return tunnel.address(self.net, self._check(side)) if self.tunnel else self.wan_ip(side)

    def wan_ip(self, side: str) -> str:
        """Datacenter `side`'s address on the WAN link itself."""
        return f"{self.net}.0.{SIDES.index(self._check(side)) + 1}"

    def mgmt_ip(self, side: str) -> str:
        return f"{self.net}.{SIDES.index(self._check(side)) + 1}.2"

    def host_ip(self, side: str) -> str:
        """The root namespace's address on the management veth to `side`."""
        return f"{self.net}.{SIDES.index(self._check(side)) + 1}.1"

    def host_device(self, side: str) -> str:
        return f"{self.name}-m{self._check(side)}"

    @staticmethod
    def _check(side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be 'a' or 'b', not {side!r}")
        return side

    @property
    def run_dir(self) -> Path:
        return RUN_ROOT / self.name

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "wan.sock"

    @property
    def state_path(self) -> Path:
        return self.run_dir / "state.json"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "wan.log"

    @property
    def wan(self) -> WanClient:
        return WanClient(self.socket_path)

    @property
    def flow_window_bytes(self) -> int:
        """The namespaces' tcp_rmem/tcp_wmem max: what one TCP flow may keep in flight."""
        if self.flow_window_mb is None:
            return TCP_BUFFER_MAX
        return int(self.flow_window_mb * (1 << 20))

    # Life cycle.
    def up(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Bring the testbed up; this process holds its name until `down` or exit
        (`testbed_lock`)."""
        require_root()
        testbed_lock.hold(self.name)
        left = [n for n in (self.ns("a"), self.ns("b")) if netns.exists(n)]
        if left or daemon_pids(self.socket_path):
            raise RuntimeError(f"testbed {self.name} is already up or left over: run down first")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            for side in SIDES:
                self._make_datacenter(side)
            if self.backend == "auto":
                self.backend = "netem" if netem_available(self.ns("a")) else "tun"
            if self.backend == "netem":
                netns.run(["ip", "link", "add", "name", WAN_DEVICE, "netns", self.ns("a"), "type",
                           "veth", "peer", "name", WAN_DEVICE, "netns", self.ns("b")])  # fmt: skip
            self._start_daemon(timeout)  # with the tun backend, the daemon creates the devices
            self._configure_wan()
            if self.tunnel:
                tunnel.up(self)
            self.state_path.write_text(json.dumps(self.describe(), indent=2) + "\n")
        except BaseException:
            self.down()
            raise

    def _make_datacenter(self, side: str) -> None:
        ns, ip = self.ns(side), ["ip", "-n", self.ns(side)]
        netns.run(["ip", "netns", "add", ns])
        netns.run([*ip, "link", "set", "lo", "up"])
        window = self.flow_window_bytes
        netns.write_sysctl(ns, "net.ipv4.tcp_rmem", f"4096 {min(131072, window)} {window}")
        netns.write_sysctl(ns, "net.ipv4.tcp_wmem", f"4096 16384 {window}")
        # A flow idle between two requests keeps its window (docs/wan.md: WAN hosts set this).
        netns.write_sysctl(ns, "net.ipv4.tcp_slow_start_after_idle", "0")
        host = self.host_device(side)
        netns.run(["ip", "link", "add", host, "type", "veth", "peer", "name", MGMT_DEVICE,
                   "netns", ns])  # fmt: skip
        netns.run(["ip", "addr", "add", f"{self.host_ip(side)}/24", "dev", host])
        netns.run(["ip", "link", "set", host, "up"])
        netns.run([*ip, "addr", "add", f"{self.mgmt_ip(side)}/24", "dev", MGMT_DEVICE])
        netns.run([*ip, "link", "set", MGMT_DEVICE, "up"])
        # The root namespace reaches the datacenter's WAN address through the management veth.
        netns.run(["ip", "route", "add", f"{self.ip(side)}/32", "via", self.mgmt_ip(side)])

    def _configure_wan(self) -> None:
        for side in SIDES:
            ip = ["ip", "-n", self.ns(side)]
            netns.run([*ip, "link", "set", WAN_DEVICE, "mtu", str(self.mtu), "txqueuelen",
                       str(TXQUEUELEN), "up"])  # fmt: skip
            netns.run([*ip, "addr", "add", f"{self.wan_ip(side)}/24", "dev", WAN_DEVICE])

    def _start_daemon(self, timeout: float) -> None:
        config = DaemonConfig(
            self.backend, (self.ns("a"), self.ns("b")), WAN_DEVICE, str(self.socket_path),
            self.link,
        )  # fmt: skip
        with open(self.log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", DAEMON_MODULE, "--config", config.to_json()],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the WAN daemon exited ({proc.returncode}):\n{self._log()}")
            try:
                self.wan.status()
                return
            except WanError as err:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no WAN daemon after {timeout:.0f}s:\n{self._log()}"
                    ) from err
                time.sleep(0.05)

    def _log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return "(no log)"

    def down(self) -> list[str]:
        """Remove everything of this testbed, by name; returns what was removed. Refused while
        another process holds the name (`testbed_lock`): its servers would go down with it."""
        require_root()
        testbed_lock.hold(self.name)
        try:
            return self._remove()
        finally:
            testbed_lock.release(self.name)

    def _remove(self) -> list[str]:
        removed = []
        daemons = daemon_pids(self.socket_path)
        terminate(daemons)
        removed += [f"WAN daemon {pid}" for pid in daemons]
        for side in SIDES:
            ns = self.ns(side)
            inside = netns.pids(ns)
            terminate(inside)  # they would keep the namespace alive after `ip netns del`
            removed += [f"process {pid} in {ns}" for pid in inside]
        removed += tunnel.down(self)
        for side in SIDES:
            host = self.host_device(side)
            if Path(f"/sys/class/net/{host}").exists():
                netns.run(["ip", "link", "del", host])
                removed.append(f"device {host}")
            if netns.exists(self.ns(side)):
                netns.run(["ip", "netns", "del", self.ns(side)])
                removed.append(f"namespace {self.ns(side)}")
        if self.run_dir.exists():
            for path in self.run_dir.iterdir():
                path.unlink()
            self.run_dir.rmdir()
            removed.append(f"folder {self.run_dir}")
        if RUN_ROOT.exists() and not any(RUN_ROOT.iterdir()):
            RUN_ROOT.rmdir()  # the last testbed is gone
        return removed

    @classmethod
    def load(cls, name: str = "pdd") -> Testbed:
        """The testbed `name` as recorded by its `up` (e.g. one started from the command line)."""
        path = RUN_ROOT / name / "state.json"
        if not path.exists():
            raise FileNotFoundError(f"testbed {name} is not up (no {path})")
        state = json.loads(path.read_text())
        return cls(state["name"], LinkParams(**state["link"]), state["mtu"], state["backend"],
                   state["net"], state.get("flow_window_mb"),
                   state.get("tunnel", False))  # fmt: skip

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "net": self.net, "mtu": self.mtu, "backend": self.backend,
            "link": asdict(self.link), "flow_window_mb": self.flow_window_mb,
            "tunnel": self.tunnel,
            "namespaces": {s: self.ns(s) for s in SIDES},
            "wan_ip": {s: self.wan_ip(s) for s in SIDES},
            "server_ip": {s: self.ip(s) for s in SIDES},
            "mgmt_ip": {s: self.mgmt_ip(s) for s in SIDES},
        }  # fmt: skip

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            **self.describe(),
            "namespaces_up": {s: netns.exists(self.ns(s)) for s in SIDES},
            "daemon_pids": daemon_pids(self.socket_path),
        }
        try:
            status["wan"] = self.wan.status()
        except WanError as err:
            status["wan"] = f"unreachable: {err}"
        return status

    # Running things inside a datacenter.
    def command(self, side: str, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside datacenter `side` (e.g. for ManagedProcess)."""
        return netns.exec_argv(self.ns(side), argv)

    def exec(
        self, side: str, argv: list[str], timeout: float = 60.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(side, argv), capture_output=True, text=True, timeout=timeout, check=check
        )

    def popen(self, side: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.command(side, argv), **kwargs)

    def placement(self, side: str) -> Placement:
        """Where a server in datacenter `side` runs: its WAN address, inside its namespace."""
        return Placement(self.ip(side), tuple(self.command(side, [])))

    # Faults: seconds=None lasts until restore().
    def cut(self, seconds: float | None = None) -> dict[str, Any]:
        return self.wan.cut(seconds)

    def set_rate(self, mbit: float, seconds: float | None = None) -> dict[str, Any]:
        return self.wan.rate(mbit, seconds)

    def add_delay(self, ms: float, seconds: float | None = None) -> dict[str, Any]:
        return self.wan.delay(ms, seconds)

    def restore(self) -> dict[str, Any]:
        return self.wan.restore()


def cmd_up(args: argparse.Namespace) -> None:
    link = LinkParams(args.rate_mbit, args.delay_ms, args.jitter_ms, args.loss, args.queue_ms)
    tb = Testbed(args.name, link, args.mtu, args.backend, args.net, args.flow_window_mb,
                 args.tunnel)  # fmt: skip
    tb.up()
    print(f"testbed {tb.name} up ({tb.backend}): {link.rate_mbit:g} Mbit/s, "
          f"{link.delay_ms:g} ms one-way (RTT {2 * link.delay_ms:g} ms), "
          f"jitter {link.jitter_ms:g} ms, loss {link.loss_pct:g}%, "
          f"TCP window per flow {tb.flow_window_bytes / (1 << 20):g} MB"
          f"{', inside WireGuard' if tb.tunnel else ''}")  # fmt: skip
    for side in SIDES:
        print(f"  datacenter {side.upper()}: namespace {tb.ns(side)}, WAN address "
              f"{tb.wan_ip(side)}, servers on {tb.ip(side)}")  # fmt: skip


def cmd_down(args: argparse.Namespace) -> None:
    removed = Testbed(args.name).down()
    print("\n".join(f"removed {r}" for r in removed) or f"testbed {args.name}: nothing to remove")


def cmd_status(args: argparse.Namespace) -> None:
    try:
        tb = Testbed.load(args.name)
    except FileNotFoundError:
        tb = Testbed(args.name)
    print(json.dumps(tb.status(), indent=2))


def cmd_exec(args: argparse.Namespace) -> None:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise SystemExit("exec needs a command: exec a -- CMD...")
    tb = Testbed(args.name)
    if not netns.exists(tb.ns(args.side)):
        raise SystemExit(f"testbed: {tb.name} is not up (no namespace {tb.ns(args.side)})")
    argv = tb.command(args.side, argv)
    os.execvp(argv[0], argv)


def cmd_fault(args: argparse.Namespace) -> None:
    tb = Testbed(args.name)
    if args.kind == "cut":
        status = tb.cut(args.seconds)
    elif args.kind == "rate":
        status = tb.set_rate(args.mbit, args.seconds)
    elif args.kind == "delay":
        status = tb.add_delay(args.ms, args.seconds)
    else:
        status = tb.restore()
    print(json.dumps(status["link"], indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.launch.testbed", __doc__)
    parser.add_argument("--name", default="pdd", help="testbed name: namespaces NAME-a, NAME-b")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create both datacenters and the WAN link")
    up.add_argument("--rate-mbit", type=float, default=200.0)
    up.add_argument("--delay-ms", type=float, default=20.0, help="one-way (RTT is twice this)")
    up.add_argument("--jitter-ms", type=float, default=0.0)
    up.add_argument("--loss", type=float, default=0.0, help="packet loss in percent")
    up.add_argument("--queue-ms", type=float, default=None, help="default: one round trip")
    up.add_argument("--mtu", type=int, default=9000)
    up.add_argument("--backend", choices=["auto", "netem", "tun"], default="auto")
    up.add_argument("--net", default="10.201", help="first two octets of the addresses")
    up.add_argument("--flow-window-mb", type=float, default=None,
                    help="cap each TCP flow's window (tcp_rmem/tcp_wmem max) in both "
                         "namespaces; default 64 MB, i.e. uncapped")  # fmt: skip
    up.add_argument("--tunnel", action="store_true",
                    help="carry the WAN leg inside WireGuard (wireguard-go); servers then use "
                         "the tunnel addresses")  # fmt: skip
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="remove everything of the testbed").set_defaults(func=cmd_down)
    sub.add_parser("status").set_defaults(func=cmd_status)
    ex = sub.add_parser("exec", help="run a command inside datacenter a or b")
    ex.add_argument("side", choices=SIDES)
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    ex.set_defaults(func=cmd_exec)
    fault = sub.add_parser("fault", help="cut the link, change its rate, add delay, restore")
    kinds = fault.add_subparsers(dest="kind", required=True)
    cut = kinds.add_parser("cut", help="drop everything both ways")
    rate = kinds.add_parser("rate", help="set the link rate")
    rate.add_argument("--mbit", type=float, required=True)
    delay = kinds.add_parser("delay", help="add one-way delay on top of the set delay")
    delay.add_argument("--ms", type=float, required=True)
    for kind in (cut, rate, delay):
        kind.add_argument("--seconds", type=float, default=None, help="default: until restore")
    kinds.add_parser("restore", help="end every fault now")
    fault.set_defaults(func=cmd_fault)
    args = parser.parse_args(argv)
    try:
        require_root()
        args.func(args)
    except (PermissionError, FileNotFoundError, RuntimeError, ValueError) as err:
        raise SystemExit(f"testbed: {err}") from err


if __name__ == "__main__":
    main()
