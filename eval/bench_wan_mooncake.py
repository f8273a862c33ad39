"""Mooncake TCP across the emulated WAN: bulk writes from datacenter A to datacenter B.

    python -m pdd.eval.bench_wan_mooncake [--mib 64] [--rate-mbit 200] [--delay-ms 20]
        [--mtu 65000] [--flow-window-mb W] [--flows 1,2,4,8,16[,auto]]
    python -m pdd.eval.bench_wan_mooncake --shapes three --mib 32 --flows 1,2,4,8,16

Needs root. Brings up its own testbed (`pdd.launch.testbed`, name `pddbench`), starts a
receiver in B and a sender in A, each a Mooncake TransferEngine over TCP that announces its
datacenter's WAN address. The receiver registers a buffer and reports its address and RPC port
(out of band, through this process); the sender writes a fresh random payload into it the way
pdd's servers write a request's KV (`pdd.srt.wan_write`: pieces over N TCP flows, polled
without spinning), once "cold" on a fresh engine (connection set-up and TCP start-up
included), then, once every flow's connection is open (Mooncake opens them one at a time as writes
need them: "ramp" rounds, at most five), three times "warm", as between long-running prefill
and decode servers; so for each number of flows. After each write the
receiver hashes its buffer and clears it. The table shows each write's rate, its ratio to the
link rate (target: a median warm ratio >= 0.85 with the flows the link needs, twice its
bandwidth-delay product over one flow's window, always measured), its ratio to the best a write
can do (its bytes at the link rate plus the acknowledgement's round trip), and the CPU the WAN
daemon and the sender spent meanwhile. The testbed is removed at the end, also on failure.

`auto` measures pdd's own choice (`pdd.srt.wan_flows`: per peer, from the kernel's round trip,
the window and what earlier writes reached; its ramp rounds last until the choice settles).
`--shapes three` compares it with every hand-picked number at three link shapes (a capped
window on a high bandwidth-delay product, a low one, an uncapped window) and ends with
`auto flows ratio to best X`, the worst shape's (target >= 0.95).

What it stands for: `--flow-window-mb 2 --rate-mbit 1500 --delay-ms 40` is a 1.5 Gbit/s line
at 80 ms RTT with 2 MB socket buffers, so one flow carries ~0.1 of the line: the ratio of a
production WAN (10-100 Gbit/s, 25-80 ms) to one flow under stock Linux windows (a few MB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from pdd.launch.cli import command_parser
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from pdd.srt.wan_flows import AUTO_FLOWS, FlowChooser, fixed_flows
from pdd.srt.wan_write import MAX_FLOWS, flows_for, mooncake_env, write

MODULE = "pdd.eval.bench_wan_mooncake"
MARK = "RESULT "  # our lines on stdout; Mooncake may print its own
TARGET_RATIO = 0.85
TIMEOUT_S = 120.0
WARM_ROUNDS = 3
RAMP_ROUNDS = 5
# The emulator forwards each packet in Python: at MTU 9000 it needs most of a core at 1.5 Gbit/s
# and caps the link below its rate. TCP's windows are in bytes, so a larger MTU keeps the ratio
# this benchmark measures (link rate to one flow's window per RTT) and frees that core.
BENCH_MTU = 65000


@dataclass
class TransferResult:
    round: str  # "cold": a fresh engine, so connection set-up and TCP start-up; "warm": again
    chosen: str  # --flows: a number, or "auto" (pdd's per-peer choice)
    flows: int  # the flows this write used
    nbytes: int
    link_mbit: float
    rtt_ms: float
    seconds: float
    intact: bool
    daemon_cpu: float  # cores the WAN daemon used during the write
    sender_cpu: float  # cores the sending process used during the write
    connections: int  # TCP connections from A to B after the write

    @property
    def achieved_mbit(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e6

    @property
    def ratio(self) -> float:
        return self.achieved_mbit / self.link_mbit

    @property
    def of_attainable(self) -> float:
        """Against the best a write can do: its bytes at the link rate plus the round trip that
        brings the receiver's acknowledgement (128 MiB at 1.5 Gbit/s, 80 ms: ratio <= 0.90)."""
        return (self.nbytes * 8 / (self.link_mbit * 1e6) + self.rtt_ms / 1000) / self.seconds


