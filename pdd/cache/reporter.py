"""MD's side of cache sync: which blocks its radix tree holds, told to every subscribed router.

The tree reports each node stored or removed with the node's full token path; the reporter
turns that into block hashes, batches the changes and sends them as CacheSync deltas (at most
one batch per `flush_s`, never per token). A router subscribes (and re-subscribes, as a
heartbeat) with SyncRequest; it gets a snapshot when its view is of another epoch or behind.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from pdd.cache.blocks import block_hashes, pack
from pdd.control.messages import MAX_SYNC_HASHES, CacheSync, SyncRequest

logger = logging.getLogger(__name__)
Send = Callable[[str, CacheSync], int]  # bytes queued, 0 when dropped
MAX_SUBSCRIBERS = 32  # routers told at once; more (or a flood of fake ones) evict the oldest


@dataclass
class ReporterStats:
    deltas: int = 0
    snapshots: int = 0
    heartbeats: int = 0


class CacheReporter:
    def __init__(
        self,
        block: int,
        send: Send,
        *,
        flush_s: float = 0.02,
        subscriber_ttl_s: float = 120.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block = block
        self.send = send
        self.flush_s = flush_s
        self.subscriber_ttl_s = subscriber_ttl_s
        self.now = now
        self.epoch = uuid.uuid4().hex[:16]  # a restarted MD is a new epoch
        self.seq = 0  # the last delta sent
        self.held: set[int] = set()
        self.pending: dict[int, bool] = {}  # hash -> held after the change
        self.pending_clear = False
        self.subscribers: dict[str, tuple[str, float]] = {}  # reply_to -> (name, last ask)
        self.flushed_at = now()
        self.stats = ReporterStats()

    # -- what the tree reports --------------------------------------------------------------

    def stored(self, path: Sequence[int], start: int, namespace: str | None = None) -> None:
        """Tokens path[start:] are now held (path[:start] already was)."""
        self._change(path, start, namespace, held=True)

    def removed(self, path: Sequence[int], start: int, namespace: str | None = None) -> None:
        """Tokens path[start:] are gone: every block ending inside them is no longer held."""
        self._change(path, start, namespace, held=False)

    def _change(self, path: Sequence[int], start: int, namespace: str | None, held: bool) -> None:
        # The blocks that end inside path[start:]: those the node's tokens complete.
        for h in block_hashes(path, self.block, start_block=start // self.block,
                              namespace=namespace):  # fmt: skip
            if held:
                self.held.add(h)
            else:
                self.held.discard(h)
            self.pending[h] = held

    def cleared(self) -> None:
        self.held.clear()
        self.pending.clear()
        self.pending_clear = True

    # -- what the routers get ---------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return bool(self.pending) or self.pending_clear

    def flush(self, force: bool = False) -> None:
        """Sends the pending changes to every live subscriber, at most once per flush_s."""
        now = self.now()
        if not self.dirty or (not force and now - self.flushed_at < self.flush_s):
            return
        self.flushed_at = now
        expired = [a for a, (_, t) in self.subscribers.items() if now - t > self.subscriber_ttl_s]
        for addr in expired:
            del self.subscribers[addr]
            logger.info("PDD cache sync: router %s stopped asking; no longer told", addr)
        added = [h for h, on in self.pending.items() if on]
        removed = [h for h, on in self.pending.items() if not on]
        clear = self.pending_clear
        self.pending.clear()
        self.pending_clear = False
        for msg in self._deltas(clear, added, removed):
            self.stats.deltas += 1
            for addr, (name, _) in list(self.subscribers.items()):
                if not self.send(addr, replace(msg, name=name)):
                    # Dropped (router gone or not reading): it resubscribes with a stale seq
                    # and gets a snapshot, instead of being fed into a full queue meanwhile.
                    del self.subscribers[addr]
                    logger.info("PDD cache sync: router %s not reachable; unsubscribed", addr)

    def _deltas(self, clear: bool, added: list[int], removed: list[int]) -> Iterator[CacheSync]:
        """One message per MAX_SYNC_HASHES hashes of each kind, each its own seq."""
        first = True
        while first or added or removed:
            a, added = added[:MAX_SYNC_HASHES], added[MAX_SYNC_HASHES:]
            r, removed = removed[:MAX_SYNC_HASHES], removed[MAX_SYNC_HASHES:]
            self.seq += 1
            yield CacheSync("", self.epoch, self.seq, self.block, clear and first, pack(a), pack(r))
            first = False

    def on_sync_request(self, msg: SyncRequest) -> None:
        """(Re)subscribes msg.reply_to; a snapshot if its view is stale, else a heartbeat."""
        # Pending deltas go out first (a new subscriber's snapshot already includes them).
        self.flush(force=True)
        self.subscribers.pop(msg.reply_to, None)  # dicts keep order: most recent last
        self.subscribers[msg.reply_to] = (msg.name, self.now())
        while len(self.subscribers) > MAX_SUBSCRIBERS:
            del self.subscribers[next(iter(self.subscribers))]
        if msg.epoch == self.epoch and msg.seq == self.seq:
            self.stats.heartbeats += 1
            beat = CacheSync(msg.name, self.epoch, self.seq, self.block, False, b"", b"")
            self.send(msg.reply_to, beat)
            return
        self.stats.snapshots += 1
        for part in self.snapshot(msg.name):
            self.send(msg.reply_to, part)

    def snapshot(self, name: str) -> Iterator[CacheSync]:
        """Every held block as of `seq`: parts with the same seq, the first one `cleared`."""
        held = list(self.held)
        first = True
        while first or held:
            part, held = held[:MAX_SYNC_HASHES], held[MAX_SYNC_HASHES:]
            yield CacheSync(name, self.epoch, self.seq, self.block, first, pack(part), b"")
            first = False
