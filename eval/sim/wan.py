"""The WAN between the datacenters as the simulator runs it: KV transfers share the line."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

from pdd.eval.sim.clock import Clock
from pdd.eval.sim.hardware import Link


class Wan:
    """Processor sharing: n concurrent transfers each get min(flow rate, line / n)."""

    def __init__(self, clock: Clock, rng: random.Random, link: Link) -> None:
        self.clock, self.rng, self.link = clock, rng, link
        self.flows: dict[int, list[Any]] = {}  # id -> [bytes left, on_arrive]
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0
        self.sent = 0.0  # bytes
        self.last_s = 0.0  # when the last transfer left the line
        self.peak_flows = 0

    def _rate(self) -> float:
        return min(self.link.flow_bytes_per_s, self.link.bytes_per_s / max(len(self.flows), 1))

    def _advance(self) -> None:
        now = self.clock.now
        if self.flows:
            done = (now - self._last) * self._rate()
            for f in self.flows.values():
                f[0] -= done
        self._last = now

    def send(self, nbytes: float, on_arrive: Callable[[], None]) -> None:
        self._advance()
        self.sent += nbytes
        self.flows[next(self._ids)] = [float(nbytes), on_arrive]
        self.peak_flows = max(self.peak_flows, len(self.flows))
        self._reschedule()

    def _reschedule(self) -> None:
        self._version += 1
        if self.flows:
            fid = min(self.flows, key=lambda i: self.flows[i][0])
            left = max(self.flows[fid][0], 0.0)
            t = self.clock.now + left / self._rate()
            self.clock.at(t, self._complete, self._version, fid)

    def _complete(self, version: int, fid: int) -> None:
        if version != self._version:
            return
        self._advance()
        now = self.clock.now
        tolerance = max(1.0, self._rate() * 1e-9)  # float error must not stall the clock
        done = [i for i, f in self.flows.items() if i == fid or f[0] <= tolerance]
        self.last_s = now
        for i in done:
            _, on_arrive = self.flows.pop(i)
            self.clock.at(now + self.link.one_way_s(self.rng), on_arrive)
        self._reschedule()
