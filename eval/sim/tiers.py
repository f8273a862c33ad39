"""The simulated instances and what they hold: a P instance's FIFO prefill batches, a decode
instance's continuous batching (D, RLD and MD alike; MD also runs handoff extends), and the
per-request state both move along.

They know only the clock and their own costs; what happens when a request is prefilled,
admitted or finished is a callback, decided by `simulation.Simulation` (the router's part)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.eval.sim.clock import Clock
from pdd.eval.sim.config import TIERS
from pdd.eval.sim.costs import StepCosts
from pdd.eval.sim.requests import SimRequest
from pdd.eval.sim.results import RequestResult


@dataclass(eq=False)
class RequestState:
    """One request's progress through the cluster: its path, instances, times and tokens."""

    index: int
    req: SimRequest
    path: str = "main"
    reason: str = ""
    md_hit: int = 0
    p: int = 0
    rld: int | None = None
    md: int | None = None
    rld_slot: Slot | None = None
    md_slot: Slot | None = None
    first_s: float = math.inf
    finish_s: float = math.inf
    stream_delay_s: float = 0.0  # MD -> the user in datacenter A
    wan_bytes: float = 0.0
    rdma_bytes: float = 0.0
    wan_sent_s: float = 0.0
    relay_answered_s: float | None = None  # P's answer for RLD (its KV is on RLD)
    tokens: dict[str, int] = field(default_factory=dict)
    mode: str | None = None
    chunks: int = 0
    md_done: int = 0  # leading output tokens MD holds KV for
    relay_stopped: bool = False
    finished: bool = False
    direct_base_s: float | None = None  # the router's P->MD first token, compute + transfer

    def see_first(self, t: float) -> None:
        self.first_s = min(self.first_s, t)

    def result(self) -> RequestResult:
        r = self.req
        return RequestResult(
            index=self.index,
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            md_cached_tokens=self.md_hit,
            output_tokens=r.output_tokens,
            path=self.path,
            reason=self.reason,
            first_token_s=self.first_s,
            finish_s=self.finish_s,
            wan_bytes=self.wan_bytes,
            rdma_bytes=self.rdma_bytes,
            tokens={t: self.tokens.get(t, 0) for t in TIERS},
            handoff_mode=self.mode,
            chunks=self.chunks,
        )


@dataclass(eq=False)
class Slot:
    """One request on one decode instance."""

    st: RequestState
    reserve: int  # KV tokens held
    target: int  # output tokens at which it ends
    on_admit: Callable[[Slot], None]
    on_finish: Callable[[Slot], None]
    # When it joins a step: SGLang's decode server streams a request's first token in the loop
    # iteration that takes it in, after the step that was running.
    on_join: Callable[[Slot], None] | None = None
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


Job = tuple[RequestState, tuple[int, int], Callable[[RequestState], None]]  # (new, cached)


class Prefill:
    def __init__(
        self,
        clock: Clock,
        costs: StepCosts,
        budget: int,
        on_prefilled: Callable[[RequestState], None],
    ) -> None:
        self.clock, self.costs, self.budget = clock, costs, budget
        self.on_prefilled = on_prefilled
        self.queue: deque[Job] = deque()
        self.busy = False
        self.busy_s = 0.0
        self.last_s = 0.0  # when its last forward ended

    def submit(self, st: RequestState) -> None:
        """The request's prefill; `on_prefilled` when done."""
        self._queue((st, prefill_job(st.req), self.on_prefilled))

    def feed(self, st: RequestState, done: Callable[[RequestState], None]) -> None:
        """A second request for a prompt P holds (the router feeding MD on P->RLD->MD): P
        recomputes its last token and sends the KV; `done` when that forward ends."""
        n = st.req.prompt_tokens
        self._queue((st, (1, n - 1), done))

    def _queue(self, job: Job) -> None:
        self.queue.append(job)
        if not self.busy:
            self._start()

    def _start(self) -> None:
        batch: list[Job] = []
        new = 0
        while self.queue:
            n = self.queue[0][1][0]
            if batch and new + n > self.budget:
                break
            batch.append(self.queue.popleft())
            new += n
        dt = self.costs.prefill_batch_s([job for _, job, _ in batch])
        self.busy = True
        self.busy_s += dt
        self.last_s = self.clock.now + dt
        self.clock.at(self.last_s, self._done, batch)

    def _done(self, batch: list[Job]) -> None:
        self.busy = False
        for st, _, done in batch:
            done(st)
        if self.queue:
            self._start()


@dataclass(frozen=True)
class Extend:
    """Handed-over tokens MD must recompute: `tokens` new ones over `context` tokens of KV."""

    tokens: int
    context: int
    on_done: Callable[[], None]
    handoff: bool  # the final HANDOFF (False: a Catch-Up CHUNK)


