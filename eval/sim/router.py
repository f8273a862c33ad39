"""The simulated router's view: requests in flight per instance and what it learns from traffic,
with the live router's own estimators (`pdd.router.estimates`) and path policy
(`pdd.policy.path`), so that the simulator measures the real decisions.

What it learns, as the live router does: per MD, the WAN (KV bytes per token, bandwidth and
fixed latency, from each READY) and what P->MD first tokens took beyond their prediction (or,
on P->RLD->MD, would have taken); RLD's time per output token from its streams; P's time per
uncached token from its answers on paths whose KV stays in datacenter A. `warm_estimates`
starts it knowing the KV per token, the flow rate, RLD's step and P's true compute (until it
has learnt P's)."""

from __future__ import annotations

from pdd.eval.sim.config import ClusterConfig
from pdd.eval.sim.requests import SimRequest
from pdd.eval.sim.tiers import RequestState
from pdd.policy.balance import pick_least_loaded
from pdd.policy.path import PathChoice, Signals, choose_path, direct_ttft_base
from pdd.router.estimates import (
    FirstTokenResidual,
    PrefillSpeed,
    RelaySpeed,
    WanEstimate,
    direct_wan_seconds,
    relayed_direct_ttft,
)


class RouterView:
    def __init__(self, config: ClusterConfig, instances: dict[str, int],
                 relay_step_s: float | None) -> None:  # fmt: skip
        self.cfg = config
        self.load = {tier: [0] * n for tier, n in instances.items()}
        self.cursor = {tier: 0 for tier in instances}
        self.wan = [WanEstimate() for _ in range(instances["MD"])]  # one per MD
        self.first_token = [FirstTokenResidual() for _ in range(instances["MD"])]
        self.relay_speed = RelaySpeed()
        self.prefill_speed = PrefillSpeed()
        if config.warm_estimates:
            for est in self.wan:
                est.kv_bytes_per_token = config.model.kv_bytes_per_token
                est.bytes_per_s = config.link.flow_bytes_per_s
            if relay_step_s is not None:
                self.relay_speed.tpot_s.add(relay_step_s)

    def pick(self, tier: str) -> int:
        loads: list[int | None] = list(self.load[tier])
        i = pick_least_loaded(loads, self.cursor[tier])
        self.cursor[tier] = (self.cursor[tier] + 1) % len(loads)
        return i

    def prefill_s(self, uncached: int, true_s: float) -> float | None:
        """P's compute for `uncached` tokens as the router predicts it."""
        learnt = self.prefill_speed.prefill_s(uncached)
        return learnt if learnt is not None or not self.cfg.warm_estimates else true_s

    def seen(self, cached: int) -> int:
        """A cached prefix as the router sees it: whole blocks (`ClusterConfig.cache_block`)."""
        return cached // self.cfg.cache_block * self.cfg.cache_block

    def choose(self, req: SimRequest, md_hit: int, md: int, rld: int, prefill_s: float | None,
               now: float, relay_kv_room: int | None = None,
               ) -> tuple[PathChoice, float | None]:  # fmt: skip
        """The path for a request (auto, as the router decides it) and P->MD's predicted first
        token from compute and transfer alone (what its residual is measured against)."""
        cfg, wan = self.cfg, self.wan[md]
        md_hit = self.seen(md_hit)
        extra = self.first_token[md].value(now) if cfg.first_token_extra else 0.0
        signals = Signals(
            prompt_tokens=req.prompt_tokens,
            max_new_tokens=req.output_tokens,
            md_cached_tokens=md_hit,
            transfer_s=wan.transfer_s(req.prompt_tokens - md_hit),
            relay_decode_s=self.relay_speed.decode_s(req.output_tokens),
            relay_load=self.load["RLD"][rld],
            prefill_s=prefill_s,
            relay_capacity=cfg.relay.max_batch if cfg.relay is not None else None,
            relay_kv_room=relay_kv_room,
            wan_stale=wan.wants_probe(now),
            main_extra_s=extra,
        )
        choice = choose_path(None, cfg.path, [], signals, cfg.path_policy)
        if signals.wan_stale and choice.path == "pdd":
            wan.probed(now)  # this transfer measures the link: one probe is enough
        return choice, direct_ttft_base(signals)

    def observe_ready(self, md: int, kv_bytes: float, suffix: int, seconds: float,
                      now: float, compute_s: float | None = None,
                      direct: bool = False) -> None:  # fmt: skip
        """READY from MD: `seconds` since MD was fed (P->MD: since P was sent the request,
        less P's compute as the router estimates it, when known and a small part)."""
        if direct:
            seconds = direct_wan_seconds(seconds, compute_s)
        self.wan[md].observe(int(kv_bytes), suffix, seconds, now)

    def observe_relayed_ready(self, st: RequestState, now: float) -> None:
        """READY on P->RLD->MD: what P->MD's first token would have taken (the live router's
        `relayed_direct_ttft`), from P's answer for RLD and the time MD was fed."""
        if st.md is None or st.relay_answered_s is None:
            return
        t0 = st.req.arrival_s
        timings = {"prefill_done": st.relay_answered_s - t0,
                   "prefill_md_sent": st.wan_sent_s - t0, "ready": now - t0}  # fmt: skip
        direct = relayed_direct_ttft(timings)
        if direct is not None:
            self.observe_first_token(st.md, direct, st.direct_base_s, now)

    def observe_first_token(self, md: int, ttft_s: float, base_s: float | None,
                            now: float) -> None:  # fmt: skip
        if base_s is not None:
            self.first_token[md].observe(ttft_s - base_s, now)
