"""Live runs on the testbed: one agentic workload through five deployments, at one or more rates.

    python -m pdd.eval live [--model models/wide] [--requests 40] [--rate 0.15 | --rates R1,R2,..
                            | --concurrency N] [--trace FILE] [--scale 0.015] [--max-new 512]
                            [--pool TOKENS] [--burst N] [--rate-mbit 100] [--delay-ms 20]
                            [--ttft-sla 3] [--route-ttft 1.0] [--tpot-sla 0.5] [--dtype float32]
                            [--no-pin] [--out runs/live]

Needs root. Brings up its own testbed (name `pddlive`): P and RelayDecode (RLD) in datacenter
A, MainDecode (MD) in B, the PDD router in A, the emulated WAN between them. The same requests
(an agentic trace from pdd.eval.workload, or --trace) go through, in turn:
- same-DC PD: P -> a decoder in datacenter A with MD's capacity (an RLD sized like MD), the KV
  stays in A (the latency baseline);
- naive cross-DC PD: P -> MD with no decode-side cache: every prompt's KV crosses the WAN;
- cross-DC PD + decode cache: P -> MD, only the suffix MD lacks crosses;
- PDD: the router's path policy (P->MD, P->RLD->MD or P->RLD per request), RLD a small pool
  (PDDDeployment's default fraction of MD), Extend-Decode handoffs;
- PDD catch-up: the same with Catch-Up handoffs (router --handoff-mode catchup).
Arrivals are open loop, Poisson at --rate (or each rate of --rates; --concurrency: closed
loop). Each tier runs on CPUs of its own (eval.live_plan.tier_cpus; --no-pin: all share all):
P and the small RLD on the first half of the cores, the decoders on the other. Caches are
flushed before each pass, then the trace's shared system prompts are sent (steady state: they
are always cached in production; the trace counts them as cached).

The regime (see pdd.eval.workload and pdd.eval.live_plan): a 2-core CPU prefills ~1000x slower
than a GPU, so prompts scale down (--scale: production's 2K-128K-token contexts become tens to
~2K tokens); a decode step of the test models here takes about what a large model's step takes
on a GPU, so answers keep production's lengths (hundreds of tokens, at most --max-new) and KV
crosses the WAN while they are decoded. The default model `wide` has a tiny model's compute and
64 KB of KV per token in float32 (a 1T-class model makes 10-80 KB), so the WAN, not the CPU,
decides TTFT; the default link (100 Mbit/s, RTT 40 ms, a scaled TCP window per flow) stands for
a 100 Gbit/s line with production's socket buffers, scaled 1000x. With prompts x0.015 a
request's KV then takes ~20x longer to cross than a 50 KB/token model's over that line (the
SLA and the answers are production's): a harsher WAN than production's. P's and MD's KV pools
are sized to the trace's working set (2x the peak of the live sessions' prompt + answer tokens;
--pool overrides), so MD's decode cache holds the live sessions.

Reports per pass TTFT, TPOT and end-to-end P50/P90/P99, WAN bytes (the link's own counter), RLD's
and MD's shares of the output tokens, handoffs by mode and whether each output equals the first
deployment's (greedy, so they must); per deployment the SLA goodput (the highest rate whose
TTFT P90 and TPOT P90 meet the SLA); writes live.md, live.json and live.png to --out, and ends
with `pdd md share X rld share Y ttft p99 ratio Z goodput ratio W` (ratios to same-DC PD).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from pdd.eval.client import router_status
from pdd.eval.live_pass import Pace, run_pass
from pdd.eval.live_plan import (
    TraceSpec,
    pool_tokens,
    tier_cpus,
    trace_at,
    warmup,
    working_set,
)
from pdd.eval.live_report import Outputs, report
from pdd.eval.report import Run, Sla
from pdd.eval.workload import hit_rate_summary, materialize
from pdd.launch.cli import command_parser
from pdd.launch.pdd_deploy import RELAY_FRACTION, PDDDeployment, thread_env
from pdd.launch.process import exit_on_sigterm, free_port, stop_groups
from pdd.launch.router import RouterService
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import DTYPE_BYTES, kv_bytes_per_token
from pdd.policy.path import PathPolicy


@dataclass(frozen=True)
class Deployment:
    name: str
    decode_cache: bool  # MD keeps a radix tree of the KV it holds
    path: str | None  # the path every request asks for; None: the router's auto policy
    group: str  # deployments of one group share one set of servers (routers too, if alike)
    relay_fraction: float = RELAY_FRACTION  # RLD's capacity / MD's
    handoff_mode: str | None = None  # the router's --handoff-mode; None: its default
    relay_guard: bool = True  # off: low-hit requests queue on a full RLD (the collapse)

    def router_args(self, ttft_sla_s: float) -> tuple[str, ...]:
        args: tuple[str, ...] = ("--ttft-sla", str(ttft_sla_s))
        if self.handoff_mode is not None:
            args += ("--handoff-mode", self.handoff_mode)
        return args if self.relay_guard else (*args, "--no-relay-guard")


DEPLOYMENTS = [
    # Naive cross-DC PD runs on same-DC PD's servers (MD without the decode cache): one uses P and
    # the MD-sized decoder in A, the other P and MD; each pass starts with every cache flushed.
    Deployment("same-DC PD", False, "relay", "same-dc", relay_fraction=1.0),
    Deployment("naive cross-DC PD", False, "main", "same-dc", relay_fraction=1.0),
    Deployment("cross-DC PD + decode cache", True, "main", "pdd", handoff_mode="extend"),
    Deployment("PDD", True, None, "pdd", handoff_mode="extend"),
    Deployment("PDD catch-up", True, None, "pdd", handoff_mode="catchup"),
    # What the guard prevents, at the same load: not among the defaults (one more pass).
    Deployment("PDD no RLD guard", True, None, "pdd", handoff_mode="extend", relay_guard=False),
]
DEFAULT_DEPLOYMENTS = [d.name for d in DEPLOYMENTS if d.relay_guard]
# One torch thread per server. In production each tier has chips of its own; here P, RLD and MD
# share the cores, and with a thread per core each (torch's default) every OpenMP barrier of one
# server waited on a core another server held: MD's steps ran 2.5-3.5x slower while RLD decoded.
SERVER_ENV = thread_env(prefill=1, decode=1)


def group_routers(deps: list[Deployment], pdd: PDDDeployment, route_ttft: float,
                  routers: dict[str, RouterService]) -> None:  # fmt: skip
    """Fills `routers` with each deployment's router on the group's servers: the deployment's
    own router for the first; a second router beside it for one that routes differently (e.g.
    Catch-Up handoffs), started and ready on return. Its estimates start fresh, as on a
    deployment of its own. Filled as they start, so the caller stops them even if one fails."""
    by_args = {deps[0].router_args(route_ttft): pdd.router}
    for dep in deps:
        argv = dep.router_args(route_ttft)
        if argv not in by_args:
            first = pdd.router
            name = "router-" + dep.name.lower().replace(" ", "-")
            extra = RouterService(name, free_port(), first.log_dir, first.prefill, first.relay,
                                  first.main, first.placement, extra_args=list(argv))  # fmt: skip
            routers[dep.name] = extra
            extra.start()
            extra.wait_ready()
            by_args[argv] = extra
        routers[dep.name] = by_args[argv]


def served_capacity(url: str, timeout_s: float = 30.0) -> dict[str, int | None]:
    """Requests RLD and MD run at once, RLD's KV pool and the tokens it reserves per request
    (what its admission and the router's guard count), as the router learnt them from the
    servers."""
    deadline = time.monotonic() + timeout_s
    while True:
        inst = router_status(url)["instances"]
        got = {tier: inst[tier][0]["capacity"] for tier in ("relay", "main")}
        relay = inst["relay"][0]
        got["relay_kv_pool"], got["relay_kv_reserve"] = relay["kv_pool"], relay["kv_reserve"]
        if all(v is not None for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def router_estimates(url: str) -> dict:
    """What the router has learnt after a pass (its path choices rest on it): the WAN to MD,
    what P->MD first tokens took beyond their prediction, RLD's time per token, P's time per
    prompt token."""
    status = router_status(url)
    main = status["instances"]["main"][0]
    return {"wan": main["wan"], "first_token_extra_s": main["first_token_extra_s"],
            "relay_tpot_s": status["relay_tpot_s"],
            "prefill_s_per_token": status["prefill_s_per_token"]}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = command_parser("pdd.eval live", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/wide"))
    parser.add_argument("--trace", type=Path, default=None,
                        help="replay this trace (ours or a user's JSONL) instead")  # fmt: skip
    parser.add_argument(
        "--requests", type=int, default=40,
        help="per pass (default %(default)s: about 5 minutes a pass at 0.15 req/s)",
    )  # fmt: skip
    parser.add_argument(
        "--sessions", type=int, default=None,
        help="agent sessions at once (default: enough that the turn gap does not cap the rate)",
    )  # fmt: skip
    parser.add_argument(
        "--turn-gap",
        type=float,
        default=20.0,
        help="seconds at least between a session's turns (its answer, its tool)",
    )
    parser.add_argument(
        "--scale", type=float, default=0.015,
        help="prompt-side token lengths of the generated trace x this (default %(default)s); "
        "answers keep production's lengths",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--burst", type=int, default=0,
        help="add this many low-hit requests mid-trace, 0.5 s apart (the load the RLD guard "
        "is for; compare PDD with `PDD no RLD guard`)",
    )  # fmt: skip
    parser.add_argument(
        "--max-new",
        type=int,
        default=512,
        help="cap on each answer (the trace's output length otherwise)",
    )
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument(
        "--rate",
        type=float,
        default=0.15,
        help="requests per second, Poisson, open loop (default %(default)s)",
    )
    pace.add_argument(
        "--rates",
        default=None,
        help="comma-separated rates: every deployment at each; reports SLA goodput",
    )
    pace.add_argument("--concurrency", type=int, default=None, help="closed loop instead")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    add_flow_window_argument(parser)
    parser.add_argument("--ttft-sla", type=float, default=3.0)
    parser.add_argument(
        "--route-ttft",
        type=float,
        default=1.0,
        help="the first-token target PDD's router routes by (its --ttft-sla): P->MD when met, "
        "RLD hides the WAN otherwise. Tighter than the SLA (default %(default)s s, about "
        "same-DC PD's TTFT P99 here: 0.55-0.96 s at 0.3-0.6 req/s) so that PDD's TTFT tail "
        "stays near same-DC PD's; a tighter one relays more turns and moves the tail by little "
        "(0.7 s on seed 0: TTFT P99 0.51-0.61 s against 0.65-0.76, RLD 2-7%% of tokens)",
    )
    parser.add_argument("--tpot-sla", type=float, default=0.5)
    parser.add_argument("--deployments", default=",".join(DEFAULT_DEPLOYMENTS),
                        help="comma-separated, in this order, from: "
                        + ", ".join(d.name for d in DEPLOYMENTS)
                        + " (default: all but the last)")  # fmt: skip
    parser.add_argument(
        "--pool",
        type=int,
        default=None,
        help="KV tokens on P and MD (default: 2x the trace's working set)",
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                        help="every server's; float32 so that the outputs-equal column is exact "
                             "(in bf16 a greedy near-tie can flip with the batch)")  # fmt: skip
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false",
        help="let every server run on every CPU (default: P and a small RLD on the first half, "
        "the decoders on the other, as each tier has chips of its own in production)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs/live"))
    args = parser.parse_args(argv)
    unknown = set(args.deployments.split(",")) - {d.name for d in DEPLOYMENTS}
    if unknown:
        parser.error(f"unknown deployments {sorted(unknown)}; choose from "
                     f"{[d.name for d in DEPLOYMENTS]}")  # fmt: skip
    try:
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    except ValueError:
        parser.error(f"--rates {args.rates!r}: give numbers separated by commas")
    if args.burst < 0 or (args.burst and args.trace is not None):
        parser.error("--burst takes a count >= 0, for a generated trace (not with --trace)")
    if any(r <= 0 for r in rates):
        parser.error("rates must be > 0")
    args.pace_rates = [None] if args.concurrency is not None else rates
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [d for d in DEPLOYMENTS if d.name in args.deployments.split(",")]
    exit_on_sigterm()

    spec = TraceSpec(args.trace, args.requests, args.sessions, args.scale, args.seed,
                     args.turn_gap, args.burst)  # fmt: skip
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    cache: dict[tuple[int, int], list[int]] = {}
    paces = []
    for rate in args.pace_rates:
        trace = trace_at(spec, rate)
        paces.append(Pace(rate, trace, [materialize(req, vocab, cache) for req in trace]))
    warm = [materialize(req, vocab, cache) for req in warmup(spec)]
    pool, peak = pool_tokens([p.trace for p in paces], args.max_new)
    if args.pool is not None:
        pool = args.pool
    print(f"KV pool on P and MD: {pool} tokens = {pool / max(peak, 1):.2f}x the trace's peak "
          f"working set ({peak} tokens of live sessions' prompt + answer)", flush=True)  # fmt: skip
    hits = hit_rate_summary(paces[0].trace)
    sla = Sla(args.ttft_sla, args.tpot_sla)
    outs = [min(r.output_tokens, args.max_new) for r in paces[0].trace]
    title = (
        f"{args.model.name}, {len(paces[0].trace)} requests a pass (mean hit "
        f"{hits['mean_hit']:.0%}, mean prompt {hits['mean_prompt_tokens']:.0f} tokens, mean "
        f"answer {sum(outs) / len(outs):.0f} tokens), WAN {args.rate_mbit:.0f} Mbit/s, RTT "
        f"{2 * args.delay_ms:.0f} ms, TCP window {args.flow_window_mb:g} MB per flow, KV pool "
        f"{pool} tokens ({pool / max(peak, 1):.1f}x working set), "
        f"SLA TTFT P90 <= {sla.ttft_s:g}s, TPOT P90 <= {sla.tpot_s:g}s"
    )
    print(title, flush=True)
    pool_args = ("--max-total-tokens", str(pool))
    tb = Testbed("pddlive", LinkParams(args.rate_mbit, args.delay_ms), net="10.229",
                 flow_window_mb=args.flow_window_mb)  # fmt: skip
    tb.down()
    tb.up()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[float | None, Run]] = {d.name: {} for d in chosen}
    outputs: dict[str, dict[float | None, Outputs]] = {d.name: {} for d in chosen}
    estimates: dict[str, dict] = {}
    capacity: dict[str, dict[str, int | None]] = {}
    try:
        for group in dict.fromkeys(d.group for d in chosen):
            routers: dict[str, RouterService] = {}
            deps = [d for d in chosen if d.group == group]
            first = deps[0]
            cpus = tier_cpus(first.relay_fraction) if args.pin else {}
            pdd = PDDDeployment.create(
                args.model, args.out / f"servers_{group}", tb.placement("a"),
                tb.placement("b"), main_args=pool_args, prefill_args=pool_args,
                decode_cache=first.decode_cache, router_args=first.router_args(args.route_ttft),
                relay_fraction=first.relay_fraction, server_args=("--dtype", args.dtype),
                server_env=SERVER_ENV,
                server_cpus=cpus,
            )  # fmt: skip
            try:
                print(f"starting P + RLD ({first.relay_fraction:g} of MD) in A, MD in B, router "
                      f"in A; CPUs by role {cpus or 'shared'}; "
                      f"decode cache {first.decode_cache}; "
                      f"{first.router_args(args.route_ttft)}",
                      flush=True)  # fmt: skip
                pdd.up()
                group_routers(deps, pdd, args.route_ttft, routers)
                capacity[group] = served_capacity(pdd.url)
                print(f"[{group}] decoders (requests at once, RLD's KV): {capacity[group]}",
                      flush=True)  # fmt: skip
                for pace in paces:
                    for dep in deps:
                        router = routers[dep.name]
                        run, out = run_pass(
                            dep.name,
                            dep.path,
                            router,
                            pdd,
                            tb,
                            pace,
                            warm,
                            args.max_new,
                            args.concurrency,
                        )
                        runs[dep.name][pace.rate], outputs[dep.name][pace.rate] = run, out
                        estimates[dep.name] = router_estimates(router.url)
                print(f"[{group}] router's estimates: {estimates[deps[-1].name]}", flush=True)
            finally:
                extra = [r for r in routers.values() if r is not pdd.router]
                stop_groups([r.process.pgid for r in extra if r.process is not None])
                pdd.down()
    finally:
        tb.down()

    meta = {
        # The routers' RLD-alone limit (their default) too: sim --calibrate replays with it.
        "args": {
            **{k: str(v) for k, v in vars(args).items()},
            "rate": str(args.pace_rates[0]),
            "singular_max_new": str(PathPolicy.singular_max_new),
        },
        "link": {"rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms},
        "model": {
            "name": args.model.name,
            "dtype": args.dtype,
            "kv_bytes_per_token": kv_bytes_per_token(args.model, DTYPE_BYTES[args.dtype]),
        },
        "pool": {
            "tokens": pool,
            "working_set_tokens": peak,
            "working_sets": [working_set(p.trace, args.max_new) for p in paces],
        },  # fmt: skip
        "trace_summary": hits,
        "router_estimates": estimates,
        # PDD's decoders as the servers report them (what sim --calibrate sizes its tiers by).
        "capacity": capacity.get("pdd") or next(iter(capacity.values()), {}),
        "capacity_by_group": capacity,
    }
    summaries, _ = report(runs, outputs, sla, title, meta, args.out)
    return 1 if any(s["failed"] for s in summaries.values()) else 0