def emit(record: dict[str, Any]) -> None:
    print(MARK + json.dumps(record), flush=True)


def start_engine(ip: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(ip, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize({ip}) returned {rc}")
    return engine


def register(engine: Any, buf: np.ndarray) -> int:
    addr = int(buf.ctypes.data)
    if engine.register_memory(addr, buf.nbytes) != 0:
        raise RuntimeError(f"register_memory of {buf.nbytes} bytes failed")
    return addr


def receive(ip: str, nbytes: int) -> None:
    engine = start_engine(ip)
    buf = np.zeros(nbytes, dtype=np.uint8)
    emit({"rpc_port": engine.get_rpc_port(), "addr": register(engine, buf)})
    while sys.stdin.readline():  # a write has finished: hash it, then clear for the next
        emit({"sha256": hashlib.sha256(buf.data).hexdigest()})
        buf[:] = 0


def send(ip: str, peer: str, remote_addr: int, nbytes: int, seed: int, flows: str) -> None:
    engine = start_engine(ip)  # its lanes come from the environment (mooncake_env)
    buf = np.zeros(nbytes, dtype=np.uint8)
    local = register(engine, buf)
    rng = np.random.default_rng(seed)
    chooser = FlowChooser(fixed_flows(flows))  # as a server's KV writes choose them
    while True:  # one write per round, until the input ends
        buf[:] = np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)  # a new payload each round
        start, cpu = time.monotonic(), time.process_time()
        started = chooser.begin(peer)
        rc = write(engine, peer, [(local, remote_addr, nbytes)], started.flows)
        chooser.end(started, nbytes, rc == 0)
        seconds, cpu = time.monotonic() - start, time.process_time() - cpu
        emit({"rc": rc, "seconds": seconds, "cpu": cpu / seconds, "flows": started.flows,
              "connections": established_to(peer.split(":")[0]),
              "sha256": hashlib.sha256(buf.data).hexdigest()})  # fmt: skip
        if rc != 0 or not sys.stdin.readline():  # wait until the receiver has checked it
            return


def established_to(ip: str) -> int:
    """TCP connections of this network namespace established to `ip` (the flows in use)."""
    want = socket.inet_aton(ip)[::-1].hex().upper()  # /proc/net/tcp: little-endian hex
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if r[3] == "01" and r[2].split(":")[0] == want)


