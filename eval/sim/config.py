"""What is simulated: the deployment kind, its tiers of instances, the model, the link, the
policies and the SLA; `deployment` builds the paper's four deployments."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdd.eval.sim.costs import StepCosts
from pdd.eval.sim.hardware import CHIP_A, CHIP_B, MOE_1T, WAN, Chip, Link, Model
from pdd.policy.handoff import HandoffPolicy
from pdd.policy.path import PathPolicy

KINDS = ("same-dc", "naive", "cache", "pdd")
TIERS = ("P", "RLD", "MD")  # output tokens are credited to these (same-dc's D counts as MD)


@dataclass(frozen=True)
class Tier:
    """`instances` SGLang servers of one tier, each `chips` chips at `--tp-size chips` holding
    one copy of the model (the same instance size as the real deployment runs)."""

    chip: Chip
    instances: int
    chips: int = 8  # per instance: its TP size
    max_batch: int = 128  # decode slots per instance
    costs: StepCosts | None = None  # None: the roofline of chip x chips

    def __post_init__(self) -> None:
        if self.instances < 0 or self.chips < 1 or self.max_batch < 1:
            raise ValueError("need instances >= 0, chips >= 1, max_batch >= 1")

    @property
    def chip_count(self) -> int:
        return self.instances * self.chips

    @property
    def cost(self) -> float:
        return self.chip_count * self.chip.price

    def describe(self) -> str:
        """E.g. "5 x TP7 A": five instances, each seven chips A at TP size 7."""
        return f"{self.instances} x TP{self.chips} {self.chip.name}"


@dataclass(frozen=True)
class Sla:
    ttft_s: float = 10.0
    tpot_s: float = 0.06
    quantile: float = 0.99  # capacity and planning check this percentile of TTFT and TPOT


@dataclass(frozen=True)
class ClusterConfig:
    kind: str = "pdd"
    prefill: Tier = Tier(CHIP_A, 5, 7)
    main: Tier = Tier(CHIP_B, 4, 8)  # MD (same-dc: D)
    relay: Tier | None = Tier(CHIP_A, 1, 8)  # pdd only
    model: Model = MOE_1T
    link: Link = WAN
    path: str = "auto"  # pdd: auto, or force pdd / relay / main
    path_policy: PathPolicy = PathPolicy()
    handoff: HandoffPolicy = HandoffPolicy()
    rdma_latency_s: float = 0.002
    prefill_batch_tokens: int = 16384
    hot_set_tokens: int | None = None  # None: MD's cache holds every prefix P holds
    wan_cost: float = 0.33  # the WAN line, in chip-A units (cross-DC kinds only)
    mfu: float = 0.4
    bw_util: float = 0.7
    overhead_s: float = 0.01  # per forward: launches, TP/EP communication (a stand-in)
    per_request_s: float = 0.0  # per request of a forward (costs.StepCosts: 0 on GPUs)
    # From a request's arrival until MD can take its KV: MD's bootstrap with P (round trips over
    # the WAN, MD's KV allocation). P starts a P->MD prefill only then (SGLang's P waits for
    # its decode side); on P->RLD->MD it runs beside RLD's part, and P takes the request that
    # feeds MD no earlier. 0: not modelled.
    md_bootstrap_s: float = 0.0
    # The router adds what recent P->MD first tokens took beyond its prediction (Signals.
    # main_extra_s, pdd.router.estimates.FirstTokenResidual); off: a router without it.
    first_token_extra: bool = True
    # The testbed runs every server on one CPU: a first token reaches the client this much
    # later per request decoding anywhere. 0: separate machines.
    shared_host_s: float = 0.0
    warm_estimates: bool = True  # the router starts knowing KV/token and the flow rate
    # The router sees MD's and P's cached prefixes in whole blocks of this many tokens (MD's
    # cache sync, --pdd-cache-block's default; its P index): its transfer and compute estimates
    # count a partial block as uncached.
    cache_block: int = 16
    # SGLang's decode side admits a request when its prompt fits in the KV pool beside this many
    # tokens for each request it holds (`num_reserved_decode_tokens`): RLD's slots hold their
    # prompt plus this, and the router's RLD guard sends P->MD a prompt that does not fit.
    decode_reserve_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.prefill.instances < 1 or self.main.instances < 1:
            raise ValueError("need at least one P and one MD (D) instance")
        if self.kind == "pdd" and (self.relay is None or self.relay.instances < 1):
            raise ValueError("pdd needs at least one RLD instance")
        if min(self.md_bootstrap_s, self.per_request_s, self.shared_host_s) < 0:
            raise ValueError("need md_bootstrap_s, per_request_s and shared_host_s >= 0")
        if self.cache_block < 1 or self.decode_reserve_tokens < 0:
            raise ValueError("need cache_block >= 1 and decode_reserve_tokens >= 0")

    @property
    def tiers(self) -> dict[str, Tier]:
        tiers = {"P": self.prefill, "MD": self.main}
        if self.kind == "pdd" and self.relay is not None:
            tiers["RLD"] = self.relay
        return tiers

    @property
    def cost(self) -> float:
        line = self.wan_cost if self.kind != "same-dc" else 0.0
        return sum(t.cost for t in self.tiers.values()) + line

    def chips(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tiers.values():
            counts[t.chip.name] = counts.get(t.chip.name, 0) + t.chip_count
        return counts

    def instances(self) -> str:
        """The instance sizes simulated, e.g. "P 5 x TP7 A, RLD 1 x TP8 A, MD 4 x TP8 B"
        (same-dc's decode tier is D)."""
        tiers = self.tiers
        names = ("P", "RLD", "MD" if self.kind != "same-dc" else "D")
        return ", ".join(f"{n} {tiers[t].describe()}" for n, t in zip(names, TIERS, strict=True)
                         if t in tiers)  # fmt: skip

    def describe(self) -> str:
        return f"{self.kind}: {self.instances()}"

    def step_costs(self, tier: Tier) -> StepCosts:
        if tier.costs is not None:
            return tier.costs
        return StepCosts.of(
            tier.chip, tier.chips, self.model,
            mfu=self.mfu, bw_util=self.bw_util, overhead_s=self.overhead_s,
            per_request_s=self.per_request_s,
        )  # fmt: skip


def deployment(kind: str, **changes: Any) -> ClusterConfig:
    """The paper's deployments: PDD = 43 A (P 5 x 7, RLD 1 x 8) + 32 B (MD 4 x 8); naive and
    cache = the same without the RLD; same-dc = 88 A as 11 instances of 8 (5 P + 6 D)."""
    if kind == "same-dc":
        base = ClusterConfig(kind, Tier(CHIP_A, 5, 8), Tier(CHIP_A, 6, 8), None)
    elif kind in ("naive", "cache"):
        base = ClusterConfig(kind, relay=None)
    else:
        base = ClusterConfig(kind)
    return replace(base, **changes)
