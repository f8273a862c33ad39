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
- Decode instances (D, RLD, MD) run continuous batching: every step produces one token for each
  running request; extends (handoff recomputes) join the next step. A request is admitted when a
  slot (`max_batch`) and KV memory for its prompt and output are free, else it waits (a cached
  prefix counts too: each agent session's context is its own, not shared between requests).
- The WAN shares its line fairly between concurrent KV transfers, each capped at the TCP flow
  rate; every message also takes one sampled one-way delay. Control messages (READY, chunks,
  ACKs, HANDOFF) take one one-way delay and no bandwidth. RDMA (P -> RLD, P -> D) is not
  contended: latency + bytes / interconnect.
- The user and the router sit in datacenter A: what RLD streams is seen at once, what MD streams
  one one-way delay later (sampled once per request).
- MD's decode-side cache: a request's MD hit is its P-side hit (an aligned DRC), scaled down by
  min(1, free MD KV memory x number of MDs / hot_set_tokens) when `hot_set_tokens` (the
  workload's reused prefix tokens) is given: a full MD remembers less. `naive` MD has no cache;
  RLD and same-DC D get the whole prompt's KV.
- MD reserves memory when the KV lands (SGLang reserves before the transfer: small difference).
Not modelled: P-side cache effects beyond the given cached tokens, tensor-parallel
communication, preemption/retraction, per-session cache state, TCP slow start in the cluster
(connections stay warm), failures.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdd.eval.sim.costs import StepCosts, prefill_pairs
from pdd.eval.sim.hardware import CHIP_A, CHIP_B, MOE_1T, WAN, Chip, Link, Model
from pdd.policy.balance import pick_least_loaded
from pdd.policy.handoff import HandoffPolicy, choose_mode, next_step
from pdd.policy.path import PathPolicy, Signals, choose_path
from pdd.router.estimates import RelaySpeed, WanEstimate

KINDS = ("same-dc", "naive", "cache", "pdd")
TIERS = ("P", "RLD", "MD")  # output tokens are credited to these (same-dc's D counts as MD)


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = 0  # P-side prefix hit
    output_tokens: int = 1  # including token 0, which P computes

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("a request needs >= 1 prompt token and >= 1 output token")
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError("need 0 <= cached_tokens <= prompt_tokens")


_FIELDS = {
    "arrival_s": ("arrival_s", "arrival", "t", "time_s"),
    "prompt_tokens": ("prompt_tokens", "input_tokens", "prompt_len"),
    "cached_tokens": ("cached_tokens", "prefix_hit_tokens", "hit_tokens", "cached"),
    "output_tokens": ("output_tokens", "max_new_tokens", "output_len"),
}


def as_sim_request(obj: Any) -> SimRequest:
    """A SimRequest from any object (or dict) with arrival, prompt, cached and output fields."""
    if isinstance(obj, SimRequest):
        return obj
    get = obj.get if isinstance(obj, dict) else (lambda k: getattr(obj, k, None))
    values: dict[str, Any] = {}
    for name, aliases in _FIELDS.items():
        found = next((v for v in map(get, aliases) if v is not None), None)
        if found is None and name != "cached_tokens":
            raise ValueError(f"request {obj!r} has no {name}")
        values[name] = found or 0
    prompt = int(values["prompt_tokens"])
    cached = min(int(values["cached_tokens"]), prompt)
    return SimRequest(float(values["arrival_s"]), prompt, cached, int(values["output_tokens"]))


@dataclass(frozen=True)
class Tier:
    chip: Chip
    instances: int
    chips: int = 8  # per instance
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
    warm_estimates: bool = True  # the router starts knowing KV/token and the flow rate
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.prefill.instances < 1 or self.main.instances < 1:
            raise ValueError("need at least one P and one MD (D) instance")
        if self.kind == "pdd" and (self.relay is None or self.relay.instances < 1):
            raise ValueError("pdd needs at least one RLD instance")

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

    def describe(self) -> str:
        parts = [f"{n} {t.instances}x{t.chips}{t.chip.name}" for n, t in self.tiers.items()]
        if self.kind == "same-dc":
            parts[1] = parts[1].replace("MD", "D")
        return f"{self.kind}: " + ", ".join(parts)

    def step_costs(self, tier: Tier) -> StepCosts:
        if tier.costs is not None:
            return tier.costs
        return StepCosts.of(
            tier.chip, tier.chips, self.model,
            mfu=self.mfu, bw_util=self.bw_util, overhead_s=self.overhead_s,
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


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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
    d = {_qkey(q): percentile(values, q) for q in QUANTILES}
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


# ----------------------------------------------------------------------------------------------
# The simulation


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def run(self) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn(*args)


@dataclass(eq=False)
class _Req:
    index: int
    req: SimRequest
    path: str = "main"
    reason: str = ""
    md_hit: int = 0
    p: int = 0
    rld: int | None = None
    md: int | None = None
    rld_slot: _Slot | None = None
    md_slot: _Slot | None = None
    first_s: float = math.inf
    finish_s: float = math.inf
    stream_delay_s: float = 0.0  # MD -> the user in datacenter A
    wan_bytes: float = 0.0
    rdma_bytes: float = 0.0
    wan_sent_s: float = 0.0
    tokens: dict[str, int] = field(default_factory=dict)
    mode: str | None = None
    chunks: int = 0
    md_done: int = 0  # leading output tokens MD holds KV for
    relay_stopped: bool = False
    finished: bool = False

    def see_first(self, t: float) -> None:
        self.first_s = min(self.first_s, t)


@dataclass(eq=False)
class _Slot:
    """One request on one decode instance."""

    st: _Req
    reserve: int  # KV tokens held
    target: int  # output tokens at which it ends
    on_admit: Callable[[_Slot], None]
    on_finish: Callable[[_Slot], None]
    visible0: int = 1
    context0: int = 0
    joined: int = 0
    admitted: bool = False
    running: bool = False
    active: bool = True


def prefill_job(req: SimRequest) -> tuple[int, int]:
    """(new, cached) tokens P computes: at least the last prompt token is always recomputed,
    for its logits (as SGLang does on a full hit)."""
    new = max(1, req.prompt_tokens - req.cached_tokens)
    return new, req.prompt_tokens - new


class _Prefill:
    def __init__(self, sim: Simulation, costs: StepCosts, budget: int) -> None:
        self.sim, self.costs, self.budget = sim, costs, budget
        self.queue: deque[_Req] = deque()
        self.busy = False
        self.busy_s = 0.0
        self.last_s = 0.0  # when its last forward ended

    def submit(self, st: _Req) -> None:
        self.queue.append(st)
        if not self.busy:
            self._start()

    def _start(self) -> None:
        batch: list[_Req] = []
        new = 0
        while self.queue:
            n = prefill_job(self.queue[0].req)[0]
            if batch and new + n > self.budget:
                break
            batch.append(self.queue.popleft())
            new += n
        jobs = [prefill_job(s.req) for s in batch]
        dt = self.costs.prefill_batch_s(jobs)
        self.busy = True
        self.busy_s += dt
        self.last_s = self.sim.clock.now + dt
        self.sim.clock.at(self.last_s, self._done, batch)

    def _done(self, batch: list[_Req]) -> None:
        self.busy = False
        for st in batch:
            self.sim.prefilled(st)
        if self.queue:
            self._start()


class _Decode:
    """Continuous batching: each step gives every running request one token."""

    def __init__(self, sim: Simulation, costs: StepCosts, max_batch: int) -> None:
        self.sim, self.costs, self.max_batch = sim, costs, max_batch
        self.steps = 0
        self.batch = 0
        self.kv = 0  # context tokens of the running requests
        self.reserved = 0
        self.slots = 0  # admitted: running or waiting for a handoff
        self.waiting: deque[_Slot] = deque()
        self.joining: list[_Slot] = []
        self.extends: list[tuple[int, int, Callable[[], None]]] = []
        self.finishes: list[tuple[int, int, _Slot]] = []
        self._seq = itertools.count()
        self.stepping = False
        self.kicked = False
        self.busy_s = 0.0
        self.last_s = 0.0

    def visible(self, slot: _Slot) -> int:
        """Output tokens the request has from this instance's steps so far."""
        if not slot.running or slot.joined > self.steps:
            return slot.visible0 if slot.admitted else 0
        return slot.visible0 + self.steps - slot.joined

    def request(self, slot: _Slot) -> None:
        if slot.reserve > self.costs.kv_capacity_tokens:
            raise ValueError(
                f"a request needs {slot.reserve} KV tokens; an instance holds "
                f"{self.costs.kv_capacity_tokens}"
            )
        self.waiting.append(slot)
        self._admit()

    def _admit(self) -> None:
        cap = self.costs.kv_capacity_tokens
        while self.waiting:
            slot = self.waiting[0]
            if not slot.active:
                self.waiting.popleft()
                continue
            if self.slots >= self.max_batch or self.reserved + slot.reserve > cap:
                return
            self.waiting.popleft()
            self.reserved += slot.reserve
            self.slots += 1
            slot.admitted = True
            slot.on_admit(slot)

    def run(self, slot: _Slot, visible: int, context: int) -> None:
        """Start producing tokens for an admitted request that has `visible` output tokens and
        KV for `context` tokens; it joins the next step."""
        slot.visible0, slot.context0 = visible, context
        if visible >= slot.target:
            self.release(slot)
            slot.on_finish(slot)
            return
        self.joining.append(slot)
        self._kick()

    def extend(self, tokens: int, context: int, on_done: Callable[[], None]) -> None:
        self.extends.append((tokens, context, on_done))
        self._kick()

    def release(self, slot: _Slot) -> None:
        """Drop a request (finished, stopped or cancelled) and free its slot and memory."""
        if not slot.active:
            return
        slot.active = False
        if slot in self.joining:
            self.joining.remove(slot)
        elif slot.running:
            self.batch -= 1
            self.kv -= slot.context0 + self.steps - slot.joined
        if slot.admitted:
            self.reserved -= slot.reserve
            self.slots -= 1
            if self.waiting:
                self.sim.clock.at(self.sim.clock.now, self._admit)

    def _kick(self) -> None:
        if not self.stepping and not self.kicked and (self.batch or self.joining or self.extends):
            self.kicked = True  # start on the next event at this instant: joins arrive together
            self.sim.clock.at(self.sim.clock.now, self._start)

    def _start(self) -> None:
        self.kicked = False
        if self.stepping or not (self.batch or self.joining or self.extends):
            return
        for slot in self.joining:
            slot.running = True
            slot.joined = self.steps
            self.batch += 1
            self.kv += slot.context0
            end = self.steps + slot.target - slot.visible0
            heapq.heappush(self.finishes, (end, next(self._seq), slot))
        self.joining = []
        ext, self.extends = self.extends, []
        if ext:
            k = sum(t for t, _, _ in ext)
            pairs = sum(prefill_pairs(t, c) for t, c, _ in ext)
            dt = self.costs.decode_step_s(self.batch, self.kv, k, pairs, sum(c for _, c, _ in ext))
        else:
            dt = self.costs.decode_step_s(self.batch, self.kv)
        self.stepping = True
        self.busy_s += dt
        self.last_s = self.sim.clock.now + dt
        self.sim.clock.at(self.last_s, self._end, ext)

    def _end(self, ext: list[tuple[int, int, Callable[[], None]]]) -> None:
        self.stepping = False
        self.steps += 1
        self.kv += self.batch
        while self.finishes and self.finishes[0][0] <= self.steps:
            _, _, slot = heapq.heappop(self.finishes)
            if slot.active and slot.running:
                self.release(slot)
                slot.on_finish(slot)
        for _, _, on_done in ext:
            on_done()
        if not self.kicked:
            self._start()  # back to back: no extra event per step


class _Wan:
    """Processor sharing: n concurrent transfers each get min(flow rate, line / n)."""

    def __init__(self, sim: Simulation, link: Link) -> None:
        self.sim, self.link = sim, link
        self.flows: dict[int, list[Any]] = {}  # id -> [bytes left, on_arrive]
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0
        self.sent = 0.0  # bytes
        self.last_s = 0.0  # when the last transfer left the line
        self.peak_flows = 0

    def _rate(self) -> float:
        return min(self.link.flow_bytes_per_s, self.link.bytes_per_s / max(len(self.flows), 1))

    def _advance(self) -> None:
        now = self.sim.clock.now
        if self.flows:
            done = (now - self._last) * self._rate()
            for f in self.flows.values():
                f[0] -= done
        self._last = now

    def send(self, nbytes: float, on_arrive: Callable[[], None]) -> None:
        self._advance()
        self.sent += nbytes
        self.flows[next(self._ids)] = [float(nbytes), on_arrive]
        self.peak_flows = max(self.peak_flows, len(self.flows))
        self._reschedule()

    def _reschedule(self) -> None:
        self._version += 1
        if self.flows:
            fid = min(self.flows, key=lambda i: self.flows[i][0])
            left = max(self.flows[fid][0], 0.0)
            t = self.sim.clock.now + left / self._rate()
            self.sim.clock.at(t, self._complete, self._version, fid)

    def _complete(self, version: int, fid: int) -> None:
        if version != self._version:
            return
        self._advance()
        now = self.sim.clock.now
        tolerance = max(1.0, self._rate() * 1e-9)  # float error must not stall the clock
        done = [i for i, f in self.flows.items() if i == fid or f[0] <= tolerance]
        self.last_s = now
        for i in done:
            _, on_arrive = self.flows.pop(i)
            self.sim.clock.at(now + self.link.one_way_s(self.sim.rng), on_arrive)
        self._reschedule()


class Simulation:
    def __init__(self, config: ClusterConfig, requests: Iterable[Any]) -> None:
        self.cfg = config
        self.requests = sorted((as_sim_request(r) for r in requests), key=lambda r: r.arrival_s)
        self.clock = _Clock()
        self.rng = random.Random(config.seed)
        c = config
        pc = c.step_costs(c.prefill)
        self.p = [_Prefill(self, pc, c.prefill_batch_tokens) for _ in range(c.prefill.instances)]
        mc = c.step_costs(c.main)
        self.md = [_Decode(self, mc, c.main.max_batch) for _ in range(c.main.instances)]
        self.rld: list[_Decode] = []
        if c.kind == "pdd" and c.relay is not None:
            rc = c.step_costs(c.relay)
            self.rld = [_Decode(self, rc, c.relay.max_batch) for _ in range(c.relay.instances)]
        self.wan = _Wan(self, c.link)
        # The router's view: requests in flight per instance, and its learned estimates.
        self.load = {"P": [0] * len(self.p), "RLD": [0] * len(self.rld), "MD": [0] * len(self.md)}
        self.cursor = {"P": 0, "RLD": 0, "MD": 0}
        self.wan_est = [WanEstimate() for _ in self.md]  # one per MD, as in the router
        self.relay_speed = RelaySpeed()
        if c.warm_estimates:
            for est in self.wan_est:
                est.kv_bytes_per_token = c.model.kv_bytes_per_token
                est.bytes_per_s.add(c.link.flow_bytes_per_s)
            if self.rld:
                self.relay_speed.tpot_s.add(self.rld[0].costs.decode_step_s(1, 0))
        self.states: list[_Req] = []

    # -- the router

    def _pick(self, tier: str) -> int:
        loads: list[int | None] = list(self.load[tier])
        i = pick_least_loaded(loads, self.cursor[tier])
        self.cursor[tier] = (self.cursor[tier] + 1) % len(loads)
        return i

    def md_cached(self, req: SimRequest, md: int) -> int:
        """MD's prefix hit for this request (see the module docstring)."""
        if self.cfg.kind in ("same-dc", "naive"):
            return 0
        hot = self.cfg.hot_set_tokens
        if not hot:
            return req.cached_tokens
        inst = self.md[md]
        free = max(inst.costs.kv_capacity_tokens - inst.reserved, 0)
        return int(req.cached_tokens * min(1.0, free * len(self.md) / hot))

    def _arrive(self, st: _Req) -> None:
        req, cfg = st.req, self.cfg
        st.p = self._pick("P")
        self.load["P"][st.p] += 1
        st.md = self._pick("MD")
        st.md_hit = self.md_cached(req, st.md)
        if cfg.kind == "pdd":
            st.rld = self._pick("RLD")
            signals = Signals(
                prompt_tokens=req.prompt_tokens,
                max_new_tokens=req.output_tokens,
                md_cached_tokens=st.md_hit,
                transfer_s=self.wan_est[st.md].transfer_s(req.prompt_tokens - st.md_hit),
                relay_decode_s=self.relay_speed.decode_s(req.output_tokens),
                relay_load=self.load["RLD"][st.rld],
            )
            choice = choose_path(None, cfg.path, [], signals, cfg.path_policy)
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
        self.p[st.p].submit(st)

    def prefilled(self, st: _Req) -> None:
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
            self.wan.send(st.wan_bytes, lambda: self._to_main(st))

    def _rdma_s(self, src: StepCosts, dst: StepCosts, nbytes: float) -> float:
        rate = min(src.send_bytes_s, dst.send_bytes_s)
        return self.cfg.rdma_latency_s + nbytes / rate

    # -- RLD

    def _to_relay(self, st: _Req) -> None:
        if st.finished or st.relay_stopped:
            return
        assert st.rld is not None
        req = st.req
        slot = _Slot(st, req.prompt_tokens + req.output_tokens, req.output_tokens,
                     self._relay_admitted, self._relay_finished)  # fmt: skip
        st.rld_slot = slot
        self.rld[st.rld].request(slot)

    def _relay_admitted(self, slot: _Slot) -> None:
        st = slot.st
        st.see_first(self.clock.now)  # RLD streams token 0 at once
        assert st.rld is not None
        self.rld[st.rld].run(slot, 1, st.req.prompt_tokens)

    def _relay_finished(self, slot: _Slot) -> None:
        st = slot.st
        now = self.clock.now
        self._observe_relay(st, slot.target)
        self._release_relay(st)
        st.tokens["RLD"] = slot.target - 1
        self._finish(st, now)
        if st.md is not None:  # MD is cancelled; it keeps the prompt's KV in its cache
            if st.md_slot is not None:
                self.md[st.md].release(st.md_slot)
            self._release_main(st)

    def _observe_relay(self, st: _Req, tokens: int) -> None:
        if math.isfinite(st.first_s):
            self.relay_speed.observe(tokens, self.clock.now - st.first_s)

    def _release_relay(self, st: _Req) -> None:
        if st.rld is not None and not st.relay_stopped:
            st.relay_stopped = True
            self.load["RLD"][st.rld] -= 1

    def _release_main(self, st: _Req) -> None:
        if st.md is not None:
            self.load["MD"][st.md] -= 1
            st.md = None

    # -- MD

    def _to_main(self, st: _Req) -> None:
        """The prompt's KV (or its suffix) landed on MD (or D)."""
        if st.finished or st.md is None:
            return
        req = st.req
        reserve = req.prompt_tokens + req.output_tokens  # a cached prefix is held all the same
        on_admit = self._ready if st.path == "pdd" else self._main_admitted
        slot = _Slot(st, reserve, req.output_tokens, on_admit, self._main_finished)
        st.md_slot = slot
        self.md[st.md].request(slot)

    def _main_admitted(self, slot: _Slot) -> None:
        st = slot.st
        st.see_first(self.clock.now + st.stream_delay_s)
        assert st.md is not None
        self.md[st.md].run(slot, 1, st.req.prompt_tokens)

    def _main_finished(self, slot: _Slot) -> None:
        st = slot.st
        done_by_md = slot.target - max(st.tokens.get("RLD", 0) + 1, 1)
        st.tokens["MD"] = done_by_md
        self._finish(st, self.clock.now + st.stream_delay_s)
        self._release_main(st)

    def _ready(self, slot: _Slot) -> None:
        """MD holds the KV: READY goes to the router."""
        self.clock.at(self.clock.now + self.cfg.link.one_way_s(self.rng), self._on_ready, slot.st)

    def _on_ready(self, st: _Req) -> None:
        now = self.clock.now
        if st.finished or st.md is None:
            return
        suffix = st.req.prompt_tokens - st.md_hit
        self.wan_est[st.md].observe(int(st.wan_bytes), suffix, now - st.wan_sent_s)
        pending = self._available(st)
        load = self.load["RLD"][st.rld] if st.rld is not None else 0
        st.mode = choose_mode(self.cfg.handoff, pending=pending, relay_load=load)
        if st.mode == "extend":
            self._handoff(st)
        else:
            self._catchup(st)

    def _available(self, st: _Req) -> int:
        """Output tokens the client has from RLD (token 0 included)."""
        slot = st.rld_slot
        if slot is None or st.rld is None or not slot.active:
            return 0
        return self.rld[st.rld].visible(slot)

    def _catchup(self, st: _Req) -> None:
        relay_running = st.rld_slot is not None and st.rld_slot.running and st.rld_slot.active
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
                      extended)  # fmt: skip

    def _on_ack(self, st: _Req, done: int) -> None:
        if st.finished:
            return
        st.md_done = done
        self._catchup(st)

    def _handoff(self, st: _Req) -> None:
        available = self._available(st)
        if st.rld_slot is not None and st.rld is not None:
            if st.rld_slot.running and available:
                self._observe_relay(st, available)
            self.rld[st.rld].release(st.rld_slot)
        self._release_relay(st)
        st.tokens["RLD"] = max(available - 1, 0)
        base = max(available, 1)
        k = base - st.md_done
        md, slot, prompt = st.md, st.md_slot, st.req.prompt_tokens
        assert md is not None and slot is not None

        def extended() -> None:
            if available == 0:
                st.see_first(self.clock.now + st.stream_delay_s)
            self.md[md].run(slot, base + 1, prompt + base)

        t = self.clock.now + self.cfg.link.one_way_s(self.rng)
        self.clock.at(t, self.md[md].extend, k, prompt + st.md_done, extended)

    def _finish(self, st: _Req, t: float) -> None:
        st.finished = True
        st.finish_s = t
        st.see_first(t)

    # -- running

    def run(self) -> SimResult:
        for i, req in enumerate(self.requests):
            st = _Req(i, req)
            self.states.append(st)
            self.clock.at(req.arrival_s, self._arrive, st)
        self.clock.run()
        results = [self._result(st) for st in self.states]
        if any(not st.finished for st in self.states):
            raise RuntimeError("simulation ended with unfinished requests")
        summary = summarize(results, Sla(), self._utilisation(), self.cfg.cost)
        return SimResult(self.cfg, results, summary, self.clock.events)

    def _utilisation(self) -> dict[str, float]:
        """Per tier: the fraction of time its instances ran forwards, between the first
        arrival and the tier's last forward (decode: time spent stepping, at any batch size)."""
        t0 = min((r.arrival_s for r in self.requests), default=0.0)
        tiers: dict[str, Sequence[_Prefill | _Decode]] = {"P": self.p, "MD": self.md}
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

    def _result(self, st: _Req) -> RequestResult:
        r = st.req
        tokens = {t: st.tokens.get(t, 0) for t in TIERS}
        return RequestResult(
            index=st.index,
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            md_cached_tokens=st.md_hit,
            output_tokens=r.output_tokens,
            path=st.path,
            reason=st.reason,
            first_token_s=st.first_s,
            finish_s=st.finish_s,
            wan_bytes=st.wan_bytes,
            rdma_bytes=st.rdma_bytes,
            tokens=tokens,
            handoff_mode=st.mode,
            chunks=st.chunks,
        )


def simulate(requests: Iterable[Any], config: ClusterConfig, sla: Sla | None = None) -> SimResult:
    """Run `requests` (SimRequest or anything `as_sim_request` reads) through `config`."""
    result = Simulation(config, requests).run()
    if sla is not None:
        s = result.summary
        result.summary = summarize(result.results, sla, s.utilisation, s.cost)
    return result


# ----------------------------------------------------------------------------------------------
# Workloads for standalone runs (the full generator lives in pdd.eval.workload)


def poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def fixed_requests(
    n: int, rate: float, prompt: int, hit: float, output: int, seed: int = 0
) -> list[SimRequest]:
    """Poisson arrivals of identical requests: `prompt` tokens, a `hit` fraction cached."""
    rng = random.Random(seed)
    cached = min(prompt, round(prompt * hit))
    return [SimRequest(t, prompt, cached, output) for t in poisson_times(n, rate, rng)]


def agentic_requests(
    n: int,
    rate: float,
    seed: int = 0,
    *,
    prompt: tuple[int, int] = (16_000, 96_000),
    output: tuple[int, int] = (200, 2000),
    singular: float = 0.035,
) -> list[SimRequest]:
    """A skewed agentic mix (the paper's shape): 75% of requests hit 95-100%, 20% hit 70-95%,
    5% a low-hit tail (0-50%), mean ~90%; `singular` of them are long-input, short-output
    (1-16 tokens), low-hit requests."""
    rng = random.Random(seed)
    out = []
    for t in poisson_times(n, rate, rng):
        length = round(math.exp(rng.uniform(math.log(prompt[0]), math.log(prompt[1]))))
        gen = round(math.exp(rng.uniform(math.log(output[0]), math.log(output[1]))))
        u = rng.random()
        if u < singular:
            hit, gen = rng.uniform(0.0, 0.3), rng.randint(1, 16)
        elif u < 0.75:
            hit = rng.uniform(0.95, 1.0)
        elif u < 0.95:
            hit = rng.uniform(0.7, 0.95)
        else:
            hit = rng.uniform(0.0, 0.5)
        out.append(SimRequest(t, length, min(length, round(length * hit)), gen))
    return out


def rescale(requests: Sequence[Any], rate: float) -> list[SimRequest]:
    """The same requests with arrival times stretched to a mean rate of `rate` per second."""
    reqs = sorted((as_sim_request(r) for r in requests), key=lambda r: r.arrival_s)
    if len(reqs) < 2:
        return reqs
    t0 = reqs[0].arrival_s
    span = reqs[-1].arrival_s - t0
    if span <= 0:
        return reqs
    k = (len(reqs) - 1) / rate / span
    return [replace(r, arrival_s=(r.arrival_s - t0) * k) for r in reqs]
