"""`python -m pdd.eval sim | plan | repro`: the cluster simulator from the command line.

    python -m pdd.eval sim --requests 400 --rate 4 --out /tmp/sim
    python -m pdd.eval sim --trace trace.jsonl --kinds cache,pdd --md 4x8B --json
    python -m pdd.eval sim --calibrate runs/live/live.json --out /tmp/calib
    python -m pdd.eval plan --p-chips A,B --md-chips A,B --budget 90
    python -m pdd.eval repro --out /tmp/repro

Deployments are written NxKC: N instances of K chips of type C (chips: A, B), e.g. 5x7A; an
instance is one SGLang server at --tp-size K (one model copy), printed as "5 x TP7 A".
`sim` prints one row per deployment kind (same-dc, naive, cache, pdd); `plan` ranks counts of
P, RLD and MD by BCR (SLA throughput / hardware cost); `repro` reruns the paper's numbers
(a: bandwidth feasibility, b: bathtub, c: cost table, d: handoff microbenchmark).
Workloads: a trace file (pdd.eval trace), the agentic generator (pdd.eval.workload, or a
built-in stand-in when that module is missing), or fixed requests (--workload fixed).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdd.eval.sim.config import KINDS, ClusterConfig, Sla, Tier, deployment
from pdd.eval.sim.hardware import CHIPS, LINKS, MOE_1T, Model
from pdd.eval.sim.model_config import PRESETS, describe, resolve_model
from pdd.eval.sim.render import bathtub_plot, cdf_plot, plan_table, sim_table
from pdd.eval.sim.requests import (
    SimRequest,
    agentic_requests,
    as_sim_request,
    fixed_requests,
    rescale,
)
from pdd.eval.sim.simulation import simulate
from pdd.policy.handoff import MODES, HandoffPolicy
from pdd.policy.path import PathPolicy

COMMANDS = ("sim", "plan", "repro")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_tier(spec: str, max_batch: int = 128) -> Tier:
    """NxKC -> Tier: N instances of K chips of type C (e.g. 5x7A)."""
    m = re.fullmatch(r"(\d+)x(\d+)([A-Za-z][\w-]*)", spec.strip())
    if not m or m.group(3) not in CHIPS:
        raise argparse.ArgumentTypeError(f"expected NxKC with C in {sorted(CHIPS)}, got {spec!r}")
    return Tier(CHIPS[m.group(3)], int(m.group(1)), int(m.group(2)), max_batch)


def _counts(spec: str) -> list[int]:
    """ "2-8" or "0,1,2" -> a list of counts."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _chips(spec: str) -> list[Any]:
    try:
        return [CHIPS[c.strip()] for c in spec.split(",") if c.strip()]
    except KeyError as err:
        raise argparse.ArgumentTypeError(f"unknown chip {err}; known: {sorted(CHIPS)}") from None


# ----------------------------------------------------------------------------------------------
# Shared options


def _add_workload(p: argparse.ArgumentParser, requests: int, rate: float) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", type=Path, help="a trace file (JSONL, pdd.eval trace)")
    g.add_argument("--workload", choices=("agentic", "fixed"), default="agentic")
    g.add_argument("--requests", type=int, default=requests)
    g.add_argument("--rate", type=float, default=rate, help="requests/s (default %(default)s)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mean-hit", type=float, default=0.9, help="agentic: mean prefix hit")
    g.add_argument("--prompt", type=int, default=63_000, help="fixed: prompt tokens")
    g.add_argument("--hit", type=float, default=0.9, help="fixed: prefix hit of each request")
    g.add_argument("--output", type=int, default=1000, help="fixed: output tokens")


