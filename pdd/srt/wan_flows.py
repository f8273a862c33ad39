"""How many TCP flows a KV write to a peer uses, chosen per peer unless `--pdd-wan-flows` fixes it.

One flow carries at most about half its window per round trip (`flows_for`), so what a peer
needs follows from the path's round trip (the kernel's min_rtt on this process's connections
to it), one flow's window (the socket buffers' max) and the line's rate. The rate is learnt
from the writes themselves: a write whose flows ran near their windows' limit was window-bound
(unless it only reached the line already measured, the line may carry more: the next write
to that peer doubles its flows); one that ran well below it was line-bound, and its rate is
the line's. The most of the last few line-bound rates
stands for the line, so a link that changed is measured again within a few writes. Too many
flows hurt as much as too few: with large windows their bursts overrun the bottleneck's queue
(docs/wan.md: 16 flows reached 0.47 of a line one flow filled to 0.97).

Only writes that ran alone to their peer and were large enough to leave TCP's start-up behind
teach anything, and never a peer's first (it opens the connections). A peer's round trip is
read at the end of each write until it is known (the first write opens the connections it is
read from), then again every `RTT_EVERY_S`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd.srt import tcp_peers
from pdd.srt.wan_write import MAX_FLOWS, flows_for

AUTO_FLOWS = "auto"
START_FLOWS = MAX_FLOWS  # a peer's first writes, until one teaches: what a capped window needs
WINDOW_BOUND = 0.6  # of what n windows per round trip allow: above it, window-bound
ABOVE_LINE = 1.1  # a window-bound write this far above the known line: the line grew
LEARN_MIN_BYTES = 8 << 20  # smaller writes are mostly TCP start-up
LINE_SAMPLES = 4  # line-bound writes whose best rate stands for the line
RTT_EVERY_S = 10.0


def fixed_flows(value: str) -> int | None:
    """`--pdd-wan-flows`: None for AUTO_FLOWS, else the number; ValueError naming the range."""
    if value == AUTO_FLOWS:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_FLOWS:
        raise ValueError(f"must be '{AUTO_FLOWS}' or in 1-{MAX_FLOWS}, not {value!r}")
    return n


def sysctl_max(key: str) -> int | None:
    """The last (max) value of a sysctl like net.ipv4.tcp_wmem; None if unreadable."""
    try:
        with open(os.path.join("/proc/sys", *key.split("."))) as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def flow_window() -> int:
    """One flow's most bytes in flight: the smaller socket buffer max (send here, receive at
    the peer, configured alike in one deployment)."""
    values = [v for v in map(sysctl_max, ("net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem")) if v]
    return min(values) if values else 4 << 20


@dataclass
class PeerFlows:
    """What pdd knows of the path to one peer, and the flows its next write uses."""

    window: int
    rtt_s: float | None = None
    flows: int = START_FLOWS
    line_rates: deque[float] = field(default_factory=lambda: deque(maxlen=LINE_SAMPLES))
    rtt_at: float = float("-inf")
    active: int = 0  # writes to this peer running now
    begun: int = 0  # writes to this peer so far

    def per_flow(self) -> float | None:
        """Bytes/s one flow can carry: half its window per round trip."""
        return None if self.rtt_s is None else self.window / (2 * self.rtt_s)

    def learn(self, nbytes: int, seconds: float, flows: int) -> None:
        """A write of `nbytes` over `flows` flows that ran alone took `seconds`."""
        per_flow = self.per_flow()
        if per_flow is None or nbytes < LEARN_MIN_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        known = max(self.line_rates, default=0.0)
        if rate >= WINDOW_BOUND * flows * per_flow and rate > ABOVE_LINE * known:
            self.flows = min(MAX_FLOWS, max(self.flows, 2 * flows))  # the line may carry more
            return
        self.line_rates.append(rate)
        assert self.rtt_s is not None
        self.flows = flows_for(8 * max(self.line_rates), self.rtt_s, self.window)


@dataclass(frozen=True)
class Write:
    session: str
    flows: int
    started: float
    number: int  # the peer's `begun` when it started
    alone: bool  # no other write to the peer was running when it started


@dataclass
class FlowChooser:
    """Per peer (a Mooncake session id), the flows of its next write. Thread-safe: SGLang writes
    from several threads."""

    fixed: int | None = None  # --pdd-wan-flows
    window: int = field(default_factory=flow_window)
    rtt: Callable[[str], float | None] = lambda session: tcp_peers.min_rtt_s(
        tcp_peers.peer_addresses(session)
    )
    now: Callable[[], float] = time.monotonic
    peers: dict[str, PeerFlows] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, session: str) -> Write:
        """A write to `session` starts now: its flows. `end` must follow."""
        with self.lock:
            peer = self.peers.setdefault(session, PeerFlows(self.window))
            peer.active += 1
            peer.begun += 1
            write = Write(session, self.fixed or peer.flows, self.now(), peer.begun,
                          alone=peer.active == 1)  # fmt: skip
            stale = self.now() - peer.rtt_at >= RTT_EVERY_S
        if self.fixed is None and stale:
            self._read_rtt(session, peer)
        return write

    def end(self, write: Write, nbytes: int, ok: bool) -> None:
        """`write` ended: it moved `nbytes`, whole (`ok`) or not."""
        peer = self.peers[write.session]
        if self.fixed is None and peer.rtt_s is None:
            self._read_rtt(write.session, peer)  # the write's own connections now exist
        with self.lock:
            peer.active -= 1
            alone = write.alone and peer.begun == write.number  # no other began meanwhile
            # A peer's first write opens its connections: TCP's set-up, not the line.
            if ok and alone and write.number > 1 and self.fixed is None:
                peer.learn(nbytes, self.now() - write.started, write.flows)

    def _read_rtt(self, session: str, peer: PeerFlows) -> None:
        rtt = self.rtt(session)  # outside the lock: it reads /proc
        if rtt is None:
            return  # no connection yet: read again at the next chance
        with self.lock:
            peer.rtt_at = self.now()
            peer.rtt_s = rtt

    def status(self) -> dict[str, dict[str, float | int | None]]:
        with self.lock:
            return {s: {"flows": self.fixed or p.flows, "rtt_s": p.rtt_s,
                        "line_mbit": max(p.line_rates) * 8 / 1e6 if p.line_rates else None}
                    for s, p in self.peers.items()}  # fmt: skip
