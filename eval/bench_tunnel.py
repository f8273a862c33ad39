"""What carrying the WAN leg inside WireGuard costs: Mooncake KV writes across the emulated WAN,
bare and through the tunnel (`pdd.launch.tunnel`), in the same run.

    python -m pdd.eval.bench_tunnel [--mib 32] [--rate-mbit 200] [--delay-ms 20]
        [--flow-window-mb W]

Needs root and WireGuard's tools (launch/setup.sh installs them). For each of the two testbeds
(same link, MTU 9000) it runs `bench_wan_mooncake`'s transfer with pdd's own choice of flows (a
cold write, ramp rounds, three warm ones) and prints both tables, then the tunnel's warm median
rate over the bare link's and the CPU wireguard-go spent per GB carried (both ends together).
Final line: `tunnel goodput ratio X cpu s per GB Y`.

What it stands for: the default link is a 200 Gbit/s line at 40 ms RTT scaled 1000x down (as the
testbed's links are), so the ratio shows whether the tunnel keeps the line full at the scaled
rate. The CPU is wireguard-go's (userspace: this kernel has no WireGuard module); the kernel's
WireGuard, what production hosts run, costs several times less per byte, so this figure is an
upper bound on the tunnel's CPU. On this 2-core machine the WAN emulator and both Mooncake
engines share the cores with it.
"""

from __future__ import annotations

import argparse
import sys

from pdd.eval.bench_wan_mooncake import TransferResult, table, transfer, warm_ratio
from pdd.launch import tunnel
from pdd.launch.cli import command_parser
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from pdd.srt.wan_flows import AUTO_FLOWS

MODULE = "pdd.eval.bench_tunnel"
MTU = 9000


def measure(args: argparse.Namespace, inside: bool) -> tuple[Testbed, list[TransferResult], float]:
    """Writes across a fresh testbed, bare or tunnelled; its results and wireguard-go's CPU s."""
    link = LinkParams(args.rate_mbit, args.delay_ms)
    tb = Testbed(args.name, link, MTU, net=args.net, flow_window_mb=args.flow_window_mb,
                 tunnel=inside)  # fmt: skip
    tb.down()  # whatever a crashed earlier run left
    tb.up()
    try:
        before = tunnel.cpu_seconds(tb)
        results = transfer(tb, args.mib << 20, flows=AUTO_FLOWS)
        cpu = tunnel.cpu_seconds(tb) - before
    finally:
        tb.down()
    return tb, results, cpu


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(MODULE, __doc__)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way (RTT: twice this)")
    parser.add_argument("--flow-window-mb", type=float, default=None)
    parser.add_argument("--name", default="pddtunb", help="testbed name")
    parser.add_argument("--net", default="10.214", help="testbed addresses, first two octets")
    args = parser.parse_args(argv)
    why = tunnel.missing()
    if why is not None:
        raise SystemExit(f"bench_tunnel: {why}")
    rates, cpu_per_gb = {}, 0.0
    for inside in (False, True):
        name = "inside WireGuard" if inside else "bare WAN"
        print(f"== {name} ==", file=sys.stderr, flush=True)
        tb, results, cpu = measure(args, inside)
        if not all(r.intact for r in results):
            raise SystemExit(f"a payload arrived corrupted ({name})")
        print(f"{name}:\n{table(tb, results)}", flush=True)
        rates[inside] = warm_ratio(results, AUTO_FLOWS) * tb.link.rate_mbit
        if inside:
            cpu_per_gb = cpu / (sum(r.nbytes for r in results) / 1e9)
    ratio = rates[True] / rates[False]
    print(f"warm median: bare {rates[False]:.1f} Mbit/s, inside WireGuard {rates[True]:.1f} "
          f"Mbit/s; wireguard-go CPU {cpu_per_gb:.1f} s per GB (both ends)")  # fmt: skip
    print(f"tunnel goodput ratio {ratio:.3f} cpu s per GB {cpu_per_gb:.1f}")


if __name__ == "__main__":
    main()
