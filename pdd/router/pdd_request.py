"""One request through P->RLD->MD (or P->RLD, or P->MD): fan-out, handoff, stitching, cleanup.

All decisions happen in one task that consumes one event queue (stream chunks, P answers,
control messages, deadlines), so the handoff snapshot is always exactly what the client got.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from pdd.control.channel import Received
from pdd.control.messages import Ack, Cancel, Chunk, Error, Handoff, Ready, route_hint
from pdd.policy.handoff import Step, choose_mode, handoff_tokens, next_step, relay_finishes
from pdd.policy.path import LABELS
from pdd.router.context import NoInstance, RouterContext
from pdd.router.estimates import direct_wan_seconds
from pdd.router.planner import Plan, max_new_tokens
from pdd.router.resume import resume_body
from pdd.router.stitch import Kind, Phase, Stitcher
from pdd.router.upstream import UpstreamError, abort_request, post_generate, stream_generate

logger = logging.getLogger(__name__)

ROOM_LIMIT = 2**62  # rooms travel as int64; stay well inside it
DISCONNECT_POLL_S = 1.0
MAX_REASON = 1000
TIER_NAMES = {"relay": "RLD", "main": "MD"}


class MdState(Enum):
    UNUSED = "unused"  # the path does not hand off to MD
    PENDING = "pending"  # waiting for READY
    CATCHUP = "catchup"  # a Catch-Up chunk is in flight
    HANDED_OFF = "handed_off"
    DEAD = "dead"  # failed, timed out or cancelled; RLD serves the request


class RelayState(Enum):
    UNUSED = "unused"
    RUNNING = "running"
    STOPPED = "stopped"  # we stopped it at the handoff
    FINISHED = "finished"  # it finished the request
    DEAD = "dead"


@dataclass(frozen=True)
class StreamChunk:
    source: str  # "relay" | "main"
    chunk: dict[str, Any]


@dataclass(frozen=True)
class StreamEnd:
    source: str
    error: UpstreamError | None


@dataclass(frozen=True)
class PrefillDone:
    which: str  # "p" (room R, or the only one on P->MD) | "p2" (room R2, for MD)
    error: UpstreamError | None
    cached_tokens: int | None = None  # P's radix-cache hit, as P reports it


@dataclass(frozen=True)
class Output:
    chunk: dict[str, Any]
    final: bool = False
    failed: bool = False  # the final chunk reports a failure after output had begun


@dataclass
class PddMeta:
    """`meta_info["pdd"]` of the client's final chunk."""

    path: str
    path_reason: str
    rid: str
    relay_tokens: int = 0
    main_tokens: int = 0
    handoff_mode: str | None = None
    chunks: int = 0
    handoff_latency_s: float | None = None
    wan_kv_bytes: int | None = None
    md_cached_tokens: int | None = None
    # What the router's mirror of MD's cache predicted before sending (block granularity).
    md_predicted_cached_tokens: int | None = None
    md_prompt_tokens: int | None = None
    p_cached_tokens: int | None = None
    control_bytes: int = 0
    md_failure: str | None = None
    relay_failure: str | None = None
    # The side feeding the client failed and the other finished the request ("RLD" or "MD"):
    # the tokens the client had then.
    resumed_at: int | None = None
    resumed_on: str | None = None
    instances: dict[str, str] = field(default_factory=dict)
    # Seconds since the router received the request.
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cut(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."


async def _pace(chunk: dict[str, Any], start: float, pace_s: float) -> None:
    """Hold a relay chunk until its tokens could have come from an RLD making one per pace_s."""
    meta = chunk.get("meta_info")
    tokens = meta.get("completion_tokens") if isinstance(meta, dict) else None
    if isinstance(tokens, int) and tokens > 0:
        await asyncio.sleep(max(0.0, start + tokens * pace_s - time.monotonic()))


class PddRequest:
    def __init__(
        self,
        ctx: RouterContext,
        body: dict[str, Any],
        plan: Plan,
        disconnected: Callable[[], bool] = lambda: False,
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

    # --- set-up ------------------------------------------------------------------------------

    def _upstream_failed(self, tier: str, err: UpstreamError) -> None:
        """An instance that went away is marked down now, not at the next health check, and the
        request may run again elsewhere if the client got nothing yet; a call that timed out is
        counted by tier."""
        if err.lost and tier in self.held:
            self.lost_instance = True
            self.ctx.health.mark_down(tier, self.held[tier], err.reason)
        if err.status == 504:
            self.ctx.metrics.inc("timeouts_total", wait=tier)

    def _acquire(self, tier: str, i: int | None) -> int:
        assert i is not None, f"the plan has no {tier} instance"
        self.ctx.hold(tier, i)
        self.held[tier] = i
        return i

    def _count_hit(self, side: str, cached: int, prompt: int) -> None:
        self.ctx.metrics.inc("prefix_cached_tokens_total", cached, side=side)
        self.ctx.metrics.inc("prefix_prompt_tokens_total", prompt, side=side)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _mark(self, name: str) -> None:
        self.meta.timings.setdefault(name, round(self._now(), 6))

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
            main_body = self._body(rid=self.rid, room=self.room_md, stream=True, hints=hints)
            self._stream("main", self.main_url, main_body, "MD")
        if self.path == "main":
            self._mark("prefill_main_sent")
            self._prefill("p", self.room_md)

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
        async def run() -> None:
            try:
                gen = stream_generate(self.ctx.session, url, body, self.cfg.timeouts, role)
                start = time.monotonic()
                async for chunk in gen:
                    if source == "relay" and self.cfg.relay_pace_s > 0:
                        await _pace(chunk, start, self.cfg.relay_pace_s)
                    self.events.put_nowait(StreamChunk(source, chunk))
                self.events.put_nowait(StreamEnd(source, None))
            except UpstreamError as err:
                self._upstream_failed(source, err)
                self.events.put_nowait(StreamEnd(source, err))
            except Exception as err:
                logger.exception("request %s: %s stream failed", self.rid, role)
                self.events.put_nowait(StreamEnd(source, UpstreamError(502, repr(err))))

        self.tasks[source] = self.ctx.spawn(run())

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
            for out in outs:
                self.sent_outputs += 1
                yield out
                if out.final:
                    return

    def _next_deadline(self) -> float:
        deadlines = [self.t0 + self.cfg.timeouts.request]
        if self.md is MdState.PENDING:
            deadlines.append(self.t0 + self.cfg.timeouts.ready)
        if self.md is MdState.CATCHUP and self.ack_deadline is not None:
            deadlines.append(self.ack_deadline)
        return min(deadlines)

    def _handle(self, event: Any) -> list[Output]:
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

    def _on_tick(self) -> list[Output]:
        now = time.monotonic()
        timeouts, metrics = self.cfg.timeouts, self.ctx.metrics
        if now >= self.t0 + timeouts.request:
            metrics.inc("timeouts_total", wait="request")
            return self._fail(f"request timed out after {timeouts.request:.0f}s", 504)
        if self.md is MdState.PENDING and now >= self.t0 + timeouts.ready:
            metrics.inc("timeouts_total", wait="ready")
            return self._md_dead(f"MD not ready within {timeouts.ready:g}s", "timeout")
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
            return self._fail(f"prefill failed: {reason}", status)
        self._mark("prefill_done")
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
        self.meta.relay_failure = _cut(reason)
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
        if first is not None and self.path in ("pdd", "relay"):
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
        handed_off = self.md is MdState.HANDED_OFF and "handoff_sent" in self.meta.timings
        if handed_off and fed.new_tokens and self.meta.handoff_latency_s is None:
            self._mark("first_main_token")
            t = self.meta.timings
            self.meta.handoff_latency_s = round(t["first_main_token"] - t["handoff_sent"], 6)
        self.meta.main_tokens = len(self.stitcher.emitted) - self.meta.relay_tokens
        return [self._final(fed.chunk)] if fed.final else [Output(fed.chunk)]

    def _on_stream_end(self, event: StreamEnd) -> list[Output]:
        reason = event.error.reason if event.error else "stream ended without a finish reason"
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

    def _on_control(self, received: Received) -> list[Output]:
        msg = received.msg
        self.meta.control_bytes += received.nbytes
        if isinstance(msg, Ready):
            return self._on_ready(msg)
        if isinstance(msg, Ack):
            return self._on_ack(msg)
        if isinstance(msg, Error):
            if self.md in (MdState.PENDING, MdState.CATCHUP):
                return self._md_dead(f"MD error: {msg.reason}", "main_error")
            if self.md is MdState.HANDED_OFF:
                return self._main_failed(f"MD error after the handoff: {msg.reason}", 502)
            return []
        logger.warning("request %s: unexpected control message %s from MD", self.rid, msg)
        return []

    def _on_ready(self, msg: Ready) -> list[Output]:
        if self.ready is not None:
            return []
        self.ready = msg
        self._mark("ready")
        self.meta.wan_kv_bytes = msg.wan_kv_bytes
        self.meta.md_cached_tokens = msg.cached_len
        self.meta.md_prompt_tokens = msg.prompt_len
        self._count_hit("MD", msg.cached_len, msg.prompt_len)
        self._observe_wan(msg)
        if self.md is not MdState.PENDING:
            return []
        pending = len(self.stitcher.emitted)
        left = max_new_tokens(self.body) - pending
        if self.relay is RelayState.RUNNING and relay_finishes(self.cfg.handoff, left=left):
            return self._md_dead(f"RLD finishes the last {left} tokens itself", "relay_finished")
        if self.relay is RelayState.RUNNING:
            relay_load = self.ctx.loads["relay"].active[self.held["relay"]]
            mode = choose_mode(self.cfg.handoff, pending=pending, relay_load=relay_load)
        else:
            mode = "extend"  # RLD is gone: nothing keeps decoding while chunks go over
        self.meta.handoff_mode = mode
        if mode == "extend":
            return self._handoff()
        self.md = MdState.CATCHUP
        return self._catchup_step()

    def _observe_wan(self, msg: Ready) -> None:
        """Feeding MD -> its KV landed: what the WAN took. On P -> RLD -> MD, P holds the prompt
        by then (feeding MD costs it about a token); on P -> MD, P computes it first."""
        t, tokens = self.meta.timings, msg.prompt_len - msg.cached_len
        seconds = 0.0  # without a time, only the KV bytes per token are learnt
        if "prefill_md_sent" in t:
            seconds = t["ready"] - t["prefill_md_sent"]
        elif "prefill_main_sent" in t:
            compute = self.ctx.prefill_speed.prefill_s(tokens)
            seconds = direct_wan_seconds(t["ready"] - t["prefill_main_sent"], compute)
        self.ctx.wan[self.held["main"]].observe(msg.wan_kv_bytes, tokens, seconds)

    def _on_ack(self, msg: Ack) -> list[Output]:
        if self.md is not MdState.CATCHUP or self.inflight is None:
            return []
        if msg.done != self.inflight.end:
            return self._md_dead(f"ACK done={msg.done}, expected {self.inflight.end}", "protocol")
        self.done = msg.done
        self.inflight = None
        self.ack_deadline = None
        return self._catchup_step()

    def _catchup_step(self) -> list[Output]:
        step = next_step(
            self.cfg.handoff,
            done=self.done,
            available=len(self.stitcher.emitted),
            chunks_sent=self.meta.chunks,
        )
        if step.final or self.relay is not RelayState.RUNNING:
            return self._handoff()
        tokens = tuple(self.stitcher.emitted[step.start : step.end])
        n = self.ctx.send(self.main_addr, Chunk(self.rid, step.start, tokens))
        if n == 0:
            return self._md_dead("could not send a Catch-Up chunk to MD", "control")
        self.meta.control_bytes += n
        self.meta.chunks += 1
        self.ctx.metrics.inc("catchup_chunks_total")
        self.inflight = step
        self.ack_deadline = time.monotonic() + self.cfg.timeouts.ack
        return []

    def _handoff(self) -> list[Output]:
        assert self.ready is not None
        snapshot = self.stitcher.snapshot()
        tokens = handoff_tokens(snapshot, self.done, self.ready.first_token)
        n = self.ctx.send(self.main_addr, Handoff(self.rid, self.done, tokens))
        if n == 0:
            return self._md_dead("could not send the handoff to MD", "control")
        self.meta.control_bytes += n
        self.stitcher.handoff()
        self.md = MdState.HANDED_OFF
        self.meta.relay_tokens = len(snapshot)
        self._mark("handoff_sent")
        self.ctx.metrics.inc("handoffs_total", mode=self.meta.handoff_mode or "extend")
        self._stop_relay()
        return []

    def _md_dead(self, reason: str, kind: str) -> list[Output]:
        """MD drops out before the handoff; RLD (if alive) finishes the request."""
        if self.md not in (MdState.PENDING, MdState.CATCHUP):
            return []
        self.md = MdState.DEAD
        self.meta.md_failure = _cut(reason)
        self.ctx.metrics.inc("md_cancels_total", reason=kind)
        if kind == "relay_finished" and "prefill_md_sent" in self.meta.timings:
            self._let_md_keep_prompt(reason)
        else:
            self._cancel_md(reason)
        if self.relay in (RelayState.RUNNING, RelayState.FINISHED):
            return []
        return self._fail(f"RLD failed ({self.meta.relay_failure}) and {reason}", 502)

    def _let_md_keep_prompt(self, reason: str) -> None:
        """RLD answered alone, but P is already sending MD the prompt's KV: MD caches it when it
        lands (CANCEL before READY is remembered) instead of the transfer being aborted, so MD's
        tree gets every prompt P's tree gets and the next turn hits on both sides. The P and MD
        calls run on by themselves, until the ready deadline at most: a transfer that a fault
        broke on one side only (MD gave up, P still waits to be bootstrapped) is aborted on both
        so neither holds KV until SGLang's own 300 s timeouts."""
        n = self.ctx.send(self.main_addr, Cancel(self.rid, _cut(reason)))
        self.meta.control_bytes += n
        self._release("main")
        left = self.t0 + self.cfg.timeouts.ready - time.monotonic()
        self.ctx.spawn(self._end_kept_transfer(max(left, 1.0)))

    async def _end_kept_transfer(self, within_s: float) -> None:
        calls = [t for n in ("main", "p2") if (t := self.tasks.get(n)) is not None]
        if not calls:
            return
        _, pending = await asyncio.wait(calls, timeout=within_s)
        if not pending:
            return
        logger.warning("request %s: the kept prompt transfer to MD did not end in time", self.rid)
        self.ctx.metrics.inc("timeouts_total", wait="kept_transfer")
        self._stop_main()
        self._abort_prefills("p2")

    def _cancel_md(self, reason: str) -> None:
        n = self.ctx.send(self.main_addr, Cancel(self.rid, _cut(reason)))
        self.meta.control_bytes += n
        self._release("main")
        self._stop_main()
        self._abort_prefills("p2")

    # --- resume -----------------------------------------------------------------------------

    def _main_failed(self, reason: str, status: int) -> list[Output]:
        """MD failed while it fed the client (after the handoff, or on P->MD): RLD finishes the
        request if it can, else the client gets the reason."""
        self.ctx.metrics.inc("errors_total", kind="main")
        if 400 <= status < 500 or not self._resume("relay", reason):
            return self._fail(reason, status)
        return []

    def _resume(self, tier: str, reason: str) -> bool:
        """The tier that fed the client failed: P prefills the prompt and the client's tokens
        again and `tier` ("relay" or "main") decodes the rest (see pdd.router.resume). Once per
        request; False when it cannot be done."""
        if self.meta.resumed_at is not None:
            return False
        body = resume_body(self.body, self.stitcher.emitted)
        if body is None:
            return False
        try:
            i = self.ctx.pick(tier)
        except NoInstance:
            return False
        n = self.meta.resumed_at = len(self.stitcher.emitted)
        self.meta.resumed_on = TIER_NAMES[tier]
        logger.warning("request %s: resumed on %s after %d tokens: %s", self.rid,
                       self.meta.resumed_on, n, _cut(reason))  # fmt: skip
        self.ctx.metrics.inc("resumes_total", on=tier)
        if tier == "relay":
            self.meta.md_failure = _cut(reason)
            self.md = MdState.DEAD
            self._release("main")
            self._stop_main()
        else:
            self.meta.relay_tokens = n - self.meta.main_tokens
        # P's calls for the failed side (a dead MD may never bootstrap its transfer).
        self._abort_prefills("p", "p2")
        self.stitcher.resume(Phase.RELAY if tier == "relay" else Phase.MAIN)
        self.released.discard(tier)
        self._acquire(tier, i)
        room = random.randrange(ROOM_LIMIT)
        self._prefill("p3", room, body)
        if tier == "relay":
            self.meta.instances["relay"] = self.relay_url
            self.relay = RelayState.RUNNING
            self.relay_rid = f"{self.rid}-r2"
            relay_body = self._body(rid=self.relay_rid, room=room, stream=True, base=body)
            self._stream("relay", self.relay_url, relay_body, "RLD")
        else:
            self.meta.instances["main"] = self.main_url
            self.md = MdState.HANDED_OFF  # MD feeds the client from here
            self.main_rid = f"{self.rid}-m2"
            hints = route_hint(role="main", park=False, reply_to=self.ctx.reply_to)
            main_body = self._body(rid=self.main_rid, room=room, stream=True, hints=hints,
                                   base=body)  # fmt: skip
            self._stream("main", self.main_url, main_body, "MD")
        return True

    # --- endings -----------------------------------------------------------------------------

    def _final(self, chunk: dict[str, Any]) -> Output:
        self.succeeded = True
        self._mark("end")
        return Output(self._with_meta(chunk), final=True)

    def _with_meta(self, chunk: dict[str, Any]) -> dict[str, Any]:
        meta = dict(chunk.get("meta_info") or {})
        meta["pdd"] = self.meta.to_dict()
        return {**chunk, "meta_info": meta}

    def _fail(self, reason: str, status: int) -> list[Output]:
        reason = _cut(reason)
        self._mark("end")
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
