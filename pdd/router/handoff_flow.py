"""The handoff to MD: READY, Extend-Decode or Catch-Up (chunks and their ACKs), and MD
dropping out before it (RLD then finishes, and MD may keep the prompt's KV)."""

from __future__ import annotations

import asyncio
import logging
import time

from pdd.control.channel import Received
from pdd.control.messages import Ack, Cancel, Chunk, Error, Handoff, Ready
from pdd.policy.handoff import choose_mode, handoff_tokens, next_step, relay_finishes
from pdd.router.estimates import direct_wan_seconds, relayed_direct_ttft
from pdd.router.planner import max_new_tokens
from pdd.router.request_base import RequestBase
from pdd.router.request_machine import State
from pdd.router.request_types import MdState, Output, RelayState, cut

logger = logging.getLogger(__name__)


class HandoffFlow(RequestBase):
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
        self._observe_relayed_first_token()
        if self.answer is not None:  # P -> MD: MD's answer waited for this READY
            return [self._final(self.answer)]
        if self.md is not MdState.PENDING:
            return []
        if self.hold is not None and not self.hold.engaged and self.relay is RelayState.RUNNING:
            return []  # the client has fewer than the hold's tokens: _take_over comes later
        return self._take_over()

    def _take_over(self) -> list[Output]:
        """MD is ready: RLD finishes what little is left, or MD takes over from what the client
        has (in one extend, or in Catch-Up chunks while RLD decodes on)."""
        pending = len(self.stitcher.emitted)
        left = max_new_tokens(self.body) - pending
        if self.relay is RelayState.RUNNING and relay_finishes(self.cfg.handoff, left=left):
            return self._md_dead(f"RLD finishes the last {left} tokens itself", "relay_finished")
        self._enter(State.READY)
        if self.relay is RelayState.RUNNING:
            relay_load = self.ctx.loads["relay"].value(self.held["relay"])
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
        wan = self.ctx.wan[self.held["main"]]
        if not wan.observe(msg.wan_kv_bytes, tokens, seconds, time.monotonic()):
            logger.info("request %s: WAN sample %.2fs for %d bytes left out as an outlier",
                        self.rid, seconds, msg.wan_kv_bytes)  # fmt: skip

    def _observe_relayed_first_token(self) -> None:
        """On P -> RLD -> MD, READY tells what P -> MD's first token would have taken: it teaches
        the direct path's residual as a P -> MD first token does (`_observe_latency`)."""
        base = self.plan.direct_ttft_s
        if self.path != "pdd" or base is None or self.meta.resumed_at is not None:
            return
        direct = relayed_direct_ttft(self.meta.timings)
        if direct is not None:
            residual = self.ctx.first_token_residual[self.held["main"]]
            residual.observe(direct - base, time.monotonic())

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
        self._enter(State.HANDOFF)
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
        self.meta.md_failure = cut(reason)
        self.ctx.metrics.inc("md_cancels_total", reason=kind)
        if kind == "relay_finished" and "prefill_md_sent" in self.meta.timings:
            self._let_md_keep_prompt(reason)
        else:
            self._cancel_md(reason)
        if self.relay in (RelayState.RUNNING, RelayState.FINISHED):
            if self.machine.state is State.READY:
                self._enter(State.RELAY)  # Catch-Up ends; RLD goes on feeding the client
            return []
        return self._fail(f"RLD failed ({self.meta.relay_failure}) and {reason}", 502)

    def _let_md_keep_prompt(self, reason: str) -> None:
        """RLD answered alone, but P is already sending MD the prompt's KV: MD caches it when it
        lands (CANCEL before READY is remembered) instead of the transfer being aborted, so MD's
        tree gets every prompt P's tree gets and the next turn hits on both sides. The P and MD
        calls run on by themselves, until the ready deadline at most: a transfer that a fault
        broke on one side only (MD gave up, P still waits to be bootstrapped) is aborted on both
        so neither holds KV until SGLang's own 300 s timeouts."""
        n = self.ctx.send(self.main_addr, Cancel(self.rid, cut(reason)))
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
        n = self.ctx.send(self.main_addr, Cancel(self.rid, cut(reason)))
        self.meta.control_bytes += n
        self._release("main")
        self._stop_main()
        self._abort_prefills("p2")
