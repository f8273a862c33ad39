"""The router's view of every MD's radix cache: one CacheMirror per MD, kept by cache sync.

The router asks each MD (SyncRequest) at start-up and every `interval_s`: MD answers with a
snapshot if the router's view is stale, else a heartbeat, and sends deltas as its tree changes.
A mirror that heard nothing for three intervals predicts no hit (MD may be gone or cut off).
An MD silent that long is reported once, with the likely causes: the cache sync is the only
control traffic that flows without requests, so it is where a control plane that cannot get
through (a secret or an encryption switch set differently on the two sides: ZMQ drops what
fails its handshake without a word) shows first. Each MD's answers are also its heartbeat for the
router's health checks (`on_heard`): they cross the WAN against the KV, so a link full of KV
delays a /ping to MD but not MD's next CacheSync; `sync_reply_p99_s` in /status is how long MD
took to answer an ask lately (the control plane's round trip on a busy link).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pdd.cache.blocks import PromptHashes
from pdd.cache.mirror import CacheMirror
from pdd.control.messages import CacheSync, Message, SyncRequest

logger = logging.getLogger(__name__)
NO_EPOCH = "none"  # what the router says before its first snapshot
SILENT_INTERVALS = 3
REPLIES_KEPT = 64  # sync round trips kept per MD for its P99
SILENCE_CAUSES = (
    "MD down, its control port unreachable, or the control plane set differently on the two "
    "sides: the secret (--secret-file / --pdd-secret-file) or the encryption (--control-encrypt "
    "/ --pdd-control-encrypt, both or neither)"
)


class MdCaches:
    def __init__(
        self,
        names: Sequence[str],
        send: Callable[[str, Message], int],
        reply_to: str,
        interval_s: float,
        now: Callable[[], float] = time.monotonic,
        on_heard: Callable[[int], None] | None = None,
    ) -> None:
        self.names = list(names)  # each MD's control address
        self.send = send
        self.reply_to = reply_to
        self.interval_s = interval_s
        self.now = now
        self.mirrors = {name: CacheMirror(now=now) for name in self.names}
        self.asked_at: dict[str, float] = {}
        self.started_at = now()
        self.heard_at: dict[str, float] = {}  # the last CacheSync from each MD, in step or not
        self.silent: set[str] = set()  # MDs reported silent and not heard from since
        self.unknown = 0  # CacheSync from an MD this router does not know
        self.on_heard = on_heard  # told the index of each MD heard from
        self.pending: dict[str, float] = {}  # the oldest unanswered ask to each MD
        self.replies = {name: deque[float](maxlen=REPLIES_KEPT) for name in self.names}

    def ask(self, name: str) -> None:
        mirror = self.mirrors[name]
        self.asked_at[name] = self.now()
        self.pending.setdefault(name, self.asked_at[name])
        self.send(name, SyncRequest(self.reply_to, name, mirror.epoch or NO_EPOCH, mirror.seq))

    def on_sync(self, msg: CacheSync) -> None:
        mirror = self.mirrors.get(msg.name)
        if mirror is None:
            self.unknown += 1
            logger.warning("cache sync for unknown MD %r", msg.name)
            return
        heard_before = msg.name in self.heard_at
        self.heard_at[msg.name] = self.now()
        # An answer to an ask is a heartbeat or a snapshot's first part; a delta may have left
        # MD before the ask arrived. The first answer ever only tells how long MD took to start.
        answer = msg.cleared or not (msg.added or msg.removed)
        asked = self.pending.pop(msg.name, None) if answer else None
        if asked is not None and heard_before:
            self.replies[msg.name].append(self.now() - asked)
        if self.on_heard is not None:
            self.on_heard(self.names.index(msg.name))
        if not mirror.apply(msg) and self.now() - self.asked_at.get(msg.name, 0.0) > 1.0:
            logger.info("cache sync: MD %s out of step (epoch %s seq %d); asking for a snapshot",
                        msg.name, msg.epoch, msg.seq)  # fmt: skip
            self.ask(msg.name)

    def fresh(self, name: str) -> bool:
        mirror = self.mirrors[name]
        last = mirror.synced_at
        silent = last is None or self.now() - last > SILENT_INTERVALS * self.interval_s
        return not mirror.stale and not silent

    def silence(self, name: str) -> str:
        """Why MD `name`'s control plane may be silent, or "" while it answers cache sync."""
        last = self.heard_at.get(name, self.started_at)
        quiet = self.now() - last
        if quiet <= SILENT_INTERVALS * self.interval_s:
            return ""
        return f"no cache sync from MD {name} for {quiet:.0f}s: {SILENCE_CAUSES}"

    def report_silence(self, name: str) -> None:
        """Log once when MD `name` falls silent and once when it is heard again."""
        why = self.silence(name)
        if why and name not in self.silent:
            self.silent.add(name)
            self.pending.pop(name, None)  # its answer will measure the outage, not a round trip
            logger.warning("%s; requests sent to it wait for READY until --ready-timeout", why)
        elif not why and name in self.silent:
            self.silent.discard(name)
            logger.info("cache sync: MD %s answers again", name)

    def cached_prefix(self, name: str, prompt: Sequence[int] | PromptHashes) -> int:
        """MD `name`'s cached prefix of the prompt (block granularity); 0 if its view is stale."""
        return self.mirrors[name].cached_prefix(prompt) if self.fresh(name) else 0

    def reply_p99(self, name: str) -> float | None:
        """The 99th percentile of MD `name`'s recent answers to an ask, in seconds."""
        got = sorted(self.replies[name])
        return round(got[min(len(got) - 1, int(0.99 * len(got)))], 4) if got else None

    def status(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, m in self.mirrors.items():
            age = None if m.synced_at is None else round(self.now() - m.synced_at, 3)
            out[name] = {"fresh": self.fresh(name), "epoch": m.epoch, "seq": m.seq,
                         "block": m.block, "blocks": len(m.hashes), "tokens": m.tokens,
                         "resyncs": m.resyncs, "synced_s_ago": age,
                         "silent": name in self.silent,
                         "sync_reply_p99_s": self.reply_p99(name)}  # fmt: skip
        return out

    async def loop(self) -> None:
        while True:
            for name in self.names:
                try:
                    self.ask(name)
                except Exception:  # one MD's bad address must not stop the others' sync
                    logger.exception("cache sync request to %s failed", name)
                self.report_silence(name)
            await asyncio.sleep(self.interval_s)
