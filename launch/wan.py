"""The emulated WAN link: its parameters, its faults, its packet timing, and a client for it.

The link joins datacenter A and datacenter B of the testbed (`pdd.launch.testbed`). A daemon
(`pdd.launch.wan_forwarder`) owns it and takes faults over a unix control socket: one JSON
request per line, one JSON reply per line. `WanClient` speaks that protocol:

    client = WanClient(socket_path)
    client.cut(seconds=3)            # drop everything both ways, in flight too; back after 3 s
    client.rate(50, seconds=10)      # 50 Mbit/s for 10 s (no seconds: until restore)
    client.delay(100)                # +100 ms one-way on top of the set delay, until restore
    client.restore()                 # end every fault now
    client.status()                  # parameters, faults, packet counters, daemon CPU seconds

`LinkModel` is the timing of one direction when the daemon forwards packets itself: a
serialiser at the link rate behind a drop-tail queue of `queue_ms` of link time, then the
one-way delay plus uniform jitter, with order preserved (a packet never overtakes the one
before it), and random loss on arrival.
"""

from __future__ import annotations

import json
import random
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONTROL_TIMEOUT_S = 5.0
MIN_QUEUE_MS = 10.0
FAULT_KINDS = ("cut", "rate", "delay")


@dataclass
class LinkParams:
    rate_mbit: float = 200.0
    delay_ms: float = 20.0  # one way; the round trip is twice this
    jitter_ms: float = 0.0  # uniform in [-jitter, +jitter], order preserved
    loss_pct: float = 0.0  # each packet, each direction
    queue_ms: float | None = None  # drop-tail queue in link time; None: one round trip

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, not {self.rate_mbit}")
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"jitter_ms ({self.jitter_ms}) must not exceed delay_ms")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss_pct must be within 0..100, not {self.loss_pct}")

    @property
    def queue_s(self) -> float:
        # One round trip of queue lets a single TCP flow keep the link full.
        queue_ms = self.queue_ms if self.queue_ms is not None else 2 * self.delay_ms
        return max(queue_ms, MIN_QUEUE_MS) / 1000


@dataclass
class Fault:
    value: float  # cut: unused; rate: Mbit/s; delay: extra one-way ms
    until: float | None  # time.monotonic() deadline; None: until restore


@dataclass
class LinkState:
    """The set parameters and the faults now active; `current()` is what the link does now."""

    base: LinkParams
    faults: dict[str, Fault] = field(default_factory=dict)

    def inject(self, kind: str, value: float, seconds: float | None, now: float) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULT_KINDS)}")
        if kind == "rate" and value <= 0:
            raise ValueError("a rate fault needs mbit > 0 (use a cut to stop the link)")
        if kind == "delay" and value < 0:
            raise ValueError("a delay fault needs ms >= 0")
        self.faults[kind] = Fault(value, None if seconds is None else now + seconds)

    def restore(self) -> None:
        self.faults.clear()

    def expire(self, now: float) -> bool:
        """Drop the faults whose time is up; True if any was dropped."""
        done = [k for k, f in self.faults.items() if f.until is not None and f.until <= now]
        for kind in done:
            del self.faults[kind]
        return bool(done)

    def next_deadline(self) -> float | None:
        deadlines = [f.until for f in self.faults.values() if f.until is not None]
        return min(deadlines, default=None)

    @property
    def cut(self) -> bool:
        return "cut" in self.faults

    def current(self) -> LinkParams:
        """The set link with its faults. The queue keeps its bytes: a router's buffer is memory,
        so a rate fault makes it hold more link time, not fewer packets (re-sized to the faulted
        rate, a 0.625 Mbit/s line would queue less than one jumbo frame, drop most packets of
        a few TCP flows and leave them in RTO backoff for minutes), and a delay fault adds
        none."""
        rate = self.faults["rate"].value if "rate" in self.faults else self.base.rate_mbit
        extra = self.faults["delay"].value if "delay" in self.faults else 0.0
        queue_ms = self.base.queue_s * 1000 * self.base.rate_mbit / rate
        return LinkParams(
            rate, self.base.delay_ms + extra, self.base.jitter_ms, self.base.loss_pct, queue_ms
        )  # fmt: skip

    def describe(self, now: float) -> dict[str, Any]:
        faults = {
            k: {"value": f.value, "seconds_left": None if f.until is None else f.until - now}
            for k, f in self.faults.items()
        }
        return {"set": asdict(self.base), "now": asdict(self.current()), "faults": faults}


@dataclass
class LinkModel:
    """Timing of one direction of the forwarded link (see the module docstring)."""

    rng: random.Random
    busy_until: float = 0.0  # when the serialiser finishes the last admitted packet
    last_out: float = 0.0  # when the last admitted packet leaves the far end
    dropped: dict[str, int] = field(default_factory=lambda: {"loss": 0, "queue": 0, "cut": 0})

    def admit(self, nbytes: int, now: float, link: LinkParams, cut: bool) -> float | None:
        """When a packet of `nbytes` arriving at `now` comes out, or None if it is dropped."""
        if cut:
            self.dropped["cut"] += 1
            return None
        if link.loss_pct and self.rng.random() * 100 < link.loss_pct:
            self.dropped["loss"] += 1
            return None
        start = max(now, self.busy_until)
        if start - now > link.queue_s:
            self.dropped["queue"] += 1
            return None
        self.busy_until = start + nbytes * 8 / (link.rate_mbit * 1e6)
        jitter = self.rng.uniform(-link.jitter_ms, link.jitter_ms) if link.jitter_ms else 0.0
        self.last_out = max(self.busy_until + (link.delay_ms + jitter) / 1000, self.last_out)
        return self.last_out

    def flush(self, now: float) -> None:
        """The link went down: what was queued or in flight is gone."""
        self.busy_until = now
        self.last_out = now


class WanError(RuntimeError):
    pass


@dataclass
class WanClient:
    socket_path: Path
    timeout: float = CONTROL_TIMEOUT_S

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError) as err:
                raise WanError(f"no WAN daemon at {self.socket_path}: {err}") from err
            sock.sendall(json.dumps({"op": op, **args}).encode() + b"\n")
            reply = sock.makefile("rb").readline()
        if not reply:
            raise WanError(f"the WAN daemon at {self.socket_path} closed without a reply")
        answer = json.loads(reply)
        if not answer.get("ok"):
            raise WanError(answer.get("error", "unknown error"))
        return answer["status"]

    def status(self) -> dict[str, Any]:
        return self.request("status")

    def cut(self, seconds: float | None = None) -> dict[str, Any]:
        return self.request("cut", seconds=seconds)

    def rate(self, mbit: float, seconds: float | None = None) -> dict[str, Any]:
        return self.request("rate", value=mbit, seconds=seconds)

    def delay(self, ms: float, seconds: float | None = None) -> dict[str, Any]:
        return self.request("delay", value=ms, seconds=seconds)

    def restore(self) -> dict[str, Any]:
        return self.request("restore")
