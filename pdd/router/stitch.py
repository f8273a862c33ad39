"""Stitch RLD's and MD's streams into one client stream, each token exactly once, in order.

SGLang's default streaming sends CUMULATIVE `output_ids` and `text` in every chunk. RLD's chunks
are forwarded until the handoff; the handoff snapshot is exactly what the client received. MD's
cumulative output starts with the handed-off tokens, so an MD chunk is forwarded only when it
holds more than the client has. Pure: no I/O, no clock.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Phase(Enum):
    RELAY = "relay"  # the client is fed by RLD
    MAIN = "main"  # the client is fed by MD (after the handoff, or on the P->MD path)
    DONE = "done"


class Kind(Enum):
    FORWARD = "forward"  # send `chunk` to the client
    IGNORED = "ignored"  # nothing for the client (no new tokens, a stopped source)
    FAILED = "failed"  # the source failed; `reason` says why


@dataclass(frozen=True)
class ChunkInfo:
    """What a stream chunk says: cumulative ids, finish reason, or an error."""

    ids: list[int] | None
    finish: dict[str, Any] | None
    error: str | None
    client_error: bool = False  # the server blamed the request (a 4xx), not itself

    @property
    def aborted(self) -> bool:
        return self.finish is not None and self.finish.get("type") == "abort"


def inspect_chunk(chunk: dict[str, Any]) -> ChunkInfo:
    error = chunk.get("error")
    if error is not None:
        message = error.get("message") if isinstance(error, dict) else error
        code = error.get("code") if isinstance(error, dict) else None
        client = isinstance(code, int) and 400 <= code < 500
        return ChunkInfo(None, None, str(message), client)
    ids = chunk.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        return ChunkInfo(None, None, "chunk without a list of output_ids")
    meta = chunk.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if finish is not None and not isinstance(finish, dict):
        finish = {"type": str(finish)}
    return ChunkInfo(ids, finish, None)


def abort_reason(info: ChunkInfo) -> str:
    if info.error is not None:
        return info.error
    if info.finish is not None:
        return str(info.finish.get("message") or "aborted")
    return "unknown"


@dataclass(frozen=True)
class Fed:
    kind: Kind
    chunk: dict[str, Any] | None = None  # for FORWARD: the client's chunk
    final: bool = False  # for FORWARD: the client's stream ends with it
    new_tokens: int = 0
    reason: str = ""
    status: int = 502  # for FAILED: what the client gets if nothing was sent yet


@dataclass
class Stitcher:
    rid: str
    phase: Phase = Phase.RELAY
    emitted: list[int] = field(default_factory=list)
    text: str = ""
    last_meta: dict[str, Any] = field(default_factory=dict)
    # After a resume: the new request's output continues these (what the client had then).
    base_ids: list[int] = field(default_factory=list)
    base_text: str = ""

    def feed_relay(self, chunk: dict[str, Any]) -> Fed:
        if self.phase is not Phase.RELAY:
            return Fed(Kind.IGNORED)  # RLD's tokens after the handoff snapshot are discarded
        return self._feed(chunk, "relay")

    def feed_main(self, chunk: dict[str, Any]) -> Fed:
        if self.phase is Phase.RELAY:
            # Before the handoff MD has nothing for the client. It ending means it failed.
            info = inspect_chunk(chunk)
            if info.error is not None or info.finish is not None:
                return Fed(Kind.FAILED, reason=f"MD ended before the handoff: {_why(info)}")
            return Fed(Kind.IGNORED)
        if self.phase is Phase.DONE:
            return Fed(Kind.IGNORED)
        return self._feed(chunk, "main")

    def handoff(self) -> tuple[int, ...]:
        """Switch to MD; the snapshot of what the client got, which MD's output must extend."""
        if self.phase is not Phase.RELAY:
            raise RuntimeError(f"handoff in phase {self.phase.value}")
        self.phase = Phase.MAIN
        return tuple(self.emitted)

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.emitted)

    def resume(self, to: Phase) -> None:
        """The source feeding the client failed: a new request on `to`'s side, whose output
        follows what the client has, feeds it from now on."""
        if self.phase is Phase.DONE or to is Phase.DONE:
            raise RuntimeError(f"resume in phase {self.phase.value}")
        self.phase = to
        self.base_ids, self.base_text = list(self.emitted), self.text

    def _feed(self, chunk: dict[str, Any], source: str) -> Fed:
        info = inspect_chunk(chunk)
        if info.error is not None or info.aborted or info.ids is None:
            status = 400 if info.client_error else 502
            return Fed(Kind.FAILED, reason=f"{source} failed: {abort_reason(info)}", status=status)
        ids, n = info.ids, len(self.emitted)
        if self.base_ids:  # after a resume only the new request's source is fed
            ids = self.base_ids + ids
            text = chunk.get("text")
            if isinstance(text, str):
                chunk = {**chunk, "text": self.base_text + text}
        if ids[: min(n, len(ids))] != self.emitted[: len(ids)]:
            return Fed(Kind.FAILED, reason=f"{source} output does not extend the client's tokens")
        new = ids[n:]
        if not new and info.finish is None:
            return Fed(Kind.IGNORED)
        if len(ids) >= n:
            self.emitted = list(ids)
            if isinstance(chunk.get("text"), str):
                self.text = chunk["text"]
        # else: a finish before the source caught up with the client; the client's stream ends
        # with what it already has.
        meta = chunk.get("meta_info")
        self.last_meta = dict(meta) if isinstance(meta, dict) else {}
        final = info.finish is not None
        if final:
            self.phase = Phase.DONE
        return Fed(Kind.FORWARD, self._client_chunk(chunk), final, len(new))

    def _client_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        out = copy.copy(chunk)
        out["output_ids"] = list(self.emitted)
        out["text"] = self.text
        meta = dict(chunk.get("meta_info") or {})
        meta["id"] = self.rid
        out["meta_info"] = meta
        return out

    def failure_chunk(self, reason: str) -> dict[str, Any]:
        """The client's last chunk when the request fails after output began: what it has, with
        an abort finish reason (SGLang's own shape for an aborted stream)."""
        self.phase = Phase.DONE
        meta = dict(self.last_meta)
        meta.update(
            id=self.rid,
            finish_reason={"type": "abort", "message": reason},
            completion_tokens=len(self.emitted),
        )
        return {"text": self.text, "output_ids": list(self.emitted), "meta_info": meta}


def _why(info: ChunkInfo) -> str:
    if info.error is not None or info.aborted:
        return abort_reason(info)
    return f"finished ({(info.finish or {}).get('type')}) without parking"
