"""What every part of a request's life shares: its state, the calls it makes to the tiers
(P's prefills, the RLD and MD streams), and how it ends (the final chunk, a failure, cleanup).
The flows that decide (pdd_request, handoff_flow, resume_flow) build on it."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pdd.control.messages import Ready
from pdd.policy.handoff import Step
from pdd.router.context import RouterContext
from pdd.router.hold import RelayHold
from pdd.router.planner import Plan
from pdd.router.request_machine import IllegalTransition, RequestMachine, State
from pdd.router.request_types import (
    ROOM_LIMIT,
    MdState,
    Output,
    PddMeta,
    PrefillDone,
    RelayState,
    StreamChunk,
    StreamEnd,
    cut,
)
from pdd.router.stitch import Phase, Stitcher
from pdd.router.upstream import UpstreamError, abort_request, post_generate, stream_generate

logger = logging.getLogger(__name__)


class RequestBase(ABC):
    def __init__(
        self,
        ctx: RouterContext,
        body: dict[str, Any],
        plan: Plan,
        disconnected: Callable[[], bool] = lambda: False,
        hold_relay: int | None = None,
        may_retry: bool = False,
    ) -> None:
        choice = plan.choice
        self.plan = plan
        self.ctx = ctx
        self.cfg = ctx.config
        self.body = body  # the client's body minus router fields; `stream` is set per call
        self.path = choice.path
        self.rid = uuid.uuid4().hex
        self.disconnected = disconnected
        self.meta = PddMeta(choice.label, choice.reason, self.rid)
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.machine = RequestMachine()
        self.meta.states = self.machine.history
        self.stitcher = Stitcher(self.rid, Phase.MAIN if self.path == "main" else Phase.RELAY)
        self.md = MdState.PENDING if self.path == "pdd" else MdState.UNUSED
        self.relay = RelayState.UNUSED
        self.room = random.randrange(ROOM_LIMIT)  # P -> RLD
        self.room_md = random.randrange(ROOM_LIMIT)  # P -> MD
        self.ready: Ready | None = None
        self.done = 0  # leading output tokens MD holds KV for (Catch-Up)
        self.inflight: Step | None = None
        self.ack_deadline: float | None = None
        self.t0 = time.monotonic()
        self.sent_outputs = 0
        self.succeeded = False
        self.closed = False
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.held: dict[str, int] = {}  # tier -> instance index
        self.relay_rid = f"{self.rid}-r"
        self.main_rid = self.rid
        self.released: set[str] = set()
        self.lost_instance = False  # an instance it held went away (see _upstream_failed)
        self.may_retry = may_retry  # the router may plan it again (pdd.router.app)
        # A test control (pdd.router.hold): only a handoff path has a point to fix.
        self.hold = RelayHold(hold_relay) if hold_relay and self.path == "pdd" else None
        self.answer: dict[str, Any] | None = None  # P -> MD: MD's last chunk, awaiting READY

    # --- set-up ------------------------------------------------------------------------------

    def _upstream_failed(self, tier: str, err: UpstreamError) -> None:
        """An instance that went away counts against its health (pdd.router.health), and the
        request may run again elsewhere if the client got nothing yet; a call that timed out is
        counted by tier."""
        if err.lost and tier in self.held:
            self.lost_instance = True
            self.ctx.health.request_lost(tier, self.held[tier], err.reason, err.unreachable)
        if err.status == 504:
            self.ctx.metrics.inc("timeouts_total", wait=tier)

    def _acquire(self, tier: str, i: int | None) -> int:
        assert i is not None, f"the plan has no {tier} instance"
        hashes = self.plan.hashes  # the prompt's tokens take KV on that instance
        self.ctx.hold(tier, i, 0 if hashes is None else len(hashes.tokens))
        self.held[tier] = i
        return i

    def _count_hit(self, side: str, cached: int, prompt: int) -> None:
        self.ctx.metrics.inc("prefix_cached_tokens_total", cached, side=side)
        self.ctx.metrics.inc("prefix_prompt_tokens_total", prompt, side=side)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _mark(self, name: str) -> None:
        self.meta.timings.setdefault(name, round(self._now(), 6))

    def _enter(self, state: State) -> None:
        try:
            self.machine.enter(state, self._now())
        except IllegalTransition as err:  # a handler's bug: reported, the request goes on
            logger.error("request %s: illegal state transition %s", self.rid, err)
            self.ctx.metrics.inc("errors_total", kind="state")

    def _body(
        self, *, rid: str, room: int, stream: bool, hints: dict | None = None,
        base: dict | None = None,
    ) -> dict:  # fmt: skip
        prefill = self.cfg.prefill[self.held["prefill"]]
        body = {
            **(self.body if base is None else base),
            "rid": rid,
            "stream": stream,
            "bootstrap_host": prefill.bootstrap_host,
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room,
        }
        if hints is not None:
            body["kv_hints"] = hints
        return body

    def _main_body(self, *, rid: str, room: int, hints: dict, base: dict | None = None) -> dict:
        """MD's request; an MD that is one DP rank of a server gets it pinned there."""
        body = self._body(rid=rid, room=room, stream=True, hints=hints, base=base)
        dp_rank = self.cfg.main[self.held["main"]].dp_rank
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
            self.meta.instances["main_dp_rank"] = str(dp_rank)
        return body

    @property
    def prefill_url(self) -> str:
        return self.cfg.prefill[self.held["prefill"]].url

    @property
    def relay_url(self) -> str:
        return self.cfg.relay[self.held["relay"]].url

    @property
    def main_url(self) -> str:
        return self.cfg.main[self.held["main"]].url

    @property
    def main_addr(self) -> str:
        return self.cfg.main[self.held["main"]].control_addr

    def _prefill(self, which: str, room: int, base: dict | None = None) -> None:
        body = self._body(rid=f"{self.rid}-{which}", room=room, stream=False, base=base)

        async def run() -> None:
            try:
                answer = await post_generate(
                    self.ctx.session, self.prefill_url, body, self.cfg.timeouts, "P"
                )
                meta = answer.get("meta_info")
                cached = meta.get("cached_tokens") if isinstance(meta, dict) else None
                cached = cached if isinstance(cached, int) else None
                self.events.put_nowait(PrefillDone(which, None, cached))
            except UpstreamError as err:
                self._upstream_failed("prefill", err)
                self.events.put_nowait(PrefillDone(which, err))
            except Exception as err:  # a bug here must end the request, not hang it
                logger.exception("request %s: prefill call failed", self.rid)
                self.events.put_nowait(PrefillDone(which, UpstreamError(502, repr(err))))

        self.tasks[which] = self.ctx.spawn(run())

    def _stream(self, source: str, url: str, body: dict, role: str) -> None:
        rid = str(body["rid"])

        async def run() -> None:
            try:
                gen = stream_generate(self.ctx.session, url, body, self.cfg.timeouts, role)
                async for chunk in gen:
                    self.events.put_nowait(StreamChunk(source, chunk, rid))
                self.events.put_nowait(StreamEnd(source, None, rid))
            except UpstreamError as err:
                self._upstream_failed(source, err)
                self.events.put_nowait(StreamEnd(source, err, rid))
            except Exception as err:
                logger.exception("request %s: %s stream failed", self.rid, role)
                self.events.put_nowait(StreamEnd(source, UpstreamError(502, repr(err)), rid))

        self.tasks[source] = self.ctx.spawn(run())

    # --- endings -----------------------------------------------------------------------------

    def _final(self, chunk: dict[str, Any]) -> Output:
        self.succeeded = True
        self._mark("end")
        self._enter(State.DONE)
        return Output(self._with_meta(chunk), final=True)

    def _with_meta(self, chunk: dict[str, Any]) -> dict[str, Any]:
        meta = dict(chunk.get("meta_info") or {})
        meta["pdd"] = self.meta.to_dict()
        return {**chunk, "meta_info": meta}

    def _fail(self, reason: str, status: int) -> list[Output]:
        reason = cut(reason)
        self._mark("end")
        self._enter(State.DONE)
        logger.warning("request %s failed: %s", self.rid, reason)
        if self.sent_outputs == 0:
            raise UpstreamError(status, reason)
        return [Output(self._with_meta(self.stitcher.failure_chunk(reason)), True, True)]

    def _stop_main(self) -> None:
        """MD's call is cancelled here and its request aborted on MD."""
        self._cancel_task("main")
        self.ctx.spawn(
            abort_request(self.ctx.session, self.main_url, self.main_rid, self.cfg.timeouts)
        )

    def _abort_prefills(self, *which: str) -> None:
        """Calls to P still running are cancelled here and aborted on P."""
        for name in which:
            task = self.tasks.get(name)
            if task is not None and not task.done():
                task.cancel()
                rid = f"{self.rid}-{name}"
                self.ctx.spawn(
                    abort_request(self.ctx.session, self.prefill_url, rid, self.cfg.timeouts)
                )

    def _cancel_task(self, name: str) -> None:
        task = self.tasks.get(name)
        if task is not None and not task.done():
            task.cancel()

    def _release(self, tier: str) -> None:
        i = self.held.get(tier)
        if i is not None and tier not in self.released:
            self.ctx.release(tier, i)
            self.released.add(tier)

    def close(self) -> None:
        """Idempotent cleanup: whatever still runs on any instance is stopped."""
        if self.closed:
            return
        self.closed = True
        self._enter(State.DONE)
        self.ctx.unsubscribe(self.rid)
        if self.md in (MdState.PENDING, MdState.CATCHUP):
            self.md = MdState.DEAD
            self._cancel_md("request ended")
        elif not self.succeeded and (self.md is MdState.HANDED_OFF or self.path == "main"):
            self._stop_main()
        self._stop_relay()
        if not self.succeeded:
            self._abort_prefills("p", "p2", "p3")
        for tier in list(self.held):
            self._release(tier)
        m = self.ctx.metrics
        m.inc("requests_total", path=self.meta.path if self.succeeded else "failed")
        m.inc("relay_tokens_total", self.meta.relay_tokens)
        m.inc("main_tokens_total", self.meta.main_tokens)
        if self.meta.wan_kv_bytes:
            m.inc("wan_kv_bytes_total", self.meta.wan_kv_bytes)
        self._observe_latency()

    def _observe_latency(self) -> None:
        first, end = self.meta.timings.get("first_token"), self.meta.timings.get("end")
        if not self.succeeded or first is None:
            return
        base, main = self.plan.direct_ttft_s, self.plan.main
        if self.path == "main" and self.meta.resumed_at is None and base is not None:
            if main is not None:
                self.ctx.first_token_residual[main].observe(first - base, time.monotonic())
        path = self.meta.path
        self.ctx.metrics.observe("ttft_seconds", first, path=path)
        tokens = self.meta.relay_tokens + self.meta.main_tokens
        if end is not None and tokens > 1:
            self.ctx.metrics.observe("tpot_seconds", (end - first) / (tokens - 1), path=path)

    # --- what the flows provide ---------------------------------------------------------------

    @abstractmethod
    def _stop_relay(self) -> None: ...

    @abstractmethod
    def _cancel_md(self, reason: str) -> None: ...

    @abstractmethod
    def _md_dead(self, reason: str, kind: str) -> list[Output]: ...

    @abstractmethod
    def _main_failed(self, reason: str, status: int) -> list[Output]: ...
