"""What a live run must show about PDD, checked on its own figures: PDD's pass against same-DC PD
(the deployment it replaces) and cross-DC PD + decode cache (PD across the WAN done well), at
each rate of the run. Each row: the figure, its target, and whether this run met it."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from pdd.eval.report import Run

SAME_DC = "same-DC PD"
CROSS_DC = "cross-DC PD + decode cache"
PDD = "PDD"
NO_GUARD = "PDD no RLD guard"


@dataclass(frozen=True)
class Criterion:
    name: str
    value: float
    target: str  # e.g. "<= 1.2"

    @property
    def met(self) -> bool:
        op, bound = self.target.split()
        if math.isnan(self.value):
            return False
        return self.value <= float(bound) if op == "<=" else self.value >= float(bound)


def ratio(a: float, b: float) -> float:
    """a / b; NaN (never a met target) when b is 0 or not finite."""
    return a / b if b and math.isfinite(b) else math.nan


def paired_e2e_ratio(run: Run, base: Run) -> float:
    """The median over requests of one request's end-to-end time in `run` over the same
    request's in `base` (the same trace): unlike a ratio of two medians, it does not jump when
    requests of different lengths trade places around the median."""
    ratios = [
        r.e2e_s / b.e2e_s
        for r, b in zip(run.records, base.records, strict=True)
        if r.ok and b.ok and r.e2e_s is not None and b.e2e_s
    ]
    return statistics.median(ratios) if ratios else math.nan


def criteria(summaries: dict[str, dict[str, float]], goodput: dict[str, float],
             runs: dict[str, Run]) -> list[Criterion]:  # fmt: skip
    """The rows this run can check (those whose deployments it ran)."""
    if PDD not in summaries:
        return []
    pdd = summaries[PDD]
    rows = [Criterion("PDD: MD's share of output tokens", pdd["md_share"], ">= 0.85"),
            Criterion("PDD: RLD's share of output tokens", pdd["rld_share"], "<= 0.10"),
            Criterion("PDD: failed requests", pdd["failed"], "<= 0"),
            Criterion("PDD: outputs equal to the first deployment's", pdd["same_output"],
                      ">= 1")]  # fmt: skip

    def against(key: str, other: str, target: str, label: str) -> None:
        if other in summaries:
            v = ratio(pdd[key], summaries[other][key])
            rows.append(Criterion(f"{label}: PDD / {other}", v, target))

    against("ttft_p99", SAME_DC, "<= 1.2", "TTFT P99")
    against("ttft_p99", CROSS_DC, "<= 0.5", "TTFT P99")
    against("tpot_p99", CROSS_DC, "<= 1.2", "TPOT P99")
    against("wan_mb_per_request", CROSS_DC, "<= 1.05", "WAN bytes")
    against("e2e_p50", SAME_DC, "<= 1.1", "E2E P50")
    if SAME_DC in runs and PDD in runs:
        rows.append(Criterion(f"E2E per request, median of PDD / {SAME_DC}",
                              paired_e2e_ratio(runs[PDD], runs[SAME_DC]), "<= 1.1"))  # fmt: skip
    for other, bound in ((SAME_DC, 0.9), (CROSS_DC, 1.2)):
        if other in goodput and PDD in goodput:
            v = goodput[PDD] / goodput[other] if goodput[other] else math.inf
            rows.append(Criterion(f"SLA goodput: PDD / {other}", v, f">= {bound:g}"))
    if NO_GUARD in summaries:
        off = ratio(summaries[NO_GUARD]["ttft_p99"], pdd["ttft_p99"])
        rows.append(Criterion("TTFT P99: PDD with the RLD guard off / on", off, ">= 3"))
    return rows


def criteria_table(rows: list[Criterion]) -> str:
    lines = ["| criterion | this run | target | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {c.name} | {c.value:.3f} | {c.target} | {'yes' if c.met else 'no'} |"
              for c in rows]  # fmt: skip
    return "\n".join(lines)