def _model_arg(given: str) -> Model:
    try:
        return resolve_model(given)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--model", type=_model_arg, default="moe-1t",
        help=f"a preset ({', '.join(sorted(PRESETS))}; default %(default)s) or a model "
        "directory: its config.json gives the sizes, KV per token for GQA or MLA",
    )  # fmt: skip
    g.add_argument("--p", type=parse_tier, default=None, help="P tier (default 5x7A)")
    g.add_argument("--rld", type=parse_tier, default=None, help="RLD tier (default 1x8A)")
    g.add_argument("--md", type=parse_tier, default=None, help="MD tier (default 4x8B)")
    g.add_argument("--base-p", type=parse_tier, default=None, help="same-dc P (default 5x8A)")
    g.add_argument("--base-d", type=parse_tier, default=None, help="same-dc D (default 6x8A)")
    g.add_argument("--max-batch", type=int, default=128, help="decode slots per instance")
    g.add_argument("--link", choices=sorted(LINKS), default="wan")
    g.add_argument("--gbit", type=float, help="override the link's line rate")
    g.add_argument("--rtt-ms", type=float, help="override the link's RTT")
    g.add_argument("--jitter-ms", type=float, help="override the link's mean one-way jitter")
    g.add_argument("--tcp-window-mb", type=float, help="override the per-flow TCP window")
    g.add_argument("--path", choices=("auto", "pdd", "relay", "main"), default="auto")
    g.add_argument("--handoff", choices=MODES, default="auto")
    g.add_argument(
        "--no-relay-guard",
        action="store_true",
        help="let low-hit requests onto a full RLD (the collapse the guard prevents)",
    )
    g.add_argument("--hot-set-tokens", type=int, help="reused prefix tokens (MD cache pressure)")
    g.add_argument("--wan-cost", type=float, default=0.33, help="the WAN line, chip-A units")
    s = p.add_argument_group("SLA")
    s.add_argument("--ttft-sla", type=float, default=10.0, help="seconds (default %(default)s)")
    s.add_argument("--tpot-sla", type=float, default=0.06, help="seconds (default %(default)s)")
    s.add_argument("--quantile", type=float, default=0.99, help="checked percentile, 0-1")


def _sla(a: argparse.Namespace) -> Sla:
    return Sla(a.ttft_sla, a.tpot_sla, a.quantile)


def _base_config(a: argparse.Namespace, kind: str) -> ClusterConfig:
    link = LINKS[a.link]
    over = {k: v for k, v in (("gbit_s", a.gbit), ("rtt_ms", a.rtt_ms), ("jitter_ms",
            a.jitter_ms), ("tcp_window_mb", a.tcp_window_mb)) if v is not None}  # fmt: skip
    cfg = deployment(
        kind,
        model=a.model,
        link=replace(link, **over),
        path=a.path,
        handoff=HandoffPolicy(mode=a.handoff),
        path_policy=PathPolicy(guard=not a.no_relay_guard),
        hot_set_tokens=a.hot_set_tokens,
        wan_cost=a.wan_cost,
        seed=a.seed,
    )
    batch = a.max_batch

    def tier(t: Tier | None, default: Tier) -> Tier:
        return replace(t or default, max_batch=batch)

    if kind == "same-dc":
        return replace(cfg, prefill=tier(a.base_p, cfg.prefill), main=tier(a.base_d, cfg.main))
    relay = cfg.relay if kind == "pdd" else None
    return replace(
        cfg,
        prefill=tier(a.p, cfg.prefill),
        main=tier(a.md, cfg.main),
        relay=tier(a.rld, relay) if relay is not None else None,
    )


def _agentic(n: int, rate: float, seed: int, mean_hit: float) -> list[SimRequest]:
    try:
        from pdd.eval.workload import WorkloadConfig, generate
    except ModuleNotFoundError:
        return agentic_requests(n, rate, seed)
    trace = generate(WorkloadConfig(seed=seed, requests=n, rate=rate, mean_hit=mean_hit))
    return [as_sim_request(r) for r in trace]


def _requests(a: argparse.Namespace) -> list[SimRequest]:
    if a.trace:
        from pdd.eval.trace import read_trace

        reqs = [as_sim_request(r) for r in read_trace(a.trace)][: a.requests]
        return rescale(reqs, a.rate) if a.rate else reqs
    if a.workload == "fixed":
        return fixed_requests(a.requests, a.rate, a.prompt, a.hit, a.output, a.seed)
    return _agentic(a.requests, a.rate, a.seed, a.mean_hit)


def _maker(a: argparse.Namespace, window_s: float) -> Callable[[float], list[SimRequest]]:
    """Requests for a window of `window_s` seconds at any rate: one stream, rescaled."""
    pool = _requests(a)

    def make(rate: float) -> list[SimRequest]:
        n = max(20, min(len(pool), round(rate * window_s)))
        return rescale(pool[:n], rate)

    return make


