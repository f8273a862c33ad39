"""A discrete-event simulator of a P / RLD / MD cluster, deciding with the router's own code.

Deterministic given the seed: one heap of timed events, ties broken by insertion order, one
random stream (WAN jitter only). Four deployment kinds:
- `same-dc`: P and D on one datacenter's chips; the whole prompt's KV goes over RDMA;
- `naive`: P in datacenter A, D (MD) in B; the whole prompt's KV crosses the WAN;
- `cache`: as naive, but MD keeps a decode-side prefix cache: only the uncached suffix crosses;
- `pdd`: P, RLD and MD; each request's path comes from `pdd.policy.path.choose_path` (auto:
  `auto_path`) fed with the signals the router has, kept by the router's own estimators
  (`pdd.router.estimates`), and handoffs follow `pdd.policy.handoff` (choose_mode, next_step).

What is modelled:
- P instances run FIFO prefill batches (up to `prefill_batch_tokens` new tokens; a longer prompt
  runs alone); the step time is the roofline of `costs.StepCosts`. P produces output token 0.
  A P->MD request reaches P's queue `md_bootstrap_s` after it arrived (MD's bootstrap). On
  P->RLD->MD the router feeds MD once P answered, by a second request to P (its last token
  recomputed over the cached prompt), which P takes no earlier than MD's bootstrap ends; that
  forward's KV then crosses. With `shared_host_s` (the testbed: all servers on one CPU), a
  first token reaches the client that much later per request decoding anywhere.
- Decode instances (D, RLD, MD) run continuous batching: every step produces one token for each
  running request. MD's handoffs run as pdd.srt.main_decode runs them: the CHUNKs and HANDOFFs
  that arrived during a step are acted on before the next one, in one extend forward for all
  of them (the tokens' KV over their contexts, one pass over the weights), and the decode step
  waits for it; a handed-off request joins that decode step,
  whose input is its last handed-over token (MD recomputes the others). A request is admitted
  when a slot (`max_batch`) and KV memory for its prompt and output are free, else it waits (a
  cached prefix counts too: each agent session's context is its own, not shared between
  requests); on RLD, as on SGLang's decode side, its prompt and `decode_reserve_tokens`. The
  router's RLD guard reads RLD's room as the live router does (free KV less what it sent RLD
  meanwhile): a prompt that does not fit goes P->MD. KV that lands during a forward is taken
  in when it ends (SGLang's loop polls transfers between forwards: MD's READY leaves then). A
  request's first token is streamed when it joins a step (after the one running).
- The WAN shares its line max-min fairly between concurrent KV transfers, each capped at the
  TCP flow rate, or with `Link.ramp_flows` at a rate that ramps from idle as TCP's does (the
  testbed's); every message also takes one sampled one-way delay. Control messages (READY,
  chunks, ACKs, HANDOFF) take one one-way delay and no bandwidth. RDMA (P -> RLD, P -> D) is
  not contended: latency + bytes / interconnect.
- The router sees MD's and P's cached prefixes in whole `cache_block`s, as its cache sync and
  P index do: its transfer and compute estimates count a partial block as uncached.
- The user and the router sit in datacenter A: what RLD streams is seen at once, what MD streams
  one one-way delay later (sampled once per request).
- MD's decode-side cache: a request's MD hit is its own `md_cached_tokens` when given (a
  replayed live request), else its P-side hit (an aligned DRC), scaled down by
  min(1, free MD KV memory x number of MDs / hot_set_tokens) when `hot_set_tokens` (the
  workload's reused prefix tokens) is given: a full MD remembers less. `naive` MD has no cache;
  RLD and same-DC D get the whole prompt's KV.
- MD reserves memory when the KV lands (SGLang reserves before the transfer: small difference).
- Each instance is `Tier.chips` chips at that TP size, one copy of the model; its step costs are
  the roofline of all its chips.
Not modelled: P-side cache effects beyond the given cached tokens, tensor-parallel
communication, preemption/retraction, per-session cache state, TCP slow start in the cluster
unless `ramp_flows` is set, MD's handoff batching window (`--pdd-handoff-batch-ms`, default 0),
failures.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

from pdd.eval.sim.clock import Clock
from pdd.eval.sim.config import ClusterConfig, Sla
from pdd.eval.sim.costs import StepCosts
from pdd.eval.sim.requests import SimRequest, as_sim_request
from pdd.eval.sim.results import SimResult, summarize
from pdd.eval.sim.router import RouterView
from pdd.eval.sim.tiers import Decode, Prefill, RequestState, Slot, prefill_job
from pdd.eval.sim.wan import Wan
from pdd.policy.handoff import choose_mode, next_step, relay_finishes


class Simulation:
    """The router's part: picks instances and paths, moves KV, runs handoffs; the instances
    (`tiers`) and the line (`wan`) only keep time."""

    def __init__(self, config: ClusterConfig, requests: Iterable[Any]) -> None:
        self.cfg = config
        self.requests = sorted((as_sim_request(r) for r in requests), key=lambda r: r.arrival_s)
        self.clock = Clock()
        self.rng = random.Random(config.seed)
        c = config
        pc = c.step_costs(c.prefill)
        self.p = [
            Prefill(self.clock, pc, c.prefill_batch_tokens, self.prefilled)
            for _ in range(c.prefill.instances)
        ]
        mc = c.step_costs(c.main)
        self.md = [Decode(self.clock, mc, c.main.max_batch) for _ in range(c.main.instances)]
        self.rld: list[Decode] = []
        if c.kind == "pdd" and c.relay is not None:
            rc = c.step_costs(c.relay)
            self.rld = [Decode(self.clock, rc, c.relay.max_batch) for _ in range(c.relay.instances)]
        # KV the router sent each RLD that RLD has not been asked to hold yet (P still computing
        # it): the live router adds the prompts sent since RLD's last report to it the same way.
        self.relay_sent = [0] * len(self.rld)
        self.wan = Wan(self.clock, self.rng, c.link)
        counts = {"P": len(self.p), "RLD": len(self.rld), "MD": len(self.md)}
        relay_step = self.rld[0].costs.decode_step_s(1, 0) if self.rld else None
        self.router = RouterView(c, counts, relay_step)
        self.load = self.router.load
        self.states: list[RequestState] = []

    def _first_token(self, st: RequestState, delay_s: float = 0.0) -> None:
        """The client gets token 0 `delay_s` from now (MD: its stream's way back), later by
        `shared_host_s` per request decoding anywhere (servers sharing one CPU)."""
        busy = sum(d.batch for d in (*self.md, *self.rld))
        st.see_first(self.clock.now + delay_s + self.cfg.shared_host_s * busy)

    # -- the router

    def md_cached(self, req: SimRequest, md: int) -> int:
        """MD's prefix hit for this request (see the module docstring)."""
        if self.cfg.kind in ("same-dc", "naive"):
            return 0
        cached = req.cached_tokens if req.md_cached_tokens is None else req.md_cached_tokens
        hot = self.cfg.hot_set_tokens
        if not hot:
            return cached
        inst = self.md[md]
        free = max(inst.costs.kv_capacity_tokens - inst.reserved, 0)
        return int(cached * min(1.0, free * len(self.md) / hot))

    def _arrive(self, st: RequestState) -> None:
        req, cfg, router = st.req, self.cfg, self.router
        st.p = router.pick("P")
        self.load["P"][st.p] += 1
        st.md = router.pick("MD")
        st.md_hit = self.md_cached(req, st.md)
        if cfg.kind == "pdd":
            st.rld = router.pick("RLD")
            true_s = self.p[st.p].costs.prefill_s(*prefill_job(req))
            prefill = router.prefill_s(req.prompt_tokens - router.seen(req.cached_tokens), true_s)
            room = self.relay_kv_room(st.rld)
            choice, st.direct_base_s = router.choose(req, st.md_hit, st.md, st.rld, prefill,
                                                     self.clock.now, room)  # fmt: skip
            st.path, st.reason = choice.path, choice.reason
        else:
            st.path, st.reason = "main", cfg.kind
        if st.path == "main":
            st.rld = None
        if st.path == "relay":
            st.md = None
        for tier, i in (("RLD", st.rld), ("MD", st.md)):
            if i is not None:
                self.load[tier][i] += 1
        if st.rld is not None:
            self.relay_sent[st.rld] += self.relay_reserve(req)
        if st.path == "main" and cfg.kind != "same-dc" and cfg.md_bootstrap_s > 0:
            # SGLang's P takes a request into its queue once its decode side bootstrapped.
            self.clock.at(self.clock.now + cfg.md_bootstrap_s, self.p[st.p].submit, st)
        else:
            self.p[st.p].submit(st)

    def prefilled(self, st: RequestState) -> None:
        """P is done (token 0 exists): send the KV where the path says."""
        now, req, cfg = self.clock.now, st.req, self.cfg
        self.load["P"][st.p] -= 1
        st.tokens["P"] = 1
        kvb = cfg.model.kv_bytes_per_token
        if cfg.kind == "same-dc":
            nbytes = req.prompt_tokens * kvb
            st.rdma_bytes += nbytes
            t = now + self._rdma_s(self.p[st.p].costs, self.md[st.md or 0].costs, nbytes)
            self.clock.at(t, self._to_main, st)
            return
        if st.rld is not None:
            nbytes = req.prompt_tokens * kvb
            st.rdma_bytes += nbytes
            t = now + self._rdma_s(self.p[st.p].costs, self.rld[st.rld].costs, nbytes)
            self.clock.at(t, self._to_relay, st)
        if st.md is not None:
            st.stream_delay_s = cfg.link.one_way_s(self.rng)
            st.wan_bytes = (req.prompt_tokens - st.md_hit) * kvb
            st.wan_sent_s = now
            if st.rld is None:  # P->MD: this forward was MD's
                self._send_to_main(st)
            else:
                # P->RLD->MD: the router feeds MD now, a second request to P (pdd_request.
                # _maybe_feed_main) that P takes once MD's bootstrap, begun on arrival, is done.
                start = max(now, req.arrival_s + cfg.md_bootstrap_s)
                self.clock.at(start, self.p[st.p].feed, st, self._send_to_main)

    def _send_to_main(self, st: RequestState) -> None:
        if not st.finished and st.md is not None:
            self.wan.send(st.wan_bytes, lambda: self._to_main(st))

    def _rdma_s(self, src: StepCosts, dst: StepCosts, nbytes: float) -> float:
        rate = min(src.send_bytes_s, dst.send_bytes_s)
        return self.cfg.rdma_latency_s + nbytes / rate

    # -- RLD

    def relay_reserve(self, req: SimRequest) -> int:
        """KV tokens RLD's admission holds for a request: its prompt and SGLang's reservation."""
        return req.prompt_tokens + self.cfg.decode_reserve_tokens

    def relay_kv_room(self, rld: int | None) -> int | None:
        """Prompt tokens RLD `rld` could still take in, as the live router's guard counts them
        (`server_loads.Load.kv_room`): its free KV less what was sent to it meanwhile and the
        new request's own reservation."""
        if rld is None:
            return None
        free = self.rld[rld].free_kv() - self.relay_sent[rld]
        return free - self.cfg.decode_reserve_tokens

    def _to_relay(self, st: RequestState) -> None:
        """P answers (the KV is on RLD): the router learns P's speed from it."""
        req = st.req
        assert st.rld is not None
        self.relay_sent[st.rld] -= self.relay_reserve(req)
        st.relay_answered_s = self.clock.now
        self.router.prefill_speed.observe(req.prompt_tokens - req.cached_tokens,
                                          self.clock.now - req.arrival_s)  # fmt: skip
        if st.finished or st.relay_stopped:
            return
        slot = Slot(st, self.relay_reserve(req), req.output_tokens,
                    self._relay_admitted, self._relay_finished,
                    lambda s: self._first_token(s.st))  # fmt: skip
        st.rld_slot = slot
        self.rld[st.rld].request(slot)

    def _relay_admitted(self, slot: Slot) -> None:
        st = slot.st
        assert st.rld is not None
        self.rld[st.rld].run(slot, 1, st.req.prompt_tokens)

    def _relay_finished(self, slot: Slot) -> None:
        st = slot.st
        now = self.clock.now
        self._observe_relay(st, slot.target)
        self._release_relay(st)
        st.tokens["RLD"] = slot.target - 1
        self._finish(st, now)
        self._cancel_main(st)

    def _observe_relay(self, st: RequestState, tokens: int) -> None:
        if math.isfinite(st.first_s):
            self.router.relay_speed.observe(tokens, self.clock.now - st.first_s)

    def _release_relay(self, st: RequestState) -> None:
        if st.rld is not None and not st.relay_stopped:
            st.relay_stopped = True
            self.load["RLD"][st.rld] -= 1

    def _cancel_main(self, st: RequestState) -> None:
        """RLD answers alone: MD is cancelled and keeps the prompt's KV in its cache."""
        if st.md is not None:
            if st.md_slot is not None:
                self.md[st.md].release(st.md_slot)
            self._release_main(st)

    def _release_main(self, st: RequestState) -> None:
        if st.md is not None:
            self.load["MD"][st.md] -= 1
            st.md = None

    # -- MD

    def _to_main(self, st: RequestState) -> None:
        """The prompt's KV (or its suffix) landed on MD (or D)."""
        if st.finished or st.md is None:
            return
        req = st.req
        reserve = req.prompt_tokens + req.output_tokens  # a cached prefix is held all the same
        on_admit = self._ready if st.path == "pdd" else self._main_admitted
        slot = Slot(st, reserve, req.output_tokens, on_admit, self._main_finished,
                    lambda s: self._first_token(s.st, s.st.stream_delay_s))  # fmt: skip
        st.md_slot = slot
        self.md[st.md].request(slot)

    def _main_ready(self, st: RequestState) -> None:
        if st.md is not None:
            now, suffix = self.clock.now, st.req.prompt_tokens - st.md_hit
            true_s = self.p[st.p].costs.prefill_s(*prefill_job(st.req))
            compute = self.router.prefill_s(suffix, true_s)  # the router's, as live
            self.router.observe_ready(st.md, st.wan_bytes, suffix, now - st.req.arrival_s, now,
                                      compute, direct=True)  # fmt: skip

    def _main_admitted(self, slot: Slot) -> None:
        st = slot.st
        assert st.md is not None
        self.md[st.md].run(slot, 1, st.req.prompt_tokens)
        if self.cfg.kind != "same-dc":
            # MD's READY: the router learns the WAN from it on P->MD too (time since it sent
            # P the request, less P's compute).
            t = self.clock.now + self.cfg.link.one_way_s(self.rng)
            self.clock.at(t, self._main_ready, st)

    def _main_finished(self, slot: Slot) -> None:
        st = slot.st
        done_by_md = slot.target - max(st.tokens.get("RLD", 0) + 1, 1)
        st.tokens["MD"] = done_by_md
        self._finish(st, self.clock.now + st.stream_delay_s)
        if st.path == "main" and st.md is not None:
            ttft = st.first_s - st.req.arrival_s
            self.router.observe_first_token(st.md, ttft, st.direct_base_s, self.clock.now)
        self._release_main(st)

    def _ready(self, slot: Slot) -> None:
        """MD holds the KV: READY goes to the router."""
        self.clock.at(self.clock.now + self.cfg.link.one_way_s(self.rng), self._on_ready, slot.st)

    def _on_ready(self, st: RequestState) -> None:
        now = self.clock.now
        if st.finished or st.md is None:
            return
        suffix = st.req.prompt_tokens - st.md_hit
        self.router.observe_ready(st.md, st.wan_bytes, suffix, now - st.wan_sent_s, now)
        self.router.observe_relayed_ready(st, now)
        pending = self._available(st)
        left = st.req.output_tokens - pending
        if self._relay_running(st) and relay_finishes(self.cfg.handoff, left=left):
            self._cancel_main(st)
            return
        load = self.load["RLD"][st.rld] if st.rld is not None else 0
        st.mode = choose_mode(self.cfg.handoff, pending=pending, relay_load=load)
        if st.mode == "extend":
            self._handoff(st)
        else:
            self._catchup(st)

    def _available(self, st: RequestState) -> int:
        """Output tokens the client has from RLD (token 0 included)."""
        slot = st.rld_slot
        if slot is None or st.rld is None or not slot.active:
            return 0
        return self.rld[st.rld].visible(slot)

    def _relay_running(self, st: RequestState) -> bool:
        slot = st.rld_slot
        return slot is not None and slot.running and slot.active

    def _catchup(self, st: RequestState) -> None:
        relay_running = self._relay_running(st)
        step = next_step(self.cfg.handoff, done=st.md_done, available=self._available(st),
                         chunks_sent=st.chunks)  # fmt: skip
        if step.final or not relay_running:
            self._handoff(st)
            return
        st.chunks += 1
        md, ctx = st.md, st.req.prompt_tokens + step.start
        assert md is not None
        one_way = self.cfg.link.one_way_s

        def extended() -> None:
            self.clock.at(self.clock.now + one_way(self.rng), self._on_ack, st, step.end)

        self.clock.at(self.clock.now + one_way(self.rng), self.md[md].extend, step.size, ctx,
                      extended, False)  # fmt: skip

    def _on_ack(self, st: RequestState, done: int) -> None:
        if st.finished:
            return
        st.md_done = done
        self._catchup(st)

    def _handoff(self, st: RequestState) -> None:
        available = self._available(st)
        if st.rld_slot is not None and st.rld is not None:
            if st.rld_slot.running and available:
                self._observe_relay(st, available)
            self.rld[st.rld].release(st.rld_slot)
        self._release_relay(st)
        st.tokens["RLD"] = max(available - 1, 0)
        base = max(available, 1)
        # MD recomputes all handed-over tokens but the last (the next decode step's input).
        k = base - 1 - st.md_done
        md, slot, prompt = st.md, st.md_slot, st.req.prompt_tokens
        assert md is not None and slot is not None

        def extended() -> None:
            if available == 0:
                self._first_token(st, st.stream_delay_s)
            self.md[md].run(slot, base, prompt + base - 1)

        t = self.clock.now + self.cfg.link.one_way_s(self.rng)
        self.clock.at(t, self.md[md].extend, k, prompt + st.md_done, extended)

    def _finish(self, st: RequestState, t: float) -> None:
        st.finished = True
        st.finish_s = t
        st.see_first(t)

    # -- running

    def run(self) -> SimResult:
        for i, req in enumerate(self.requests):
            st = RequestState(i, req)
            self.states.append(st)
            self.clock.at(req.arrival_s, self._arrive, st)
        self.clock.run()
        results = [st.result() for st in self.states]
        if any(not st.finished for st in self.states):
            raise RuntimeError("simulation ended with unfinished requests")
        summary = summarize(results, Sla(), self._utilisation(), self.cfg.cost)
        return SimResult(self.cfg, results, summary, self.clock.events)

    def _utilisation(self) -> dict[str, float]:
        """Per tier: the fraction of time its instances ran forwards, between the first
        arrival and the tier's last forward (decode: time spent stepping, at any batch size)."""
        t0 = min((r.arrival_s for r in self.requests), default=0.0)
        tiers: dict[str, Sequence[Prefill | Decode]] = {"P": self.p, "MD": self.md}
        if self.rld:
            tiers["RLD"] = self.rld
        util = {}
        for name, insts in tiers.items():
            span = max(i.last_s for i in insts) - t0
            util[name] = sum(i.busy_s for i in insts) / (span * len(insts)) if span > 0 else 0.0
        span = self.wan.last_s - t0
        if self.wan.sent and span > 0:  # the line's average load
            util["WAN"] = self.wan.sent / (self.cfg.link.bytes_per_s * span)
        return util


def simulate(requests: Iterable[Any], config: ClusterConfig, sla: Sla | None = None) -> SimResult:
    """Run `requests` (SimRequest or anything `as_sim_request` reads) through `config`."""
    result = Simulation(config, requests).run()
    if sla is not None:
        s = result.summary
        result.summary = summarize(result.results, sla, s.utilisation, s.cost)
    return result
