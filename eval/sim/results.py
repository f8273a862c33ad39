"""What a simulation reports: each request's timeline and where its tokens came from, and the
run's summary (latency percentiles, SLA goodput, WAN load, RLD's share, utilisation).

Percentiles are `pdd.eval.report.percentile` (nearest rank), the live harness's own, so a
simulated summary and a measured one are computed the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd.eval.report import percentile
from pdd.eval.sim.config import TIERS, ClusterConfig, Sla


@dataclass
class RequestResult:
    index: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    md_cached_tokens: int
    output_tokens: int
    path: str  # main (P->MD or P->D), pdd (P->RLD->MD), relay (P->RLD)
    reason: str
    first_token_s: float
    finish_s: float
    wan_bytes: float = 0.0
    rdma_bytes: float = 0.0
    tokens: dict[str, int] = field(default_factory=dict)  # output tokens per tier
    handoff_mode: str | None = None
    chunks: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens
        return 0.0 if n <= 1 else (self.finish_s - self.first_token_s) / (n - 1)

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    def meets(self, sla: Sla) -> bool:
        return self.ttft_s <= sla.ttft_s and self.tpot_s <= sla.tpot_s

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d


@dataclass
class Summary:
    requests: int
    duration_s: float  # first arrival to last finish
    offered_rps: float  # arrivals per second over the arrival window
    throughput_rps: float  # completions per second over duration_s
    output_tokens_s: float
    input_tokens_s: float
    goodput_rps: float  # requests meeting both SLA bounds, per second
    sla_met: float  # their fraction
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    wan_bytes: float
    wan_gbit_s: float  # average over the run
    rld_token_share: float
    tokens: dict[str, int]
    paths: dict[str, int]
    handoff_modes: dict[str, int]
    utilisation: dict[str, float]
    cost: float

    def meets(self, sla: Sla) -> bool:
        key = _qkey(sla.quantile)
        return self.ttft_s[key] <= sla.ttft_s and self.tpot_s[key] <= sla.tpot_s

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


QUANTILES = (0.5, 0.9, 0.99)


def _qkey(q: float) -> str:
    return f"p{round(q * 100):d}"


def _dist(values: Sequence[float]) -> dict[str, float]:
    d = {_qkey(q): percentile(values, q * 100) for q in QUANTILES}
    d["mean"] = sum(values) / len(values) if values else math.nan
    d["max"] = max(values) if values else math.nan
    return d


def summarize(
    results: Sequence[RequestResult],
    sla: Sla,
    utilisation: dict[str, float] | None = None,
    cost: float = 0.0,
) -> Summary:
    if not results:
        raise ValueError("no requests to summarise")
    start = min(r.arrival_s for r in results)
    duration = max(r.finish_s for r in results) - start
    span = duration if duration > 0 else 1.0
    tokens = {t: sum(r.tokens.get(t, 0) for r in results) for t in TIERS}
    out = sum(tokens.values())
    good = sum(r.meets(sla) for r in results)
    wan = sum(r.wan_bytes for r in results)
    paths: dict[str, int] = {}
    modes: dict[str, int] = {}
    for r in results:
        paths[r.path] = paths.get(r.path, 0) + 1
        if r.handoff_mode:
            modes[r.handoff_mode] = modes.get(r.handoff_mode, 0) + 1
    arrivals = max(r.arrival_s for r in results) - start
    return Summary(
        requests=len(results),
        duration_s=duration,
        offered_rps=(len(results) - 1) / arrivals if arrivals > 0 else math.inf,
        throughput_rps=len(results) / span,
        output_tokens_s=out / span,
        input_tokens_s=sum(r.prompt_tokens for r in results) / span,
        goodput_rps=good / span,
        sla_met=good / len(results),
        ttft_s=_dist([r.ttft_s for r in results]),
        tpot_s=_dist([r.tpot_s for r in results if r.output_tokens > 1] or [0.0]),
        e2e_s=_dist([r.e2e_s for r in results]),
        wan_bytes=wan,
        wan_gbit_s=wan * 8 / span / 1e9,
        rld_token_share=tokens["RLD"] / out if out else 0.0,
        tokens=tokens,
        paths=paths,
        handoff_modes=modes,
        utilisation=utilisation or {},
        cost=cost,
    )


@dataclass
class SimResult:
    config: ClusterConfig
    results: list[RequestResult]
    summary: Summary
    events: int

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"deployment": self.config.describe(), "events": self.events}
        d["summary"] = self.summary.to_dict()
        if per_request:
            d["requests"] = [r.to_dict() for r in self.results]
        return d
