"""MD's control plane across tensor-parallel ranks.

Only TP rank 0 binds the control socket. What it receives there, and every decision that depends
on its clock (a parked request out of time, a batching window that has run out), travels to all
ranks as one `ControlBatch` inside SGLang's own broadcast of incoming requests, so every rank
acts on the same messages in the same scheduler step and the ranks' forwards never fall out of
step. At TP 1 the same path runs, minus the broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.control.channel import ControlSocket
from pdd.control.messages import Cancel, Chunk, Handoff, Message, SyncRequest

# What the leader holds back for the batching window: messages that cost an extend forward.
_EXTENDS = (Chunk, Handoff)


@dataclass
class ControlBatch:
    """One step's control input for every rank (pickled by SGLang's request broadcast)."""

    messages: list[Message] = field(default_factory=list)
    # Parked requests whose handoff did not come in time: (rid, reason).
    expired: list[tuple[str, str]] = field(default_factory=list)
    # Early CANCELs (for KV that never came) old enough to forget.
    forgotten: list[str] = field(default_factory=list)


class Gatherer:
    """TP rank 0's side: drains the socket and decides what each step's batch holds.

    CHUNK and HANDOFF messages are held until `window_s` after the first of them arrived, so
    handoffs that arrive close together share one extend forward (`--pdd-handoff-batch-ms`;
    0 sends every step's messages at once). Everything else goes at once.
    """

    def __init__(self, control: ControlSocket, window_s: float) -> None:
        self.control = control
        self.window_s = window_s
        self.held: list[Message] = []
        self.held_since = 0.0

    def gather(self, on_sync: Callable[[SyncRequest], None]) -> list[Message]:
        """This step's messages; SyncRequests go to `on_sync` (the cache reporter) at once."""
        now = time.monotonic()
        ready: list[Message] = []
        for msg in self.control.recv_nowait():
            if isinstance(msg, SyncRequest):
                on_sync(msg)
            elif isinstance(msg, _EXTENDS) and self.window_s > 0:
                if not self.held:
                    self.held_since = now
                self.held.append(msg)
            else:
                ready.append(msg)
        if self.held and (now - self.held_since >= self.window_s or _cancels(ready)):
            # A CANCEL must not overtake a held message for the same request.
            ready = [*self.held, *ready]
            self.held = []
        return ready

    def waiting(self) -> bool:
        """Messages are held for the window: the scheduler loop must come round again."""
        return bool(self.held)


def _cancels(msgs: list[Message]) -> bool:
    return any(isinstance(m, Cancel) for m in msgs)
