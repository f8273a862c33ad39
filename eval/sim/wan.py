"""The WAN between the datacenters as the simulator runs it: KV transfers share the line."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from pdd.eval.sim.clock import Clock
from pdd.eval.sim.hardware import Link


@dataclass(eq=False)
class Transfer:
    left: float  # bytes
    on_arrive: Callable[[], None]
    start: float


class Wan:
    """Max-min fair sharing of the line: each transfer gets at most its ceiling
    (`Link.ramp_bytes_per_s`: the flow rate, or a TCP ramp after idle), the others share what it
    leaves. Rates hold between events: a transfer's start or end, a ramp's next round trip."""

    def __init__(self, clock: Clock, rng: random.Random, link: Link) -> None:
        self.clock, self.rng, self.link = clock, rng, link
        self.flows: dict[int, Transfer] = {}
        self.rates: dict[int, float] = {}
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0
        self.sent = 0.0  # bytes
        self.last_s = 0.0  # when the last transfer left the line
        self.peak_flows = 0

    def _share(self) -> None:
        now, line = self.clock.now, self.link.bytes_per_s
        caps = {i: self.link.ramp_bytes_per_s(now - f.start) for i, f in self.flows.items()}
        self.rates = {}
        for i in sorted(caps, key=lambda j: caps[j]):
            self.rates[i] = min(caps[i], line / (len(caps) - len(self.rates)))
            line -= self.rates[i]

    def _advance(self) -> None:
        now = self.clock.now
        for i, f in self.flows.items():
            f.left -= (now - self._last) * self.rates.get(i, 0.0)
        self._last = now

    def send(self, nbytes: float, on_arrive: Callable[[], None]) -> None:
        self._advance()
        self.sent += nbytes
        self.flows[next(self._ids)] = Transfer(float(nbytes), on_arrive, self.clock.now)
        self.peak_flows = max(self.peak_flows, len(self.flows))
        self._reschedule()

    def _reschedule(self) -> None:
        self._version += 1
        self._share()
        if not self.flows:
            return
        now = self.clock.now
        t = min(now + max(f.left, 0.0) / self.rates[i] for i, f in self.flows.items())
        rtt, ceiling = self.link.rtt_ms / 1000, self.link.flow_bytes_per_s
        for f in self.flows.values():
            if self.link.ramp_flows is not None and rtt > 0:
                elapsed = now - f.start
                if self.link.ramp_bytes_per_s(elapsed) < ceiling:  # its next step
                    t = min(t, f.start + (int(elapsed / rtt + 1e-9) + 1) * rtt)
        self.clock.at(t, self._update, self._version)

    def _update(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        now = self.clock.now
        tolerance = max(1.0, max(self.rates.values()) * 1e-9)  # float error must not stall
        done = [i for i, f in self.flows.items() if f.left <= tolerance]
        if done:
            self.last_s = now
        for i in done:
            f = self.flows.pop(i)
            self.clock.at(now + self.link.one_way_s(self.rng), f.on_arrive)
        self._reschedule()
