"""Live runs on the testbed: one agentic workload through four deployments.

    python -m pdd.eval live [--model models/wide] [--requests 300] [--concurrency 2 | --rate R]
                            [--trace FILE] [--scale 0.015] [--max-new 32] [--rate-mbit 100]
                            [--delay-ms 20] [--ttft-sla 3] [--tpot-sla 0.5] [--dtype float32]
                            [--out runs/live]

Needs root. Brings up its own testbed (name `pddlive`): P and RelayDecode (RLD) in datacenter
A, MainDecode (MD) in B, the PDD router in A, the emulated WAN between them. The same requests
(an agentic trace from pdd.eval.workload, or --trace) go through, in turn:
- same-DC PD: P -> RLD, the KV stays in datacenter A (the latency baseline);
- naive cross-DC PD: P -> MD with no decode-side cache: every prompt's KV crosses the WAN;
- cross-DC PD + decode cache: P -> MD, only the suffix MD lacks crosses;
- PDD: the router's path policy (P->MD, P->RLD->MD or P->RLD per request).
Caches are flushed before each deployment's pass, so each starts cold. Reports TTFT, TPOT and
end-to-end P50/P90/P99, SLA goodput, WAN bytes (the link's own counter), RLD's share of the
output tokens and whether each output equals the first deployment's (greedy, so they must);
prints a table with progress lines while it runs, and writes a markdown report, JSON and a PNG
to --out.

Scale: a 2-core CPU prefills ~1000x slower than a GPU, so the trace's lengths are scaled down
(--scale: production-like contexts of 2K-128K tokens become tens to ~2K tokens) and the
default model is `wide` (a tiny model's compute with 32 KB of KV per token, like a large model),
so the WAN, not the CPU, decides TTFT as it does in production.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pdd.eval.client import flush_cache, stream_generate
from pdd.eval.replay import replay
from pdd.eval.report import Record, Run, Sla, markdown_table, plot_runs
from pdd.eval.trace import read_trace
from pdd.eval.workload import TraceRequest, WorkloadConfig, generate, hit_rate_summary, materialize
from pdd.launch.cli import command_parser
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import exit_on_sigterm
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import DTYPE_BYTES, kv_bytes_per_token


@dataclass(frozen=True)
class Deployment:
    name: str
    decode_cache: bool  # MD keeps a radix tree of the KV it holds
    path: str | None  # the path every request asks for; None: the router's auto policy


DEPLOYMENTS = [
    Deployment("same-DC PD", True, "relay"),
    Deployment("naive cross-DC PD", False, "main"),
    Deployment("cross-DC PD + decode cache", True, "main"),
    Deployment("PDD", True, None),
]
REQUEST_TIMEOUT_S = 600.0


def workload(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace to replay: --trace, or a generated agentic trace scaled to this machine."""
    if args.trace is not None:
        return read_trace(args.trace)[: args.requests]
    cfg = WorkloadConfig(seed=args.seed, requests=args.requests, sessions=args.sessions)
    cfg = replace(cfg.scaled(args.scale), output_median=max(2, args.max_new // 2),
                  output_range=(1, args.max_new))  # fmt: skip
    return generate(cfg)


def run_pass(dep: Deployment, pdd: PDDDeployment, tb: Testbed, prompts: list[list[int]],
             trace: list[TraceRequest], args: argparse.Namespace,
             ) -> tuple[Run, list[list[int] | None]]:  # fmt: skip
    """One deployment's pass over the trace: records and each request's output ids."""
    outputs: list[list[int] | None] = [None] * len(trace)
    index = {req.id: i for i, req in enumerate(trace)}

    def send(req: TraceRequest) -> Record:
        i = index[req.id]
        sampling = {"temperature": 0, "max_new_tokens": min(req.output_tokens, args.max_new),
                    "ignore_eos": True}  # fmt: skip
        body: dict = {"input_ids": prompts[i], "sampling_params": sampling}
        if dep.path is not None:
            body["pdd_path"] = dep.path
        got = stream_generate(pdd.url, body, timeout=REQUEST_TIMEOUT_S)
        final = got.final
        meta = final["meta_info"].get("pdd") or {}
        outputs[i] = list(final["output_ids"])
        return Record(len(prompts[i]), req.cached_tokens, None, len(final["output_ids"]),
                      got.ttft_s, got.total_s, meta.get("path"), meta.get("relay_tokens") or 0,
                      meta.get("wan_kv_bytes") or 0,
                      path_reason=meta.get("path_reason"))  # fmt: skip

    for server in pdd.servers():  # each deployment's pass starts cold
        flush_cache(server.url)
    router_sees_flush(pdd.url)
    before = int(tb.wan.status()["counters"]["a_to_b"]["bytes"])
    start = time.monotonic()
    pace = {"concurrency": args.concurrency} if args.rate is None else {"rate": args.rate}
    results = replay(trace, send, **pace, timeout_s=REQUEST_TIMEOUT_S, progress_every=5,
                     log=lambda line: print(f"[{dep.name}] {line}", flush=True))  # fmt: skip
    run = Run(dep.name, wall_s=time.monotonic() - start)
    run.wan_link_bytes = int(tb.wan.status()["counters"]["a_to_b"]["bytes"]) - before
    for res, req in zip(results, trace, strict=True):
        if res.ok:
            run.records.append(replace(res.value, start_s=res.start_s))
        else:
            run.records.append(Record(req.prompt_tokens, req.cached_tokens, res.start_s,
                                      error=res.error))  # fmt: skip
            print(f"[{dep.name}] request {req.id} FAILED: {res.error}", flush=True)
    return run, outputs


def router_status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/status", timeout=30) as resp:
        status: dict = json.loads(resp.read())
    return status


def router_sees_flush(url: str, timeout_s: float = 10.0) -> None:
    """Waits until the router's mirror of MD's cache is empty after the flush (MD's next cache
    sync): a pass started before plans its first requests on KV that MD no longer holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        caches = router_status(url)["md_caches"]
        if all(c["blocks"] == 0 for c in caches.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router still mirrors MD's cache {timeout_s:g}s after the "
                               f"flush: {caches}")  # fmt: skip
        time.sleep(0.1)


def router_estimates(url: str) -> dict:
    """What the router has learnt after a pass (its path choices rest on it): the WAN to MD,
    RLD's time per token, P's time per prompt token."""
    status = router_status(url)
    return {"wan": status["instances"]["main"][0]["wan"], "relay_tpot_s": status["relay_tpot_s"],
            "prefill_s_per_token": status["prefill_s_per_token"]}  # fmt: skip


def agreement(outputs: list[list[list[int] | None]]) -> list[float]:
    """Per deployment, the share of requests whose output equals the first deployment's."""
    base = outputs[0]
    shares = []
    for outs in outputs:
        pairs = [(o, b) for o, b in zip(outs, base, strict=True) if o is not None and b is not None]
        shares.append(sum(o == b for o, b in pairs) / max(len(pairs), 1))
    return shares


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("pdd.eval live", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/wide"))
    parser.add_argument("--trace", type=Path, default=None, help="replay this trace instead")
    parser.add_argument(
        "--requests", type=int, default=300,
        help="default %(default)s: at 120 the TTFT P99 (one or two requests) moved 20-25%% "
        "between runs",
    )  # fmt: skip
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument(
        "--scale", type=float, default=0.015,
        help="token lengths of the generated trace x this (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new", type=int, default=32)
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument("--concurrency", type=int, default=2)
    pace.add_argument("--rate", type=float, default=None, help="requests per second, open loop")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    add_flow_window_argument(parser)
    parser.add_argument("--ttft-sla", type=float, default=3.0)
    parser.add_argument("--tpot-sla", type=float, default=0.5)
    parser.add_argument("--deployments", default=",".join(d.name for d in DEPLOYMENTS),
                        help="comma-separated subset, in this order")  # fmt: skip
    parser.add_argument("--pool", type=int, default=None, help="KV tokens on P and MD")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                        help="every server's; float32 so that the outputs-equal column is exact "
                             "(in bf16 a greedy near-tie can flip with the batch)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs/live"))
    args = parser.parse_args(argv)
    chosen = [d for d in DEPLOYMENTS if d.name in args.deployments.split(",")]
    unknown = set(args.deployments.split(",")) - {d.name for d in DEPLOYMENTS}
    if unknown or not chosen:
        parser.error(f"unknown deployments {sorted(unknown)}; choose from "
                     f"{[d.name for d in DEPLOYMENTS]}")  # fmt: skip
    exit_on_sigterm()

    trace = workload(args)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    cache: dict[tuple[int, int], list[int]] = {}
    prompts = [materialize(req, vocab, cache) for req in trace]
    hits = hit_rate_summary(trace)
    sla = Sla(args.ttft_sla, args.tpot_sla)
    title = (
        f"{args.model.name}, {len(trace)} requests (mean hit {hits['mean_hit']:.0%}), "
        f"WAN {args.rate_mbit:.0f} Mbit/s, RTT {2 * args.delay_ms:.0f} ms, "
        f"TCP window {args.flow_window_mb:g} MB per flow, "
        f"SLA TTFT <= {sla.ttft_s:g}s, TPOT <= {sla.tpot_s:g}s"
    )
    print(title, flush=True)
    pool = () if args.pool is None else ("--max-total-tokens", str(args.pool))
    tb = Testbed(
        "pddlive",
        LinkParams(args.rate_mbit, args.delay_ms),
        net="10.229",
        flow_window_mb=args.flow_window_mb,
    )
    tb.down()
    tb.up()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    outputs: dict[str, list[list[int] | None]] = {}
    estimates: dict[str, dict] = {}
    try:
        for decode_cache in (False, True):
            group = [d for d in chosen if d.decode_cache == decode_cache]
            if not group:
                continue
            pdd = PDDDeployment.create(args.model, args.out / f"servers_drc_{decode_cache}",
                                       tb.placement("a"), tb.placement("b"), main_args=pool,
                                       prefill_args=pool, decode_cache=decode_cache,
                                       server_args=("--dtype", args.dtype))  # fmt: skip
            try:
                print(f"starting P + RLD (A), MD (B), router (A); decode cache {decode_cache}",
                      flush=True)  # fmt: skip
                pdd.up()
                for dep in group:
                    runs[dep.name], outputs[dep.name] = run_pass(dep, pdd, tb, prompts, trace,
                                                                 args)  # fmt: skip
                    estimates[dep.name] = router_estimates(pdd.url)
                    print(f"[{dep.name}] router's estimates: {estimates[dep.name]}", flush=True)
            finally:
                pdd.down()
    finally:
        tb.down()

    ordered = [d.name for d in chosen]
    summaries = {name: runs[name].summary(sla) for name in ordered}
    for name, share in zip(ordered, agreement([outputs[n] for n in ordered]), strict=True):
        summaries[name]["same_output"] = share
    table = markdown_table(summaries)
    same = "; ".join(f"{n}: {summaries[n]['same_output']:.0%}" for n in ordered)
    print(f"\n{title}\n{table}\noutputs equal to {ordered[0]}'s: {same}")
    report = (f"# Live run\n\n{title}\n\n{table}\n\nOutputs equal to {ordered[0]}'s: {same}\n\n"
              f"![TTFT and WAN](live.png)\n")  # fmt: skip
    (args.out / "live.md").write_text(report)
    data = {
        "title": title,
        "args": {k: str(v) for k, v in vars(args).items()},
        "link": {"rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms},
        "model": {
            "name": args.model.name,
            "dtype": args.dtype,
            "kv_bytes_per_token": kv_bytes_per_token(args.model, DTYPE_BYTES[args.dtype]),
        },
        "trace_summary": hits,
        "summaries": summaries,
        "runs": {n: [asdict(r) for r in runs[n].records] for n in ordered},
        "router_estimates": estimates,
    }
    (args.out / "live.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_runs([runs[n] for n in ordered], sla, args.out / "live.png", title)
    print(f"wrote {args.out}/live.md, live.json and live.png")
    return 1 if any(s["failed"] for s in summaries.values()) else 0
