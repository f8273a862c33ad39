"""Rejects replayed, out-of-order and stale control messages.

Each sending socket numbers its messages 1, 2, ... under a random sender id (pdd.control.messages
`Origin`), and one ZMQ connection delivers them in order, so a receiver accepts from a sender only
numbers above the last it accepted. Memory is bounded: at most `max_senders` senders are
remembered (least recently heard forgotten first), and a message whose timestamp is more than
`window_s` away from the receiver's clock is rejected, so a captured message can only be replayed
within the window and only after its sender was forgotten, i.e. after `max_senders` other senders
were heard in between. With an HMAC secret an attacker cannot mint new sender ids or numbers; the
window assumes the datacenters' clocks agree within it (NTP keeps them within milliseconds).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from pdd.control.messages import Origin

DEFAULT_WINDOW_S = 120.0
DEFAULT_MAX_SENDERS = 4096


@dataclass
class ReplayGuard:
    window_s: float = DEFAULT_WINDOW_S
    max_senders: int = DEFAULT_MAX_SENDERS
    last: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def check(self, origin: Origin, ts: float, now: float) -> str | None:
        """None when the message is fresh and in order (and records it); else why not."""
        skew = now - ts
        if not math.isfinite(skew) or abs(skew) > self.window_s:
            return (f"timestamp {skew:+.1f}s from this clock, outside +-{self.window_s:g}s: "
                    "stale, replayed or a skewed clock")  # fmt: skip
        prev = self.last.get(origin.sender)
        if prev is not None and origin.n <= prev:
            return (f"message {origin.n} of sender {origin.sender} after its message {prev}: "
                    "replayed or out of order")  # fmt: skip
        self.last[origin.sender] = origin.n
        self.last.move_to_end(origin.sender)
        while len(self.last) > self.max_senders:
            self.last.popitem(last=False)
        return None