def read_result(proc: subprocess.Popen[bytes], log: IO[bytes], timeout: float) -> dict[str, Any]:
    """The next result line of `proc` (started unbuffered, so select() sees every line)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise TimeoutError(f"no result after {timeout:.0f}s:\n{tail(log)}")
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            raise RuntimeError(f"exited with code {proc.wait(timeout=5)}:\n{tail(log)}")
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])


def tail(log: IO[bytes], nbytes: int = 3000) -> str:
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - nbytes))
    return log.read().decode(errors="replace")


def transfer(
    tb: Testbed, nbytes: int, flows: str = "1", warm_rounds: int = WARM_ROUNDS, seed: int = 0,
    timeout: float = TIMEOUT_S,
) -> list[TransferResult]:  # fmt: skip
    """Write `nbytes` from a Mooncake engine in A to one in B across the testbed's WAN over
    `flows` TCP flows (or as many as pdd chooses, "auto"): a cold write, then `warm_rounds` more
    on the same connections."""
    python = [sys.executable, "-m", MODULE]
    procs: list[subprocess.Popen[bytes]] = []
    results: list[TransferResult] = []
    lanes = fixed_flows(flows) or MAX_FLOWS
    with tempfile.TemporaryFile() as log:
        try:
            receiver = tb.popen(
                "b", [*python, "receive", "--ip", tb.ip("b"), "--nbytes", str(nbytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0,
            )  # fmt: skip
            procs.append(receiver)
            where = read_result(receiver, log, timeout)
            sender = tb.popen(
                "a", [*python, "send", "--ip", tb.ip("a"), "--peer",
                      f"{tb.ip('b')}:{where['rpc_port']}", "--remote-addr", str(where["addr"]),
                      "--nbytes", str(nbytes), "--seed", str(seed), "--flows", flows],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0,
                env={**os.environ, **mooncake_env(lanes)},
            )  # fmt: skip
            procs.append(sender)
            # Mooncake opens a peer's lanes one at a time, as writes need them, and pdd's choice
            # settles over a few writes: "ramp" rounds run until every lane the write used is
            # open and it used as many as the one before (at most RAMP_ROUNDS), then the warm.
            name, warm = "cold", 0
            while warm < warm_rounds:
                cpu = tb.wan.status()["cpu_s"]
                sent = read_result(sender, log, timeout)
                cpu = tb.wan.status()["cpu_s"] - cpu
                if sent["rc"] != 0:
                    raise RuntimeError(f"the write returned {sent['rc']}:\n{tail(log)}")
                received = ask(receiver, log, timeout)
                used = int(sent["flows"])
                settled = flows != AUTO_FLOWS or (bool(results) and results[-1].flows == used)
                results.append(TransferResult(
                    name, flows, used, nbytes, tb.link.rate_mbit, 2 * tb.link.delay_ms,
                    sent["seconds"], sent["sha256"] == received["sha256"], cpu / sent["seconds"],
                    sent["cpu"], sent["connections"],
                ))  # fmt: skip
                ramped = sum(r.round == "ramp" for r in results)
                if (sent["connections"] >= used and settled) or ramped >= RAMP_ROUNDS:
                    name, warm = "warm", warm + (name == "warm")
                else:
                    name = "ramp"
                if warm < warm_rounds:
                    ask(sender, log, timeout, reply=False)
        finally:
            for proc in procs:
                stop(proc)
    return results


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()  # each end exits at the end of its input
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def ask(
    proc: subprocess.Popen[bytes], log: IO[bytes], timeout: float, reply: bool = True
) -> dict[str, Any]:
    """Tell `proc` to go on (a line on its stdin), and read its answer if one is due."""
    assert proc.stdin is not None
    proc.stdin.write(b"next\n")
    proc.stdin.flush()
    return read_result(proc, log, timeout) if reply else {}


def link_flows(tb: Testbed) -> int:
    """The flows this link needs by pdd's rule (twice the bandwidth-delay product over one
    flow's window): the number the final line reports."""
    return flows_for(tb.link.rate_mbit * 1e6, 2 * tb.link.delay_ms / 1000, tb.flow_window_bytes)