def _write(out: Path, name: str, text: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------
# sim

SIM_DOC = "Simulates the workload on each deployment kind and prints their metrics side by side."


def _sim(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pdd.eval sim", description=SIM_DOC)
    _add_workload(p, requests=400, rate=4.0)
    _add_cluster(p)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma list of " + ", ".join(KINDS))
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", type=Path, help="write sim.json, sim.md, ttft_cdf.png here")
    p.add_argument("--per-request", action="store_true", help="JSON: include every request")
    p.add_argument("--calibrate", type=Path, metavar="LIVE_JSON",
                   help="fit to a live run (pdd.eval live's live.json), predict each of its "
                   "deployments, print the errors; --out: write calib.json, calib.md")  # fmt: skip
    a = p.parse_args(argv)
    if a.calibrate:
        return _calibrate(a.calibrate, a.out)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"unknown kinds {bad}; choose from {KINDS}")
    sla = _sla(a)
    reqs = _requests(a)
    _log(f"sim: {len(reqs)} requests over {reqs[-1].arrival_s:.0f} s" if reqs else "sim: none")
    results = []
    for kind in kinds:
        t = time.monotonic()
        cfg = _base_config(a, kind)
        res = simulate(reqs, cfg, sla)
        results.append(res)
        _log(f"sim: {cfg.describe()}: {res.events} events in {time.monotonic() - t:.1f} s")
    table = sim_table(results, sla)
    doc = {
        "workload": {"requests": len(reqs), "source": str(a.trace or a.workload)},
        "sla": sla.__dict__,
        "runs": [r.to_dict(a.per_request) for r in results],
    }
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        print(table, end="")
    if a.out:
        _write(a.out, "sim.json", json.dumps(doc, indent=1, default=str))
        _write(a.out, "sim.md", table)
        cdf_plot(results, a.out / "ttft_cdf.png")
        _log(f"sim: wrote {a.out}/sim.json, sim.md, ttft_cdf.png")
    return 0


def _calibrate(live: Path, out: Path | None) -> int:
    from pdd.eval.sim.calibrate import calibrate, load

    try:
        cal = calibrate(load(live))
    except (OSError, ValueError, KeyError) as err:
        print(f"error: cannot calibrate on {live}: {err!r}", file=sys.stderr)
        return 1
    print(cal.markdown(), end="")
    if out:
        _write(out, "calib.json", json.dumps(cal.to_dict(), indent=1))
        _write(out, "calib.md", cal.markdown())
        _log(f"sim: wrote {out}/calib.json, calib.md")
    return 0


# ----------------------------------------------------------------------------------------------
# plan

PLAN_DOC = (
    "Recommends counts of P, RLD and MD (and their chips) that maximise BCR = SLA throughput /\n"
    "hardware cost: an analytic model screens every candidate, the simulator measures the best."
)


def _plan(argv: list[str]) -> int:
    from pdd.eval.sim.planner import PlanSpace, plan

    p = argparse.ArgumentParser(prog="python -m pdd.eval plan", description=PLAN_DOC)
    _add_workload(p, requests=3000, rate=1.0)
    _add_cluster(p)
    g = p.add_argument_group("search")
    g.add_argument("--p-counts", type=_counts, default=_counts("2-8"))
    g.add_argument("--rld-counts", type=_counts, default=_counts("0-2"))
    g.add_argument("--md-counts", type=_counts, default=_counts("1-6"))
    g.add_argument("--p-chips", type=_chips, default=_chips("A"))
    g.add_argument("--rld-chips", type=_chips, default=_chips("A"))
    g.add_argument("--md-chips", type=_chips, default=_chips("B"))
    g.add_argument(
        "--chips-per-instance",
        type=int,
        default=8,
        help="the TP size of every P, RLD and MD instance (default %(default)s)",
    )
    g.add_argument("--budget", type=float, help="hardware cost ceiling (chip-A units)")
    g.add_argument("--max-chips", type=int)
    g.add_argument("--top", type=int, default=4, help="candidates to simulate")
    g.add_argument("--window", type=float, default=60.0, help="arrival window per run, s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="write plan.json and plan.md here")
    a = p.parse_args(argv)
    sla = _sla(a)
    space = PlanSpace(
        p_counts=a.p_counts, rld_counts=a.rld_counts, md_counts=a.md_counts,
        p_chips=a.p_chips, rld_chips=a.rld_chips, md_chips=a.md_chips,
        chips_per_instance=a.chips_per_instance, budget=a.budget, max_chips=a.max_chips,
    )  # fmt: skip
    t = time.monotonic()
    make = _maker(a, a.window)
    ranked = plan(_base_config(a, "pdd"), space, make, sla, top=a.top, progress=_log)
    if not ranked:
        print("no candidate fits the budget and the model's memory")
        return 1
    best = ranked[0]
    verdict = (
        f"Recommended: {best.config.describe()} (cost {best.cost:.1f}): "
        + (
            f"{best.rate:.2f} req/s within the SLA, BCR {best.bcr:.3f} req/s per cost unit"
            if best.bcr is not None
            else "no simulated candidate met the SLA; analytic ranking shown"
        )
        + f". SLA: P{round(sla.quantile * 100)} TTFT <= {sla.ttft_s:g} s, TPOT <= "
        f"{sla.tpot_s * 1e3:g} ms. {len(ranked)} candidates, {time.monotonic() - t:.1f} s."
    )
    instances = f"Instances: {best.config.instances()} (each tier's TP size: --chips-per-instance)."
    table = plan_table(ranked, 10) + "\n" + verdict + "\n" + instances + "\n"
    doc = {"sla": sla.__dict__, "candidates": [c.to_dict() for c in ranked[:20]]}
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        print(table, end="")
    if a.out:
        _write(a.out, "plan.json", json.dumps(doc, indent=1))
        _write(a.out, "plan.md", table)
    return 0


# ----------------------------------------------------------------------------------------------
# repro

REPRO_DOC = "Reruns the paper's numbers in the simulator; each table shows the paper beside ours."
PARTS = {"a": "feasibility", "b": "bathtub", "c": "cost", "d": "handoff"}


def _repro(argv: list[str]) -> int:
    from pdd.eval.sim import economics as ec
    from pdd.eval.sim.handoff_bench import handoff_microbench

    p = argparse.ArgumentParser(prog="python -m pdd.eval repro", description=REPRO_DOC)
    p.add_argument("--only", default="abcd", help="which of a, b, c, d (default all)")
    p.add_argument("--out", type=Path, help="write repro.md, repro.json, bathtub.png here")
    p.add_argument("--jobs", type=int, help="processes for the bathtub (default: CPUs)")
    p.add_argument("--quick", action="store_true", help="shorter runs, fewer bathtub points")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if bad := set(a.only) - set(PARTS):
        p.error(f"--only takes letters from {''.join(PARTS)}, got {''.join(sorted(bad))}")
    repros = []
    t0 = time.monotonic()
    for part in sorted(set(a.only)):
        t = time.monotonic()
        _log(f"repro: ({part}) {PARTS[part]} ...")
        if part == "a":
            repros.append(ec.feasibility())
        elif part == "b":
            hits = (0.0, 0.4, 0.7, 0.9, 1.0) if a.quick else ec.BATHTUB_HITS
            repros.append(ec.bathtub(hits, window_s=30 if a.quick else 45, jobs=a.jobs,
                                     progress=_log))  # fmt: skip
        elif part == "c":
            repros.append(ec.cost_table(window_s=60 if a.quick else 100, progress=_log))
        else:
            repros.append(handoff_microbench(samples=500 if a.quick else 2000))
        _log(f"repro: ({part}) done in {time.monotonic() - t:.1f} s")
    # The paper's model class (its own KV size: compressed, MLA-class), not a dense model's.
    assumed = f"Every figure assumes the model {describe(MOE_1T)}.\n\n"
    text = assumed + "\n".join(r.markdown() for r in repros)
    doc = [r.to_dict() for r in repros]
    print(json.dumps(doc, indent=1, default=str) if a.json else text)
    if a.out:
        _write(a.out, "repro.md", text)
        _write(a.out, "repro.json", json.dumps(doc, indent=1, default=str))
        for r in repros:
            if r.name == "bathtub":
                bathtub_plot(r.data["points"], a.out / "bathtub.png")
        _log(f"repro: wrote {a.out} ({time.monotonic() - t0:.0f} s in all)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; expected one of {COMMANDS}", file=sys.stderr)
        return 2
    return {"sim": _sim, "plan": _plan, "repro": _repro}[command](rest)


if __name__ == "__main__":
    sys.exit(main())
