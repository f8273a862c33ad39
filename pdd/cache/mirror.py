"""The router's copy of what one MD's radix tree holds, kept by CacheSync messages.

Rules (see pdd.cache.reporter for the sender): a delta carries seq = last + 1; a snapshot is one
or more messages with the current seq, the first `cleared`; an empty message with the current
seq is a heartbeat. A gap, or a message from another epoch that does not start a snapshot,
makes the mirror stale: it then predicts nothing cached (the safe guess: the whole prompt
crosses the WAN) until the next snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdd.cache.blocks import PromptHashes, held_prefix, unpack
from pdd.control.messages import CacheSync


@dataclass
class CacheMirror:
    epoch: str = ""  # "" until the first snapshot
    seq: int = 0
    block: int = 0
    stale: bool = True
    hashes: set[int] = field(default_factory=set)
    synced_at: float | None = None  # last message that kept the mirror in step
    resyncs: int = 0  # gaps and restarts seen
    now: Callable[[], float] = time.monotonic

    def apply(self, msg: CacheSync) -> bool:
        """Applies `msg`; False when the mirror needs a snapshot (ask MD with a SyncRequest)."""
        same_epoch = msg.epoch == self.epoch
        if msg.cleared and (not same_epoch or msg.seq >= self.seq):
            self._reset(msg)
        elif not same_epoch or self.stale:
            return self._lost(msg.epoch != self.epoch and bool(self.epoch))
        elif msg.seq == self.seq + 1:
            self.seq = msg.seq
        elif msg.seq == self.seq:
            pass  # a heartbeat, or a later part of the current snapshot
        elif msg.seq < self.seq:
            return True  # older than what we hold: already applied
        else:
            return self._lost(False)
        self.hashes.difference_update(unpack(msg.removed))
        self.hashes.update(unpack(msg.added))
        self.synced_at = self.now()
        return True

    def _reset(self, msg: CacheSync) -> None:
        if self.epoch and msg.epoch != self.epoch:
            self.resyncs += 1  # MD restarted
        self.epoch, self.seq, self.block = msg.epoch, msg.seq, msg.block
        self.hashes.clear()
        self.stale = False

    def _lost(self, restarted: bool) -> bool:
        if not self.stale:
            self.resyncs += 1
        if restarted:
            self.hashes.clear()
        self.stale = True
        return False

    def cached_prefix(self, prompt: Sequence[int] | PromptHashes) -> int:
        """How many leading tokens MD holds, at block granularity (0 while stale)."""
        if self.stale or not self.hashes or not self.block:
            return 0
        return held_prefix(prompt, self.block, self.hashes)

    @property
    def tokens(self) -> int:
        return len(self.hashes) * self.block