def table(tb: Testbed, results: list[TransferResult]) -> str:
    window = f"{tb.flow_window_bytes / 2**20:g} MB"
    lines = [
        f"Mooncake TCP across the emulated WAN ({tb.backend} backend, MTU {tb.mtu}, "
        f"TCP window per flow {window})",
        f"{'flows':>7} {'round':>5} {'payload':>9} {'link':>12} {'RTT':>7} {'seconds':>8} "
        f"{'achieved':>14} {'ratio':>6} {'attain':>6} {'intact':>7} {'WAN CPU':>8} {'send CPU':>8} "
        f"{'conns':>5}",
    ]
    for r in results:
        flows = f"auto:{r.flows}" if r.chosen == AUTO_FLOWS else str(r.flows)
        lines.append(
            f"{flows:>7} {r.round:>5} {r.nbytes / 2**20:>5.0f} MiB {r.link_mbit:>6.0f} Mbit/s "
            f"{r.rtt_ms:>4.0f} ms {r.seconds:>8.2f} {r.achieved_mbit:>7.1f} Mbit/s "
            f"{r.ratio:>6.3f} {r.of_attainable:>6.3f} {'yes' if r.intact else 'NO':>7} "
            f"{r.daemon_cpu:>8.0%} "
            f"{r.sender_cpu:>8.0%} {r.connections:>5}"
        )
    lines.append("warm median ratio by flows: " + ", ".join(
        f"{n}: {warm_ratio(results, n):.3f}" for n in chosen(results)
    ))  # fmt: skip
    lines.append("every round intact" if all(r.intact for r in results) else "CORRUPTED payload")
    if str(link_flows(tb)) in chosen(results):  # measured: always, unless only auto was
        lines.append(f"target >= {TARGET_RATIO} with the {link_flows(tb)} flows this link needs "
                     "(2 x bandwidth-delay product / window)")  # fmt: skip
        lines.append(f"warm median ratio {warm_ratio(results, str(link_flows(tb))):.3f}")
    if AUTO_FLOWS in chosen(results) and len(chosen(results)) > 1:
        best = max(chosen(results)[:-1], key=lambda n: warm_ratio(results, n))
        lines.append(f"auto chose {auto_flows(results)} flows; the best hand-picked: {best} "
                     f"({warm_ratio(results, best):.3f}); auto's ratio to it "
                     f"{auto_ratio(results):.3f}")  # fmt: skip
    return "\n".join(lines)


def chosen(results: list[TransferResult]) -> list[str]:
    """The --flows measured: numbers in order, then auto."""
    names = {r.chosen for r in results}
    return sorted(names - {AUTO_FLOWS}, key=int) + sorted(names & {AUTO_FLOWS})


def warm_ratio(results: list[TransferResult], flows: str) -> float:
    """The median over the warm rounds with `flows` (a number or auto): one slow round on a busy
    machine does not decide."""
    return statistics.median(r.ratio for r in results if r.round == "warm" and r.chosen == flows)


def auto_flows(results: list[TransferResult]) -> int:
    return next(r.flows for r in reversed(results) if r.chosen == AUTO_FLOWS)


def auto_ratio(results: list[TransferResult]) -> float:
    """pdd's choice against the best hand-picked number of flows, warm medians."""
    picked = [n for n in chosen(results) if n != AUTO_FLOWS]
    return warm_ratio(results, AUTO_FLOWS) / max(warm_ratio(results, n) for n in picked)


def passed(tb: Testbed, results: list[TransferResult]) -> bool:
    return (
        all(r.intact for r in results) and warm_ratio(results, str(link_flows(tb))) >= TARGET_RATIO
    )


@dataclass(frozen=True)
class Shape:
    """A link shape of the three-shape comparison (--shapes three)."""

    name: str
    rate_mbit: float
    delay_ms: float  # one way
    flow_window_mb: float | None  # None: 64 MB, uncapped


# 200 Mbit/s at 80 ms with 0.25 MB windows: one flow carries ~1/16 of the line, as stock Linux
# buffers do on a 10-100 Gbit/s WAN; at 4 ms one flow fills it; with 64 MB windows, uncapped.
SHAPES = (
    Shape("high BDP, capped window", 200.0, 40.0, 0.25),
    Shape("low BDP", 200.0, 2.0, 0.25),
    Shape("uncapped window", 200.0, 40.0, None),
)
SHAPES_MTU = 9000  # a 0.25 MB window holds ~14 such packets (at 65000, too few for TCP's clock)
AUTO_TARGET = 0.95


