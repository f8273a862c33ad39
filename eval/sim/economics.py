"""The paper's numbers, reproduced from the model: each table puts the paper's figure beside
ours and says why they differ.

(a) bandwidth feasibility: the KV a prefill cluster produces versus a WAN line;
(b) the bathtub: SLA throughput versus prefix hit rate;
(c) the cost table: 88 chips A in one datacenter versus 43 A + 32 B + a WAN line;
(d) the 100-token handoff microbenchmark: ship the KV over the WAN or recompute it on MD
    (handoff_bench.py).

Our inputs are stand-ins (see hardware.py): where a number matches the paper by construction
(an input taken from it) the note says so. Each table says which instances it simulates (TP size
= chips per instance), since the paper gives only chip counts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pdd.eval.sim.config import ClusterConfig, Sla, Tier, deployment
from pdd.eval.sim.hardware import CHIP_A, CHIP_B, LINKS, WAN, Link
from pdd.eval.sim.planner import (
    MakeRequests,
    analytic_capacity,
    capacity,
    sla_capacity,
    window,
)
from pdd.eval.sim.requests import fixed_requests
from pdd.eval.sim.simulation import simulate

Progress = Callable[[str], None]

# The paper's scenario: 64K tokens in all (63K prompt + 1K output), 90% prefix hit.
PROMPT, OUTPUT, HIT = 63_000, 1000, 0.9
SLA = Sla(ttft_s=5.0, tpot_s=0.06, quantile=0.99)
BATHTUB_SLA = Sla(ttft_s=10.0, tpot_s=0.06, quantile=0.99)  # 0%-hit 64K prefills take ~4 s


@dataclass
class Row:
    metric: str
    paper: str
    ours: str
    note: str = ""


@dataclass
class Repro:
    name: str
    title: str
    rows: list[Row]
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    instances: str = ""  # the instance sizes it assumes, e.g. "P 5 x TP7 A, ..."

    def markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.instances:
            lines += [f"Instances: {self.instances}.", ""]
        lines += ["| metric | paper | ours | note |", "|---|---|---|---|"]
        lines += [f"| {r.metric} | {r.paper} | {r.ours} | {r.note} |" for r in self.rows]
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "instances": self.instances,
            "rows": [r.__dict__ for r in self.rows],
            "notes": self.notes,
            "data": self.data,
        }


def kv_gbit_s(tokens_per_s: float, kv_bytes_per_token: float, hit: float = 0.0) -> float:
    """Gbit/s of KV to ship when `tokens_per_s` prompt tokens go through P and a decode-side
    cache already holds a `hit` fraction of them."""
    if not 0 <= hit <= 1:
        raise ValueError("hit must be in [0, 1]")
    return tokens_per_s * kv_bytes_per_token * (1 - hit) * 8 / 1e9


def bcr(rps: float, cost: float) -> float:
    """Benefit-cost ratio: SLA-satisfying requests/s per unit of hardware cost."""
    if cost <= 0:
        raise ValueError("cost must be > 0")
    return rps / cost


def change(new: float, old: float) -> float:
    """Relative change new vs old, in percent."""
    return (new / old - 1) * 100 if old else math.inf


def _pct(x: float) -> str:
    return f"{x:+.1f}%"


def scenario(hit: float = HIT, prompt: int = PROMPT, output: int = OUTPUT) -> Callable[
    [int, float], list[Any]
]:  # fmt: skip
    return lambda n, rate: fixed_requests(n, rate, prompt, hit, output, seed=1)


# ----------------------------------------------------------------------------------------------
# (a) bandwidth feasibility


def feasibility(config: ClusterConfig | None = None, sla: Sla = SLA) -> Repro:
    cfg = config or deployment("pdd")
    kvb = cfg.model.kv_bytes_per_token
    sample = fixed_requests(200, 1.0, PROMPT, HIT, OUTPUT)
    p_rps = analytic_capacity(cfg, sample, sla)["P"]
    tokens = p_rps * PROMPT
    cold = fixed_requests(50, 1.0, PROMPT, 0.0, OUTPUT)
    p_cold = analytic_capacity(cfg, cold, sla)["P"] * PROMPT
    raw, cached = kv_gbit_s(tokens, kvb), kv_gbit_s(tokens, kvb, HIT)
    flow = cfg.link.flow_bytes_per_s
    line = cfg.link.gbit_s
    rows = [
        Row("KV per token", "10-80 KB (~50 typical)", f"{kvb / 1e3:.1f} KB",
            "input: the paper's 4649 KB per 100 tokens"),
        Row("KV of a 100K-token request", "gigabytes", f"{100_000 * kvb / 1e9:.2f} GB"),
        Row(f"prefill cluster ({cfg.prefill.chip_count} A) at 64K/90% hit", "tens of GB/s of KV",
            f"{p_rps:.1f} req/s = {tokens / 1e3:.0f}K prompt tok/s = "
            f"{tokens * kvb / 1e9:.1f} GB/s of KV", "roofline prefill of the 10% suffix"),
        Row("WAN needed without decode-side cache", "> 180 Gbit/s", f"{raw:.0f} Gbit/s",
            f"vs a {line:.0f} Gbit/s line: {'fits' if raw <= line else 'does not fit'}"),
        Row("WAN needed with decode cache (90% hit)", "~10x less", f"{cached:.1f} Gbit/s "
            f"({raw / cached:.0f}x less)", "only the uncached suffix crosses: x (1 - hit)"),
        Row("same cluster on fresh prompts (0% hit)", "-", f"{kv_gbit_s(p_cold, kvb):.0f} Gbit/s",
            "P is compute-bound: KV/s follows computed tokens, so caching on P alone "
            "raises the WAN load"),
        Row("one 64K request's KV, one TCP flow", "1-20 s", f"{PROMPT * kvb / flow:.1f} s "
            f"(90% hit: {PROMPT * (1 - HIT) * kvb / flow:.1f} s)",
            f"flow ceiling {flow * 8 / 1e9:.2f} Gbit/s: TCP window / {cfg.link.rtt_ms:.0f} ms RTT"),
        Row("KV of 80 concurrent 64K requests", "~23 GB (compressed-KV model)",
            f"{80 * 65536 * kvb / 1e9:.0f} GB", "the paper's 23 GB implies ~4.4 KB/token; "
            "ours is an uncompressed ~47 KB/token"),
    ]  # fmt: skip
    data = {"prefill_rps": p_rps, "prompt_tokens_s": tokens, "gbit_s_no_cache": raw,
            "gbit_s_cache": cached, "gbit_s_fresh": kv_gbit_s(p_cold, kvb)}  # fmt: skip
    return Repro("feasibility", "(a) Bandwidth feasibility", rows, data,
                 instances=cfg.instances())  # fmt: skip


# ----------------------------------------------------------------------------------------------
# (b) the bathtub

BATHTUB_HITS = (0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0)


def _bathtub_point(args: tuple[float, int, int, float, Sla, Link, float]) -> dict[str, Any]:
    hit, prompt, output, seconds, sla, link, tol = args
    make: MakeRequests = window(scenario(hit, prompt, output), seconds, max_requests=2000)
    point: dict[str, Any] = {"hit": hit}
    # The ideal WAN first: its capacity is the others' ceiling and a good first guess.
    runs = {
        "pdd_ideal_wan": deployment("pdd", link=LINKS["ideal"]),
        "pdd": deployment("pdd", link=link),
        "cache": deployment("cache", link=link),
    }
    guess = None
    for name, cfg in runs.items():
        if guess is None or analytic_capacity(cfg, make(1.0), sla)["capacity"] <= 0:
            cap = capacity(cfg, make, sla, rel_tol=tol, max_sims=10)
        else:
            cap = sla_capacity(cfg, make, sla, guess=guess, rel_tol=tol, max_sims=10)
        point[name] = cap.rate
        guess = max(cap.rate, 0.05)
        if name == "pdd" and cap.summary is not None:
            point["paths"] = cap.summary.paths
            point["rld_share"] = cap.summary.rld_token_share
    ideal = point["pdd_ideal_wan"]
    point["pdd_vs_ideal"] = point["pdd"] / ideal if ideal else 0.0
    return point


def _paper_bathtub(hit: float) -> str:
    if hit <= 0.1 or hit >= 0.9:
        return "high (an end of the tub)"
    if any(abs(hit - x) < 0.05 for x in (0.2, 0.4, 0.7)):
        return "sudden drop (singular point)"
    return "valley"


def bathtub(
    hits: Sequence[float] = BATHTUB_HITS,
    *,
    prompt: int = PROMPT,
    output: int = 256,
    window_s: float = 45.0,
    sla: Sla = BATHTUB_SLA,
    link: Link = WAN,
    tol: float = 0.05,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> Repro:
    """SLA capacity of PDD versus the hit rate (every request hits the same fraction), beside
    cross-DC PD with a decode cache only and PDD over an ideal WAN (its ceiling)."""
    args = [(h, prompt, output, window_s, sla, link, tol) for h in hits]
    workers = max(1, min(jobs or (os.cpu_count() or 1), len(args)))
    points: list[dict[str, Any]] = []
    if workers == 1:
        for a in args:
            points.append(_bathtub_point(a))
            if progress:
                progress(f"bathtub: hit {a[0]:.0%} done")
    else:
        with ProcessPoolExecutor(workers) as pool:
            for p in pool.map(_bathtub_point, args):
                points.append(p)
                if progress:
                    progress(f"bathtub: hit {p['hit']:.0%} done")
    rows = []
    for p in points:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(p.get("paths", {}).items()))
        rows.append(Row(
            f"hit {p['hit']:.0%}", _paper_bathtub(p["hit"]),
            f"PDD {p['pdd']:.2f} req/s ({p['pdd_vs_ideal']:.0%} of ideal-WAN "
            f"{p['pdd_ideal_wan']:.2f}); cache-only {p['cache']:.2f}", f"PDD paths: {mix}",
        ))  # fmt: skip
    valley = min(points, key=lambda p: p["pdd_vs_ideal"])
    notes = [
        f"Workload: every request {prompt} prompt tokens, {output} output tokens, the given "
        f"hit; SLA P{round(sla.quantile * 100)} TTFT <= {sla.ttft_s:g} s, TPOT <= "
        f"{sla.tpot_s * 1e3:g} ms; link {link.gbit_s:g} Gbit/s, RTT {link.rtt_ms:g} ms. "
        f"Capacities are bisected to within {tol:.0%}, so ratios carry about that much noise.",
        "Absolute SLA throughput rises with the hit rate in our model (prefill work shrinks "
        "as (1 - hit)), so no absolute bathtub: the tub shows in PDD's throughput relative to "
        "the same hardware over an ideal WAN, which is 100% at both ends and dips to "
        f"{valley['pdd_vs_ideal']:.0%} at {valley['hit']:.0%} hit.",
        "Why (checked in the runs): at low hit each transfer outlasts RLD's whole answer, so RLD "
        "serves the request (P->RLD, or P->RLD->MD finishing on RLD) and the WAN does not "
        "matter; at high hit the suffix crosses fast (P->MD); in between RLD must hold every "
        "request for its whole transfer (~5 s at 70%), the one RLD reaches relay_max_load "
        "(32), auto_path sends the overflow P->MD, and those wait for their KV, breaking the "
        "P99 TTFT. The paper's sharper drops at 20/40/70% come from its own bandwidth, model "
        "and thresholds; ours sit where auto_path's switches flip for our stand-in hardware.",
        "Cache-only cross-DC PD (no RLD): below ~60% hit the transfer alone breaks the TTFT "
        "SLA, so its SLA throughput is zero there; the RLD is what fills that side of the tub.",
    ]
    instances = f"{deployment('pdd').instances()}; cache-only: {deployment('cache').instances()}"
    return Repro("bathtub", "(b) Bathtub: SLA throughput vs hit rate", rows,
                 {"points": points}, notes, instances)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# (c) the cost table


def baseline_splits(total: int = 11, chips: int = 8) -> list[ClusterConfig]:
    """Same-datacenter PD on `total` instances of chip A, for each P/D split worth trying."""
    base = deployment("same-dc")
    return [
        replace(base, prefill=Tier(CHIP_A, p, chips), main=Tier(CHIP_A, total - p, chips))
        for p in range(3, total - 2)
    ]


def cost_table(
    *,
    prices: Sequence[float] = (1.2, 1.25, 1.3),
    sla: Sla = SLA,
    window_s: float = 100.0,
    progress: Progress | None = None,
) -> Repro:
    make = window(scenario(), window_s)
    sample = make(1.0)
    # The baseline's best split: screen all, simulate the two best.
    splits = sorted(baseline_splits(), key=lambda c: -analytic_capacity(c, sample, sla)["capacity"])
    best_base, base_cap = splits[0], None
    for cfg in splits[:2]:
        if progress:
            progress(f"cost table: {cfg.describe()}")
        cap = capacity(cfg, make, sla)
        if base_cap is None or cap.rate > base_cap.rate:
            best_base, base_cap = cfg, cap
    assert base_cap is not None
    runs: dict[str, Any] = {}
    for kind in ("pdd", "cache", "naive"):
        cfg = deployment(kind)
        if progress:
            progress(f"cost table: {cfg.describe()}")
        runs[kind] = (cfg, capacity(cfg, make, sla))
    pdd_cfg, pdd_cap = runs["pdd"]
    base_rps, pdd_rps = base_cap.rate, pdd_cap.rate
    # TTFT at one load: the baseline's SLA capacity.
    load = base_rps
    reqs = make(load)
    at_load = {
        "baseline": simulate(reqs, best_base, sla).summary,
        **{k: simulate(reqs, runs[k][0], sla).summary for k in ("pdd", "cache", "naive")},
    }
    base_cost = best_base.cost

    def pdd_cost(price: float) -> float:
        return replace(pdd_cfg, main=replace(pdd_cfg.main, chip=replace(CHIP_B, price=price))).cost

    costs = {p: pdd_cost(p) for p in prices}
    ttft = {k: s.ttft_s for k, s in at_load.items()}
    rld_share = pdd_cap.summary.rld_token_share if pdd_cap.summary else 0.0
    cost_range = f"{min(change(c, base_cost) for c in costs.values()):+.1f} .. " \
                 f"{max(change(c, base_cost) for c in costs.values()):+.1f}%"  # fmt: skip
    bcrs = [change(bcr(pdd_rps, c), bcr(base_rps, base_cost)) for c in costs.values()]
    rows = [
        Row("deployments", "88 A same-DC PD vs 43 A + 32 B + WAN",
            f"{best_base.describe()} vs {pdd_cfg.describe()}",
            "instance sizes are ours; the baseline split is the best of 3..8 P instances"),
        Row("hardware cost (A = 1)", "-3.5 .. -7.1%",
            f"{base_cost:.0f} vs {', '.join(f'{c:.1f}' for c in costs.values())}: {cost_range}",
            f"B priced {', '.join(f'{p:g}' for p in prices)} x A; WAN line {pdd_cfg.wan_cost} A "
            "(inferred from the paper's range, so this row matches by construction)"),
        Row("SLA throughput (req/s)", "+27.8%",
            f"{base_rps:.2f} vs {pdd_rps:.2f}: {_pct(change(pdd_rps, base_rps))}",
            f"SLA: P{round(sla.quantile * 100)} TTFT <= {sla.ttft_s:g} s, TPOT <= "
            f"{sla.tpot_s * 1e3:g} ms; B's memory holds more 64K contexts per decode instance"),
        Row("BCR", "up to +37.5%",
            " / ".join(_pct(b) for b in bcrs) + f" (B at {', '.join(f'{p:g}' for p in prices)})"),
        Row(f"TTFT at {load:.2f} req/s (mean / P99)", "-51.5%",
            f"{ttft['baseline']['mean']:.2f}/{ttft['baseline']['p99']:.2f} s vs "
            f"{ttft['pdd']['mean']:.2f}/{ttft['pdd']['p99']:.2f} s: "
            f"{_pct(change(ttft['pdd']['mean'], ttft['baseline']['mean']))} mean",
            "the baseline is at its SLA limit here; PDD has prefill headroom"),
        Row("cross-DC PD without latency hiding: TTFT added", "~2.5 s, P99 6.7 s",
            f"+{ttft['cache']['p50'] - ttft['pdd']['p50']:.2f} s (P50), P99 "
            f"{ttft['cache']['p99']:.2f} s", "decode cache but no RLD, same load; the 10% "
            "suffix crosses one TCP flow at ~1.3 Gbit/s"),
        Row("naive cross-DC PD (whole KV over the WAN)", "-",
            f"SLA {runs['naive'][1].rate:.2f} req/s; TTFT P50 {ttft['naive']['p50']:.1f} s "
            f"at {load:.2f} req/s", "18 s per 64K prompt on one flow: never meets the SLA"),
        Row("RLD share of output tokens", "6.2%", f"{rld_share:.1%}",
            "PDD at its SLA capacity"),
    ]  # fmt: skip
    data = {
        "baseline": {"deployment": best_base.describe(), "cost": base_cost, "sla_rps": base_rps},
        "pdd": {"deployment": pdd_cfg.describe(), "costs": costs, "sla_rps": pdd_rps},
        "cache_sla_rps": runs["cache"][1].rate,
        "naive_sla_rps": runs["naive"][1].rate,
        "load_rps": load,
        "ttft_at_load": ttft,
        "rld_share": rld_share,
    }
    limits = {name: _bottleneck(analytic_capacity(cfg, sample, sla))
              for name, cfg in (("baseline", best_base), ("PDD", pdd_cfg))}  # fmt: skip
    limits["baseline"] = limits["baseline"].replace("MD", "D")
    notes = [
        "Scenario: 63K prompt + 1K output (64K total), 90% hit for every request.",
        f"What limits each (analytic model): baseline {limits['baseline']}, PDD "
        f"{limits['PDD']}. 64K contexts fill chip A's memory, so the baseline's decode tier "
        "runs small batches; chip B holds ~2.8x more contexts per instance. The gains depend "
        "on our stand-in chips, tier sizes and SLA, none of which the paper gives: the "
        "direction and size class are the claim, not the digits.",
    ]
    instances = f"baseline {best_base.instances()}; PDD {pdd_cfg.instances()}"
    return Repro("cost", "(c) Cost table", rows, data, notes, instances)


def _bottleneck(bounds: dict[str, float]) -> str:
    tiers = {k: v for k, v in bounds.items() if k not in ("capacity", "ttft_zero_load")}
    name = min(tiers, key=lambda k: tiers[k])
    return f"{name} ({tiers[name]:.1f} req/s)"


def run_all(progress: Progress | None = None, jobs: int | None = None) -> list[Repro]:
    from pdd.eval.sim.handoff_bench import handoff_microbench  # it imports Repro from here

    out = [feasibility()]
    if progress:
        progress("feasibility done")
    out.append(bathtub(jobs=jobs, progress=progress))
    out.append(cost_table(progress=progress))
    out.append(handoff_microbench())
    return out
