"""SLA capacity and the capacity planner.

SLA capacity: the highest offered request rate at which the simulated cluster still meets the
SLA (the chosen percentile of TTFT and of TPOT), found by bracketing and bisection over
simulations whose arrival window is long enough for an overload to show (decode slots fill,
queues grow). BCR = SLA capacity / hardware cost.

The planner searches counts (and chip types) of P, RLD and MD: a fast analytic model (the
roofline per tier, Little's law for decode and relay slots, the WAN's line rate, a zero-load
TTFT check) ranks every candidate, then the simulator measures the SLA capacity of the best few
and the one with the highest simulated BCR wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdd.eval.report import percentile
from pdd.eval.sim.config import ClusterConfig, Sla, Tier
from pdd.eval.sim.costs import StepCosts
from pdd.eval.sim.hardware import Chip
from pdd.eval.sim.requests import SimRequest
from pdd.eval.sim.results import Summary
from pdd.eval.sim.simulation import simulate
from pdd.eval.sim.tiers import prefill_job
from pdd.policy.path import Signals, auto_path

Progress = Callable[[str], None]
# Tail latency needs headroom: a P99 SLA is met well below 100% load when service times are
# heavy-tailed (long fresh prompts). A rough factor; the simulator measures the real one.
QUEUEING = 0.75
MakeRequests = Callable[[float], list[SimRequest]]


@dataclass
class Capacity:
    rate: float  # the highest offered requests/s meeting the SLA; 0: none found
    summary: Summary | None  # the simulation at that rate
    sims: int
    tried: list[tuple[float, bool]] = field(default_factory=list)


def sla_capacity(
    config: ClusterConfig,
    make: MakeRequests,
    sla: Sla,
    *,
    guess: float = 1.0,
    rel_tol: float = 0.06,
    max_sims: int = 12,
    min_rate: float = 0.01,
    progress: Progress | None = None,
) -> Capacity:
    """Bracket from `guess` (x1.5 up or down), then bisect until the bracket is within
    `rel_tol` or `max_sims` simulations ran."""
    cap = Capacity(0.0, None, 0)

    def ok(rate: float) -> bool:
        summary = simulate(make(rate), config, sla).summary
        good = summary.meets(sla)
        cap.sims += 1
        cap.tried.append((rate, good))
        if good and rate > cap.rate:
            cap.rate, cap.summary = rate, summary
        if progress:
            key = f"p{round(sla.quantile * 100)}"
            progress(
                f"  {config.kind} @ {rate:.3g} req/s: TTFT {key} {summary.ttft_s[key]:.2f}s, "
                f"TPOT {key} {summary.tpot_s[key] * 1e3:.1f}ms -> {'ok' if good else 'over'}"
            )
        return good

    rate = max(guess, min_rate)
    lo, hi = 0.0, math.inf
    if ok(rate):
        lo = rate
        while cap.sims < max_sims:
            rate *= 1.5
            if not ok(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        while cap.sims < max_sims and rate > min_rate:
            rate /= 1.5
            if ok(rate):
                lo = rate
                break
            hi = rate
    while lo > 0 and math.isfinite(hi) and hi / lo - 1 > rel_tol and cap.sims < max_sims:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return cap


def capacity(
    config: ClusterConfig,
    make: MakeRequests,
    sla: Sla,
    *,
    sample_rate: float = 1.0,
    **kwargs: Any,
) -> Capacity:
    """sla_capacity from the analytic estimate; none (without simulating) when even an idle
    cluster's TTFT breaks the SLA."""
    bounds = analytic_capacity(config, make(sample_rate), sla)
    if bounds["capacity"] <= 0:
        return Capacity(0.0, None, 0)
    return sla_capacity(config, make, sla, guess=bounds["capacity"], **kwargs)


def window(
    factory: Callable[[int, float], list[SimRequest]],
    seconds: float,
    max_requests: int | None = None,
) -> MakeRequests:
    """Requests for an arrival window of `seconds` at each rate (at most `max_requests`,
    at least 20): factory(n, rate)."""

    def make(rate: float) -> list[SimRequest]:
        n = max(20, round(rate * seconds))
        return factory(n if max_requests is None else min(n, max_requests), rate)

    return make


# ----------------------------------------------------------------------------------------------
# The analytic model