def measure(args: argparse.Namespace, link: LinkParams, window_mb: float | None, mtu: int,
            counts: list[str]) -> tuple[Testbed, list[TransferResult]]:  # fmt: skip
    tb = Testbed(args.name, link, mtu, net=args.net, flow_window_mb=window_mb)
    numbers = sorted({int(n) for n in counts if n != AUTO_FLOWS} | {link_flows(tb)})
    tb.down()  # whatever a crashed earlier run left
    tb.up()
    results = []
    try:
        for n in [str(k) for k in numbers] + [n for n in counts if n == AUTO_FLOWS]:
            print(f"{n} flow(s) ...", file=sys.stderr, flush=True)
            results += transfer(tb, args.mib << 20, flows=n)
    finally:
        tb.down()
    return tb, results


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(MODULE, __doc__)
    sub = parser.add_subparsers(dest="role", help="internal: the two ends of the transfer")
    rx = sub.add_parser("receive", help="the receiver in B")
    tx = sub.add_parser("send", help="the sender in A")
    for role in (rx, tx):
        role.add_argument("--ip", required=True)
        role.add_argument("--nbytes", type=int, required=True)
    tx.add_argument("--peer", required=True)
    tx.add_argument("--remote-addr", type=int, required=True)
    tx.add_argument("--seed", type=int, default=0)
    tx.add_argument("--flows", default="1")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way (RTT: twice this)")
    parser.add_argument("--name", default="pddbench", help="testbed name")
    parser.add_argument("--net", default="10.209", help="testbed addresses, first two octets")
    parser.add_argument(
        "--flow-window-mb",
        type=float,
        default=None,
        help="cap each TCP flow's window in both datacenters (default: 64 MB)",
    )
    parser.add_argument(
        "--mtu",
        type=int,
        default=BENCH_MTU,
        help="the WAN link's MTU (default %(default)s: the emulator's cost is per packet)",
    )
    parser.add_argument("--flows", default=f"1,2,4,8,{MAX_FLOWS}",
                        help="comma-separated numbers of TCP flows to measure, besides the "
                        f"number the link needs, and '{AUTO_FLOWS}' for pdd's choice")  # fmt: skip
    parser.add_argument("--shapes", choices=("one", "three"), default="one",
                        help="'three': auto against every number of flows at three link shapes "
                        "(high BDP with a capped window, low BDP, uncapped), each with --mib; "
                        "the link options are then ignored")  # fmt: skip
    args = parser.parse_args(argv)
    if args.role == "receive":
        receive(args.ip, args.nbytes)
        return
    if args.role == "send":
        send(args.ip, args.peer, args.remote_addr, args.nbytes, args.seed, args.flows)
        return
    counts = args.flows.split(",")
    try:
        for n in counts:
            fixed_flows(n)
    except ValueError as err:
        raise SystemExit(f"--flows: each {err}") from None
    if args.shapes == "one":
        link = LinkParams(args.rate_mbit, args.delay_ms)
        tb, results = measure(args, link, args.flow_window_mb, args.mtu, counts)
        print(table(tb, results))
        if not passed(tb, results):
            raise SystemExit(1)
        return
    counts = sorted(set(counts) - {AUTO_FLOWS}, key=int) + [AUTO_FLOWS]
    ratios = []
    for shape in SHAPES:
        print(f"== {shape.name} ==", file=sys.stderr, flush=True)
        link = LinkParams(shape.rate_mbit, shape.delay_ms)
        tb, results = measure(args, link, shape.flow_window_mb, SHAPES_MTU, counts)
        print(f"{shape.name}: {shape.rate_mbit:g} Mbit/s, RTT {2 * shape.delay_ms:g} ms")
        print(table(tb, results), flush=True)
        if not all(r.intact for r in results):
            raise SystemExit("a payload arrived corrupted")
        ratios.append(auto_ratio(results))
    print(" ".join(f"{s.name}: {r:.3f};" for s, r in zip(SHAPES, ratios, strict=True)))
    print(f"auto flows ratio to best {min(ratios):.3f}")
    if min(ratios) < AUTO_TARGET:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
