"""One request through P->RLD->MD (or P->RLD, or P->MD): fan-out, handoff, stitching, cleanup.

All decisions happen in one task that consumes one event queue (stream chunks, P answers,
control messages, deadlines), so the handoff snapshot is always exactly what the client got.
The request's states and the transitions between them: pdd.router.request_machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from pdd.control.channel import Received
from pdd.control.messages import route_hint
from pdd.policy.path import LABELS
from pdd.router.handoff_flow import HandoffFlow
from pdd.router.request_machine import State
from pdd.router.request_types import (
    MdState,
    Output,
    PrefillDone,
    RelayState,
    StreamChunk,
    StreamEnd,
    cut,
)
from pdd.router.resume_flow import ResumeFlow
from pdd.router.stitch import Kind
from pdd.router.upstream import abort_request

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0


class PddRequest(HandoffFlow, ResumeFlow):
    def start(self) -> None:
        self.ctx.subscribe(self.rid, self.events)
        p = self._acquire("prefill", self.plan.prefill)
        self.meta.instances["prefill"] = self.cfg.prefill[p].url
        if self.plan.hashes is not None:
            self.ctx.prefill_index[p].add(self.plan.hashes)
        if self.path in ("pdd", "relay"):
            self._acquire("relay", self.plan.relay)
            self.meta.instances["relay"] = self.relay_url
            self.relay = RelayState.RUNNING
            self._prefill("p", self.room)
            relay_body = self._body(rid=self.relay_rid, room=self.room, stream=True)
            self._stream("relay", self.relay_url, relay_body, "RLD")
        if self.path in ("pdd", "main"):
            self._acquire("main", self.plan.main)
            self.meta.instances["main"] = self.main_url
            self.meta.md_predicted_cached_tokens = self.plan.md_predicted
            park = self.path == "pdd"
            hints = route_hint(role="main", park=park, reply_to=self.ctx.reply_to)
            main_body = self._main_body(rid=self.rid, room=self.room_md, hints=hints)
            self._stream("main", self.main_url, main_body, "MD")
        if self.path == "main":
            self._mark("prefill_main_sent")
            self._prefill("p", self.room_md)

    # --- the event loop ----------------------------------------------------------------------

    async def outputs(self) -> AsyncGenerator[Output, None]:
        """The client's chunks, the last one final. Raises UpstreamError when the request fails
        before anything was produced (the client then gets a plain HTTP error)."""
        while True:
            wait = max(0.0, min(self._next_deadline() - time.monotonic(), DISCONNECT_POLL_S))
            try:
                event = await asyncio.wait_for(self.events.get(), wait)
            except asyncio.TimeoutError:
                event = None
            if self.disconnected():
                logger.info("request %s: client disconnected", self.rid)
                self.ctx.metrics.inc("errors_total", kind="client_disconnected")
                return
            outs = self._on_tick() if event is None else self._handle(event)
            if not any(out.final for out in outs):
                outs += self._hold_step()
            for out in outs:
                self.sent_outputs += 1
                yield out
                if out.final:
                    return

    def _next_deadline(self) -> float:
        deadlines = [self.t0 + self.cfg.timeouts.request]
        if (self.md is MdState.PENDING and self.ready is None) or self.answer is not None:
            deadlines.append(self.t0 + self.cfg.timeouts.ready)
        if self.md is MdState.CATCHUP and self.ack_deadline is not None:
            deadlines.append(self.ack_deadline)
        return min(deadlines)

    def _handle(self, event: Any) -> list[Output]:
        if isinstance(event, (StreamChunk, StreamEnd)) and event.rid != self._current_rid(event):
            return []  # a call the request has moved on from (e.g. MD's before a resume on MD)
        if isinstance(event, (StreamChunk, StreamEnd)) and event.source == "relay":
            event = self._admit_relay(event)
            if event is None:
                return []  # held (pdd.router.hold)
        if isinstance(event, StreamChunk):
            if event.source == "relay":
                return self._on_relay_chunk(event.chunk)
            return self._on_main_chunk(event.chunk)
        if isinstance(event, StreamEnd):
            return self._on_stream_end(event)
        if isinstance(event, PrefillDone):
            return self._on_prefill(event)
        if isinstance(event, Received):
            return self._on_control(event)
        raise TypeError(f"unknown event {event!r}")

    def _current_rid(self, event: StreamChunk | StreamEnd) -> str:
        return self.relay_rid if event.source == "relay" else self.main_rid

    def _admit_relay(self, event: StreamChunk | StreamEnd) -> StreamChunk | StreamEnd | None:
        """RLD's event as the request sees it: under a hold, while MD has not taken over, what
        comes after the client's first k tokens is held."""
        hold = self.hold
        if hold is None or self.md not in (MdState.PENDING, MdState.CATCHUP):
            return event
        admitted = hold.admit(event, self.stitcher.text)
        if hold.engaged:
            self._mark("relay_held")
        return admitted

    def _hold_step(self) -> list[Output]:
        """After each event, under a hold (pdd.router.hold): a READY that came before the client
        had the hold's tokens is acted on once it has them (or RLD stopped); once MD took over or
        dropped out, what RLD produced meanwhile is handled as it would have been."""
        hold = self.hold
        if hold is None:
            return []
        outs: list[Output] = []
        # Only a READY that waited for the hold leaves MD pending with a READY in hand.
        if self.md is MdState.PENDING and self.ready is not None:
            if hold.engaged or self.relay is not RelayState.RUNNING:
                outs = self._take_over()
        if self.md not in (MdState.PENDING, MdState.CATCHUP):
            for event in hold.release():
                outs += self._handle(event)
        return outs

    def _on_tick(self) -> list[Output]:
        now = time.monotonic()
        timeouts, metrics = self.cfg.timeouts, self.ctx.metrics
        if now >= self.t0 + timeouts.request:
            metrics.inc("timeouts_total", wait="request")
            return self._fail(f"request timed out after {timeouts.request:.0f}s", 504)
        if self.md is MdState.PENDING and self.ready is None and now >= self.t0 + timeouts.ready:
            metrics.inc("timeouts_total", wait="ready")
            why = self.ctx.caches.silence(self.main_addr)
            reason = f"MD not ready within {timeouts.ready:g}s" + (f" ({why})" if why else "")
            return self._md_dead(reason, "timeout")
        if self.answer is not None and now >= self.t0 + timeouts.ready:
            metrics.inc("timeouts_total", wait="ready")
            logger.warning("request %s: no READY from MD within %gs; answered without it",
                           self.rid, timeouts.ready)  # fmt: skip
            return [self._final(self.answer)]
        if self.md is MdState.CATCHUP and self.ack_deadline and now >= self.ack_deadline:
            metrics.inc("timeouts_total", wait="ack")
            return self._md_dead(f"no ACK within {timeouts.ack:g}s", "timeout")
        return []

    # --- P -----------------------------------------------------------------------------------

    def _on_prefill(self, event: PrefillDone) -> list[Output]:
        if event.which == "p2":
            if event.error is None:
                self._mark("prefill_md_done")
                return []
            if self.md in (MdState.PENDING, MdState.CATCHUP):
                return self._md_dead(f"prefill for MD failed: {event.error.reason}", "prefill")
            return []
        if self.meta.resumed_at is not None:  # only the resume's prefill matters now
            if event.which != "p3" or event.error is None:
                return []
            return self._fail(f"prefill to resume failed: {event.error.reason}", 502)
        if event.error is not None:
            self.ctx.metrics.inc("errors_total", kind="prefill")
            reason, status = event.error.reason, event.error.status
            if self.path == "pdd" and self.relay is RelayState.RUNNING and status >= 500:
                # RLD's KV will not come (a dead RLD, say); MD, fed by its own prefill, may
                # still serve the request.
                self._stop_relay()  # RLD's request would wait for that KV
                return self._relay_dead(f"prefill for RLD failed: {reason}", status)
            if self.path == "main" and status >= 500 and not self.lost_instance:
                # P is alive but could not send MD the KV (MD died or was cut off mid-transfer):
                # RLD takes the request from the tokens the client has (none yet, usually).
                if self._resume("relay", f"prefill for MD failed: {reason}"):
                    return []
            return self._fail(f"prefill failed: {reason}", status)
        self._mark("prefill_done")
        if self.path == "main" and self.machine.state is State.PREFILL:
            self._enter(State.TRANSFER)  # (MD's first token may have come before P's answer)
        self.meta.p_cached_tokens = event.cached_tokens
        if event.cached_tokens is not None and self.plan.hashes is not None:
            prompt = len(self.plan.hashes.tokens)
            self._count_hit("P", event.cached_tokens, prompt)
            if self.path in ("pdd", "relay") and self.meta.resumed_at is None:
                t = self.meta.timings["prefill_done"]
                self.ctx.prefill_speed.observe(prompt - event.cached_tokens, t)
        self._maybe_feed_main()
        return []

    def _maybe_feed_main(self) -> None:
        """Once P answered for RLD, P's radix cache holds the prompt, so feeding MD (a second
        request to P, room R2) costs P about one token."""
        if self.md is not MdState.PENDING or "p2" in self.tasks:
            return
        if "prefill_done" not in self.meta.timings:
            return
        if len(self.stitcher.emitted) < self.cfg.md_feed_after_tokens:
            return
        self._mark("prefill_md_sent")
        self._prefill("p2", self.room_md)

    # --- RLD ---------------------------------------------------------------------------------

    def _on_relay_chunk(self, chunk: dict[str, Any]) -> list[Output]:
        if self.relay is not RelayState.RUNNING:
            return []
        meta = chunk.get("meta_info")
        if isinstance(meta, dict) and meta.get("id", self.relay_rid) != self.relay_rid:
            return []  # left over from the RLD request before a resume
        fed = self.stitcher.feed_relay(chunk)
        if fed.kind is Kind.FAILED:
            return self._relay_dead(fed.reason, fed.status)
        if fed.kind is Kind.IGNORED or fed.chunk is None:
            return []
        self._mark("first_token")
        if self.machine.state in (State.PREFILL, State.RESUME):
            self._enter(State.RELAY)
        if not fed.final:
            self._maybe_feed_main()
            return [Output(fed.chunk)]
        # RLD finished before the handoff (or after a resume): that is the client's answer.
        self.relay = RelayState.FINISHED
        self._release("relay")
        outs: list[Output] = []
        if self.meta.resumed_at is not None:
            self.meta.relay_tokens = len(self.stitcher.emitted) - self.meta.main_tokens
            return [self._final(fed.chunk)]
        self._observe_relay_speed()
        self.meta.relay_tokens = len(self.stitcher.emitted)
        if self.path == "pdd":
            self.meta.path = LABELS["relay"]
            outs = self._md_dead("RLD finished the request first", "relay_finished")
        return outs + [self._final(fed.chunk)]

    def _relay_dead(self, reason: str, status: int = 502) -> list[Output]:
        self.relay = RelayState.DEAD
        self.meta.relay_failure = cut(reason)
        self._release("relay")
        self.ctx.metrics.inc("errors_total", kind="relay")
        if 400 <= status < 500:
            # The request itself is bad: MD would refuse it as well.
            return self._fail(reason, status)
        if self.md in (MdState.PENDING, MdState.CATCHUP):
            # MD can still take over from what the client has; it does on READY / ACK. P's call
            # for RLD is dropped (a dead RLD may never bootstrap it) and MD is fed now.
            self._abort_prefills("p")
            if "p2" not in self.tasks:
                self._mark("prefill_md_sent")
                self._prefill("p2", self.room_md)
            return []
        if self.md is not MdState.HANDED_OFF and self._resume("main", reason):
            return []
        return self._fail(reason, 502)

    def _observe_relay_speed(self) -> None:
        first = self.meta.timings.get("first_token")
        if first is None or self.path not in ("pdd", "relay"):
            return
        held = self.meta.timings.get("relay_held")
        if held is not None and self.hold is not None:  # the time held is not RLD's
            self.ctx.relay_speed.observe(self.hold.k, held - first)
        else:
            self.ctx.relay_speed.observe(len(self.stitcher.emitted), self._now() - first)

    def _stop_relay(self) -> None:
        if self.relay is not RelayState.RUNNING:
            return
        self._observe_relay_speed()
        self.relay = RelayState.STOPPED
        self._release("relay")
        self._cancel_task("relay")
        self.ctx.spawn(
            abort_request(self.ctx.session, self.relay_url, self.relay_rid, self.cfg.timeouts)
        )

    # --- MD ----------------------------------------------------------------------------------

    def _on_main_chunk(self, chunk: dict[str, Any]) -> list[Output]:
        if self.md is MdState.DEAD:
            return []
        fed = self.stitcher.feed_main(chunk)
        if fed.kind is Kind.FAILED:
            if self.md in (MdState.PENDING, MdState.CATCHUP):
                return self._md_dead(fed.reason, "main")
            return self._main_failed(fed.reason, fed.status)
        if fed.kind is Kind.IGNORED or fed.chunk is None:
            return []
        self._mark("first_token")
        self._enter(State.MAIN)
        handed_off = self.md is MdState.HANDED_OFF and "handoff_sent" in self.meta.timings
        if handed_off and fed.new_tokens and self.meta.handoff_latency_s is None:
            self._mark("first_main_token")
            t = self.meta.timings
            self.meta.handoff_latency_s = round(t["first_main_token"] - t["handoff_sent"], 6)
        self.meta.main_tokens = len(self.stitcher.emitted) - self.meta.relay_tokens
        if fed.final and self._ready_due():
            # On P -> MD, MD sends READY (what crossed the WAN) before its first token, but over
            # the control plane: on a congested link it can come after the answer's end, and
            # would be lost with the request (no WAN bytes in its meta, nothing learnt of the
            # WAN). The answer waits for it, until the READY deadline at most.
            self._mark("end")
            self.answer = fed.chunk
            return []
        return [self._final(fed.chunk)] if fed.final else [Output(fed.chunk)]

    def _ready_due(self) -> bool:
        due = self.path == "main" and self.ready is None and self.meta.resumed_at is None
        return due and time.monotonic() < self.t0 + self.cfg.timeouts.ready

    def _on_stream_end(self, event: StreamEnd) -> list[Output]:
        reason = event.error.reason if event.error else "stream ended without a finish reason"
        if self.answer is not None:  # MD's answer is complete; it awaits MD's READY
            return []
        if event.source == "relay":
            if self.relay is RelayState.RUNNING:
                return self._relay_dead(reason, event.error.status if event.error else 502)
            return []
        if self.md in (MdState.PENDING, MdState.CATCHUP):
            return self._md_dead(f"MD stream ended: {reason}", "main")
        if self.md is MdState.HANDED_OFF or (self.path == "main" and self.md is MdState.UNUSED):
            status = event.error.status if event.error else 502
            return self._main_failed(f"MD failed: {reason}", status)
        return []
