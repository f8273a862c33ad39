"""Resume: the side feeding the client failed and the other finishes the request (the body
it gets: pdd.router.resume)."""

from __future__ import annotations

import logging
import random

from pdd.control.messages import route_hint
from pdd.router.context import NoInstance
from pdd.router.request_base import RequestBase
from pdd.router.request_machine import State
from pdd.router.request_types import ROOM_LIMIT, TIER_NAMES, MdState, Output, RelayState, cut
from pdd.router.resume import resume_body
from pdd.router.stitch import Phase

logger = logging.getLogger(__name__)


class ResumeFlow(RequestBase):
    def _main_failed(self, reason: str, status: int) -> list[Output]:
        """MD failed while it fed the client (after the handoff, or on P->MD): RLD finishes the
        request if it can, else the client gets the reason."""
        self.ctx.metrics.inc("errors_total", kind="main")
        if self.lost_instance and self.sent_outputs == 0 and self.may_retry and self._md_left():
            # A dead MD before the client got anything: planned again, another MD decodes it
            # (RLD, a small tier, would decode the whole answer).
            return self._fail(reason, status)
        if 400 <= status < 500 or not self._resume("relay", reason):
            return self._fail(reason, status)
        return []

    def _md_left(self) -> bool:
        return any(load is not None for load in self.ctx.live_loads("main"))

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
                       self.meta.resumed_on, n, cut(reason))  # fmt: skip
        self.ctx.metrics.inc("resumes_total", on=tier)
        self._enter(State.RESUME)
        if tier == "relay":
            self.meta.md_failure = cut(reason)
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
            main_body = self._main_body(rid=self.main_rid, room=room, hints=hints, base=body)
            self._stream("main", self.main_url, main_body, "MD")
        return True