def _max_batch(costs: StepCosts, tier: Tier, reserve: float, context: float, tpot: float) -> int:
    """The largest decode batch that fits in memory and keeps a step within `tpot`."""
    fit = min(tier.max_batch, int(costs.kv_capacity_tokens // max(reserve, 1)))
    if fit < 1 or costs.decode_step_s(1, context) > tpot:
        return 0
    lo, hi = 1, fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if costs.decode_step_s(mid, mid * context) <= tpot:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _decode_rate(
    config: ClusterConfig, tier: Tier, reqs: Sequence[SimRequest], reserve: float, tpot: float
) -> float:
    """Requests/s the tier decodes within `tpot` per token (Little's law over its slots)."""
    if not reqs or tier.instances == 0:
        return math.inf if not reqs else 0.0
    costs = config.step_costs(tier)
    steps = sum(r.output_tokens - 1 for r in reqs) / len(reqs)
    if steps <= 0:
        return math.inf
    context = sum(r.prompt_tokens + r.output_tokens / 2 for r in reqs) / len(reqs)
    b = _max_batch(costs, tier, reserve, context, tpot)
    if b == 0:
        return 0.0
    return tier.instances * b / (costs.decode_step_s(b, b * context) * steps)


def analytic_capacity(
    config: ClusterConfig, sample: Sequence[SimRequest], sla: Sla
) -> dict[str, float]:
    """Requests/s each constraint allows for requests like `sample`, and their minimum
    (x QUEUEING) as "capacity"; 0 when the zero-load TTFT already breaks the SLA."""
    if not sample:
        raise ValueError("need a sample of requests")
    c, n = config, len(sample)
    kvb = c.model.kv_bytes_per_token
    link = c.link
    pc = c.step_costs(c.prefill)
    prefill = [pc.prefill_s(*prefill_job(r)) for r in sample]
    bounds: dict[str, float] = {"P": c.prefill.instances / (sum(prefill) / n)}
    hit = (lambda r: 0) if c.kind in ("naive", "same-dc") else (lambda r: r.cached_tokens)
    paths = ["main"] * n
    if c.kind == "pdd" and c.relay is not None:
        # RLD is a hard limit only for requests P->MD cannot serve within the TTFT SLA (an
        # overloaded RLD sends the others P->MD): each holds an RLD slot for its transfer, or
        # for its whole answer when that ends first.
        rc = c.step_costs(c.relay)
        tpot = rc.decode_step_s(1, 0)
        held = 0.0
        for i, (r, t) in enumerate(zip(sample, prefill, strict=True)):
            transfer = (r.prompt_tokens - hit(r)) * kvb / link.flow_bytes_per_s
            s = Signals(r.prompt_tokens, r.output_tokens, hit(r), transfer + link.rtt_ms / 2000,
                        tpot * r.output_tokens, 0, prefill_s=t,
                        relay_capacity=c.relay.max_batch)  # fmt: skip
            paths[i] = auto_path(s, c.path_policy).path if c.path == "auto" else c.path
            direct = t + transfer + 2 * link.mean_one_way_s()
            if paths[i] != "main" and direct > sla.ttft_s / 2:
                held += min(transfer + link.rtt_ms / 1000, r.output_tokens * tpot)
        if held > 0:
            bounds["RLD"] = c.relay.instances * c.relay.max_batch / (held / n)
    on_md = [r for r, p in zip(sample, paths, strict=True) if p != "relay"]
    if on_md:
        reserve = sum(r.prompt_tokens + r.output_tokens for r in on_md) / len(on_md)
        md_rate = _decode_rate(c, c.main, on_md, reserve, sla.tpot_s)
        bounds["MD"] = md_rate * n / len(on_md)
    if c.kind != "same-dc":
        wan = sum((r.prompt_tokens - hit(r)) * kvb for r, p in zip(sample, paths, strict=True)
                  if p != "relay")  # fmt: skip
        if wan > 0:
            bounds["WAN"] = link.bytes_per_s / (wan / n)
    # Zero-load TTFT: prefill plus what the first token waits for on its path.
    ttft = []
    for r, p, t in zip(sample, paths, prefill, strict=True):
        if c.kind == "same-dc" or p != "main":
            ttft.append(t + c.rdma_latency_s + r.prompt_tokens * kvb / pc.send_bytes_s)
        else:
            wan_s = (r.prompt_tokens - hit(r)) * kvb / link.flow_bytes_per_s
            ttft.append(c.md_bootstrap_s + t + wan_s + 2 * link.mean_one_way_s())
    bounds["ttft_zero_load"] = percentile(ttft, sla.quantile * 100)
    rate = min(v for k, v in bounds.items() if k != "ttft_zero_load")
    bounds["capacity"] = 0.0 if bounds["ttft_zero_load"] > sla.ttft_s else QUEUEING * rate
    return bounds


# ----------------------------------------------------------------------------------------------
# The planner


@dataclass(frozen=True)
class PlanSpace:
    p_counts: Sequence[int] = tuple(range(2, 9))
    rld_counts: Sequence[int] = (0, 1, 2)
    md_counts: Sequence[int] = tuple(range(1, 7))
    p_chips: Sequence[Chip] = ()  # empty: the base config's chip for that tier
    rld_chips: Sequence[Chip] = ()
    md_chips: Sequence[Chip] = ()
    chips_per_instance: int = 8
    budget: float | None = None  # hardware cost ceiling
    max_chips: int | None = None


@dataclass(eq=False)
class Candidate:
    config: ClusterConfig
    analytic: dict[str, float]
    rate: float | None = None  # simulated SLA capacity
    summary: Summary | None = None

    @property
    def cost(self) -> float:
        return self.config.cost

    @property
    def analytic_bcr(self) -> float:
        return self.analytic["capacity"] / self.cost if self.cost else 0.0

    @property
    def bcr(self) -> float | None:
        return None if self.rate is None else self.rate / self.cost

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment": self.config.describe(),
            "instances": self.config.instances(),
            "cost": self.cost,
            "analytic_rps": self.analytic["capacity"],
            "analytic_bcr": self.analytic_bcr,
            "bottleneck": _bottleneck(self.analytic),
            "sla_rps": self.rate,
            "bcr": self.bcr,
        }


def _bottleneck(bounds: dict[str, float]) -> str:
    tiers = {k: v for k, v in bounds.items() if k not in ("capacity", "ttft_zero_load")}
    if bounds["capacity"] == 0 and bounds["ttft_zero_load"] < math.inf:
        if min(tiers.values()) > 0:
            return "TTFT"
    return min(tiers, key=lambda k: tiers[k])


def candidates(base: ClusterConfig, space: PlanSpace) -> list[ClusterConfig]:
    """Every deployment in the space that fits the budget (RLD 0: cross-DC with cache only)."""
    if base.relay is None:
        base = replace(base, relay=replace(base.prefill, instances=1))
    assert base.relay is not None
    p_chips = space.p_chips or (base.prefill.chip,)
    rld_chips = space.rld_chips or (base.relay.chip,)
    md_chips = space.md_chips or (base.main.chip,)
    k = space.chips_per_instance
    out = []
    for pc in p_chips:
        for rc in rld_chips:
            for mc in md_chips:
                for np_ in space.p_counts:
                    for nr in space.rld_counts:
                        for nm in space.md_counts:
                            cfg = replace(
                                base,
                                kind="pdd" if nr else "cache",
                                prefill=replace(base.prefill, chip=pc, instances=np_, chips=k),
                                relay=replace(base.relay, chip=rc, instances=nr, chips=k)
                                if nr
                                else None,
                                main=replace(base.main, chip=mc, instances=nm, chips=k),
                            )
                            chips = sum(cfg.chips().values())
                            if space.budget is not None and cfg.cost > space.budget:
                                continue
                            if space.max_chips is not None and chips > space.max_chips:
                                continue
                            out.append(cfg)
    return out


def plan(
    base: ClusterConfig,
    space: PlanSpace,
    make: MakeRequests,
    sla: Sla,
    *,
    top: int = 4,
    sample_rate: float = 1.0,
    progress: Progress | None = None,
) -> list[Candidate]:
    """Candidates ranked by BCR: the analytic model screens, the simulator measures the `top`
    best (its SLA capacity decides; the rest keep their analytic estimate)."""
    sample = make(sample_rate)
    ranked = []
    for cfg in candidates(base, space):
        try:
            ranked.append(Candidate(cfg, analytic_capacity(cfg, sample, sla)))
        except ValueError:  # the model does not fit that chip count
            continue
    ranked.sort(key=lambda c: -c.analytic_bcr)
    if progress:
        progress(f"plan: {len(ranked)} candidates screened; simulating the best {top}")
    for cand in ranked[:top]:
        if cand.analytic["capacity"] <= 0:
            continue
        if progress:
            progress(f"plan: {cand.config.describe()} (analytic {cand.analytic['capacity']:.2f}/s)")
        cap = sla_capacity(cand.config, make, sla, guess=cand.analytic["capacity"],
                           progress=progress)  # fmt: skip
        cand.rate, cand.summary = cap.rate, cap.summary
    simulated = sorted((c for c in ranked[:top] if c.bcr is not None), key=lambda c: -(c.bcr or 0))
    return simulated + [c for c in ranked if c not in simulated]