class Decode:
    """Continuous batching: each step gives every running request one token.

    MD's handoffs as pdd.srt.main_decode runs them: what arrived while a step ran is one
    extend batch of SGLang's loop (chunks and handoffs together; none when no token needs its
    KV), run before the next decode step, which the handed-off requests join (SGLang merges
    them into the running batch)."""

    def __init__(self, clock: Clock, costs: StepCosts, max_batch: int) -> None:
        self.clock, self.costs, self.max_batch = clock, costs, max_batch
        self.steps = 0
        self.batch = 0
        self.kv = 0  # context tokens of the running requests
        self.reserved = 0
        self.slots = 0  # admitted: running or waiting for a handoff
        self.waiting: deque[Slot] = deque()
        self.joining: list[Slot] = []
        self.extends: list[Extend] = []
        self.extend_forwards = 0  # extend forwards run (each one pass over the weights)
        self.finishes: list[tuple[int, int, Slot]] = []
        self._seq = itertools.count()
        self.stepping = False
        self.kicked = False
        self.busy_s = 0.0
        self.last_s = 0.0

    def visible(self, slot: Slot) -> int:
        """Output tokens the request has from this instance's steps so far."""
        if not slot.running or slot.joined > self.steps:
            return slot.visible0 if slot.admitted else 0
        return slot.visible0 + self.steps - slot.joined

    def free_kv(self) -> int:
        """KV tokens neither held by an admitted request nor asked for by a waiting one."""
        waiting = sum(s.reserve for s in self.waiting if s.active)
        return self.costs.kv_capacity_tokens - self.reserved - waiting

    def request(self, slot: Slot) -> None:
        if slot.reserve > self.costs.kv_capacity_tokens:
            raise ValueError(
                f"a request needs {slot.reserve} KV tokens; an instance holds "
                f"{self.costs.kv_capacity_tokens}"
            )
        self.waiting.append(slot)
        self._admit()

    def _admit(self) -> None:
        """Takes in waiting requests. SGLang's loop polls transfers between forwards: KV that
        lands during one is taken in (and MD's READY sent) when it ends."""
        if self.stepping:
            return
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

    def run(self, slot: Slot, visible: int, context: int) -> None:
        """Start producing tokens for an admitted request that has `visible` output tokens and
        KV for `context` tokens; it joins the next step."""
        slot.visible0, slot.context0 = visible, context
        if visible >= slot.target:
            self.release(slot)
            slot.on_finish(slot)
            return
        self.joining.append(slot)
        self._kick()

    def extend(
        self, tokens: int, context: int, on_done: Callable[[], None], handoff: bool = True
    ) -> None:
        """Recompute `tokens` handed-over tokens over `context` tokens of KV before the next
        decode step; `on_done` runs when their forward ends (a handoff joins that step)."""
        self.extends.append(Extend(tokens, context, on_done, handoff))
        self._kick()

    def release(self, slot: Slot) -> None:
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
                self.clock.at(self.clock.now, self._admit)

    def _kick(self) -> None:
        if not self.stepping and not self.kicked and (self.batch or self.joining or self.extends):
            self.kicked = True  # start on the next event at this instant: joins arrive together
            self.clock.at(self.clock.now, self._start)

    def _start(self) -> None:
        self.kicked = False
        if self.stepping or not (self.batch or self.joining or self.extends):
            return
        self.stepping = True
        ext, self.extends = self.extends, []
        now = self.clock.now
        # MD's order (pdd.srt.main_decode.poll): one extend batch for the chunks and the
        # handoffs (the chunks' ACKs leave when it is done), then the decode step.
        chunks = [e for e in ext if not e.handoff]
        handoffs = [e for e in ext if e.handoff]
        t = now + self._extend_forward(ext)
        for e in chunks:
            self.clock.at(t, e.on_done)
        if t > now:
            self.last_s = t
            self.clock.at(t, self._extended, handoffs)
        else:
            self._extended(handoffs)

    def _extend_forward(self, group: list[Extend]) -> float:
        """One extend forward over `group`'s tokens (none when no token needs its KV)."""
        jobs = [(e.tokens, e.context) for e in group if e.tokens > 0]
        if not jobs:
            return 0.0
        self.extend_forwards += 1
        dt = self.costs.extend_batch_s(jobs)
        self.busy_s += dt
        return dt

    def _extended(self, handoffs: list[Extend]) -> None:
        """The extends are done: the handed-off requests join; then the decode step."""
        for e in handoffs:
            e.on_done()
        for slot in self.joining:
            if slot.on_join is not None:
                slot.on_join(slot)
            slot.running = True
            slot.joined = self.steps
            self.batch += 1
            self.kv += slot.context0
            end = self.steps + slot.target - slot.visible0
            heapq.heappush(self.finishes, (end, next(self._seq), slot))
        self.joining = []
        if not self.batch:  # only extends ran (chunks of parked requests): no decode step
            self.stepping = False
            self._admit()
            self._kick()
            return
        self._busy(self.costs.decode_step_s(self.batch, self.kv))
        self.clock.at(self.last_s, self._end)

    def _busy(self, dt: float) -> None:
        self.busy_s += dt
        self.last_s = self.clock.now + dt

    def _end(self) -> None:
        self.stepping = False
        self.steps += 1
        self.kv += self.batch
        while self.finishes and self.finishes[0][0] <= self.steps:
            _, _, slot = heapq.heappop(self.finishes)
            if slot.active and slot.running:
                self.release(slot)
                slot.on_finish(slot)
        self._admit()
        if not self.kicked:
            self._start()  # back to back: no extra event per step
