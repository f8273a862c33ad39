"""A test control (the router honours it only with --test-controls): a request's
`pdd_hold_relay: k` fixes the point of its P->RLD->MD handoff at k tokens.

Without it the handoff point is a race between RLD's decoding and the KV crossing the WAN, and a
test that needs MD to take part cannot depend on who wins. With it, the client gets RLD's first k
tokens; everything RLD produces after them (its later chunks, its end) is held while MD has not
taken over, and a READY that comes before the client has k tokens waits for them. So MD takes
over from exactly k tokens (Catch-Up's chunks and its final HANDOFF cover those k). If MD drops
out instead (no READY within the router's READY timeout, an error), the held events are handled
in order and RLD finishes the request as it would have without the hold. (With
--md-feed-after-tokens above k, MD is not fed while the hold lasts: the READY deadline ends it.)
Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdd.router.request_types import StreamChunk, StreamEnd


def first_tokens(chunk: dict[str, Any], k: int, text: str) -> dict[str, Any]:
    """RLD's cumulative `chunk` (more than k tokens, or k and a finish) cut to its first k tokens,
    unfinished. A chunk of more than k tokens gets `text`, the client's text so far: the router
    has no tokenizer to cut text, and MD's cumulative text after the handoff replaces it."""
    ids = chunk["output_ids"]
    meta = {**(chunk.get("meta_info") or {}), "finish_reason": None, "completion_tokens": k}
    cut = {**chunk, "output_ids": ids[:k], "meta_info": meta}
    if len(ids) > k:
        cut["text"] = text
    return cut


@dataclass
class RelayHold:
    k: int
    engaged: bool = False  # the client has RLD's first k tokens: the rest is held
    held: list[StreamChunk | StreamEnd] = field(default_factory=list)

    def admit(self, event: StreamChunk | StreamEnd, text: str) -> StreamChunk | StreamEnd | None:
        """What of RLD's `event` the request handles now; None when all of it is held. `text`
        is the client's text so far."""
        if self.engaged:
            self.held.append(event)
            return None
        if isinstance(event, StreamEnd):
            return event
        ids = event.chunk.get("output_ids")
        if not isinstance(ids, list) or len(ids) < self.k:
            return event  # a failure or fewer than k tokens: as without the hold
        self.engaged = True
        meta = event.chunk.get("meta_info")
        if len(ids) == self.k and not (isinstance(meta, dict) and meta.get("finish_reason")):
            return event
        # SGLang merges tokens into one chunk when its reader lags: the client gets the first
        # k now, and the whole chunk (extending them) if RLD is to finish after all.
        self.held.append(event)
        return StreamChunk(event.source, first_tokens(event.chunk, self.k, text), event.rid)

    def release(self) -> list[StreamChunk | StreamEnd]:
        """The held events, in order: MD took over or dropped out, and the request handles them
        as it would have without the hold (it admits nothing more)."""
        events, self.held = self.held, []
        return events
