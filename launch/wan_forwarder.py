"""The WAN daemon: carries the link between two namespaces and applies faults to it.

    python -m pdd.launch.wan_forwarder --config JSON     # started by pdd.launch.testbed

Two backends, one control socket (protocol and client in `pdd.launch.wan`):

- `tun`: a TUN device in each namespace, both opened by this process (it enters each namespace
  to open it, then returns). Every packet read from one is timed by `LinkModel` (rate, queue,
  delay, jitter, loss) and written to the other when due. Used when the kernel has no netem.
- `netem`: the namespaces are joined by a veth pair that carries netem on both ends; this
  process only rewrites the netem settings when a fault starts or ends.

The daemon runs at real-time priority (SCHED_FIFO; nice -10 where that is refused) so that load
from the servers under test does not add delay to the forwarded packets: a real link does not
share CPU with the servers at its ends. It never spins (it sleeps in select between packets), and
the kernel's real-time throttling keeps 5% of each core for the rest. It exits on SIGTERM; the TUN
devices vanish with it.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import math
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pdd.launch import netns
from pdd.launch.wan import FAULT_KINDS, LinkModel, LinkParams, LinkState

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
READ_SIZE = 65536  # above the largest TUN MTU
READ_BURST = 64  # packets read per wake-up, so one busy direction cannot starve the other
IDLE_WAKE_S = 0.5
RT_PRIORITY = 10  # SCHED_FIFO: above every ordinary process, below the kernel's own threads
NICE = -10
SLACK_S = 0.0002  # wake and send this early: about what a wake-up takes to happen
NETEM_MIN_LIMIT = 1000
NETEM_MEAN_PACKET = 500  # bytes; sizes netem's packet-count limit generously


@dataclass
class DaemonConfig:
    backend: str  # "tun" or "netem"
    namespaces: tuple[str, str]  # datacenter A, datacenter B
    device: str
    socket_path: str
    link: LinkParams
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DaemonConfig:
        raw = json.loads(text)
        raw["namespaces"] = tuple(raw["namespaces"])
        raw["link"] = LinkParams(**raw["link"])
        return cls(**raw)


class Backend(Protocol):
    def readers(self) -> dict[int, Callable[[float], None]]: ...
    def next_due(self) -> float | None: ...
    def deliver(self, now: float) -> None: ...
    def on_change(self, state: LinkState, now: float) -> None: ...
    def counters(self) -> dict[str, Any]: ...


def open_tun(namespace: str, device: str) -> int:
    with netns.entered(namespace):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", device.encode(), IFF_TUN | IFF_NO_PI))
    return fd


@dataclass
class Direction:
    src: int
    dst: int
    model: LinkModel
    in_flight: deque[tuple[float, bytes]] = field(default_factory=deque)
    packets: int = 0
    bytes: int = 0
    write_errors: int = 0


class TunForwarder:
    def __init__(self, config: DaemonConfig, state: LinkState) -> None:
        ns_a, ns_b = config.namespaces
        fd_a = open_tun(ns_a, config.device)
        fd_b = open_tun(ns_b, config.device)
        rng = random.Random(config.seed)
        self.directions = {
            "a_to_b": Direction(fd_a, fd_b, LinkModel(rng)),
            "b_to_a": Direction(fd_b, fd_a, LinkModel(rng)),
        }
        self.link = state.current()
        self.cut = state.cut

    def readers(self) -> dict[int, Callable[[float], None]]:
        return {d.src: functools.partial(self.receive, d) for d in self.directions.values()}

    def receive(self, direction: Direction, now: float) -> None:
        for _ in range(READ_BURST):
            try:
                packet = os.read(direction.src, READ_SIZE)
            except BlockingIOError:
                return
            due = direction.model.admit(len(packet), now, self.link, self.cut)
            if due is not None:
                direction.in_flight.append((due, packet))

    def next_due(self) -> float | None:
        due = None
        for d in self.directions.values():
            if d.in_flight and (due is None or d.in_flight[0][0] < due):
                due = d.in_flight[0][0]
        return due

    def deliver(self, now: float) -> None:
        for d in self.directions.values():
            while d.in_flight and d.in_flight[0][0] <= now:
                packet = d.in_flight.popleft()[1]
                try:
                    os.write(d.dst, packet)
                except OSError:
                    d.write_errors += 1  # e.g. the far device is down: the packet is lost
                    continue
                d.packets += 1
                d.bytes += len(packet)

    def on_change(self, state: LinkState, now: float) -> None:
        self.link = state.current()
        self.cut = state.cut
        if self.cut:
            for d in self.directions.values():
                d.in_flight.clear()
                d.model.flush(now)

    def counters(self) -> dict[str, Any]:
        return {
            name: {
                "packets": d.packets, "bytes": d.bytes, "in_flight": len(d.in_flight),
                "dropped": {**d.model.dropped, "write": d.write_errors},
            }
            for name, d in self.directions.items()
        }  # fmt: skip


def netem_args(link: LinkParams, cut: bool) -> list[str]:
    # netem's limit counts packets in the delay line as well as in the queue.
    held_s = (link.delay_ms + link.jitter_ms) / 1000 + link.queue_s
    limit = max(NETEM_MIN_LIMIT, math.ceil(link.rate_mbit * 1e6 / 8 * held_s / NETEM_MEAN_PACKET))
    args = ["netem", "limit", str(limit), "delay", f"{link.delay_ms}ms"]
    if link.jitter_ms:
        args.append(f"{link.jitter_ms}ms")
    loss = 100.0 if cut else link.loss_pct  # always given: `change` resets what is left out
    return [*args, "loss", f"{loss}%", "rate", f"{link.rate_mbit}mbit"]


class NetemShaper:
    def __init__(self, config: DaemonConfig, state: LinkState) -> None:
        self.config = config
        self.apply(state, replace=True)

    def apply(self, state: LinkState, replace: bool) -> None:
        for ns in self.config.namespaces:
            qdisc = ["tc", "-n", ns, "qdisc"]
            if replace:  # deleting the qdisc drops what it holds: a cut loses packets in flight
                netns.run([*qdisc, "del", "dev", self.config.device, "root"], check=False)
            verb = "add" if replace else "change"
            netns.run([*qdisc, verb, "dev", self.config.device, "root",
                       *netem_args(state.current(), state.cut)])  # fmt: skip

    def readers(self) -> dict[int, Callable[[float], None]]:
        return {}

    def next_due(self) -> float | None:
        return None

    def deliver(self, now: float) -> None:
        pass

    def on_change(self, state: LinkState, now: float) -> None:
        self.apply(state, replace=state.cut)

    def counters(self) -> dict[str, Any]:
        return {}


class ControlServer:
    """Unix-socket JSON requests, served from the daemon's event loop without blocking it.

    `readers` is the event loop's table (file descriptor -> callback); clients come and go in it.
    """

    def __init__(
        self,
        path: Path,
        handle: Callable[[dict[str, Any]], dict[str, Any]],
        readers: dict[int, Callable[[float], None]],
    ) -> None:
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.handle = handle
        self.readers = readers
        self.pending: dict[int, tuple[socket.socket, bytes]] = {}
        readers[self.listener.fileno()] = self.accept

    def accept(self, now: float) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        fd = conn.fileno()
        self.pending[fd] = (conn, b"")
        self.readers[fd] = lambda now: self.read(fd)

    def read(self, fd: int) -> None:
        conn, data = self.pending[fd]
        try:
            chunk = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data += chunk
        if chunk and b"\n" not in data:
            self.pending[fd] = (conn, data)
            return
        del self.readers[fd], self.pending[fd]
        if chunk:
            reply = self.answer(data.split(b"\n", 1)[0])
            conn.settimeout(1.0)  # replies are small; a stuck client cannot hold the link long
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass
        conn.close()

    def answer(self, line: bytes) -> dict[str, Any]:
        try:
            return {"ok": True, "status": self.handle(json.loads(line))}
        except (ValueError, KeyError, TypeError, netns.CommandError) as err:
            return {"ok": False, "error": f"{type(err).__name__}: {err}"}


@dataclass
class Daemon:
    config: DaemonConfig
    state: LinkState
    backend: Backend
    started: float = field(default_factory=time.monotonic)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op not in ("status", "restore", *FAULT_KINDS):
            raise ValueError(f"unknown op {op!r}")
        now = time.monotonic()
        if op == "restore":
            self.state.restore()
            self.backend.on_change(self.state, now)
        elif op != "status":
            value = 1.0 if op == "cut" else float(request["value"])
            seconds = request.get("seconds")
            if seconds is not None and float(seconds) <= 0:
                raise ValueError("seconds must be > 0")
            self.state.inject(op, value, None if seconds is None else float(seconds), now)
            self.backend.on_change(self.state, now)
        return self.status(now)

    def status(self, now: float) -> dict[str, Any]:
        return {
            "backend": self.config.backend,
            "pid": os.getpid(),
            "uptime_s": now - self.started,
            "cpu_s": time.process_time(),
            "link": self.state.describe(now),
            "counters": self.backend.counters(),
        }

    def run(self, readers: dict[int, Callable[[float], None]]) -> None:
        # select(), not epoll: it sleeps to the microsecond, epoll rounds up to a millisecond.
        readers.update(self.backend.readers())
        while True:
            now = time.monotonic()
            deadline = self.state.next_deadline()
            if deadline is not None and deadline <= now:
                self.state.expire(now)
                self.backend.on_change(self.state, now)
                deadline = self.state.next_deadline()
            wake = now + IDLE_WAKE_S
            due = self.backend.next_due()
            if due is not None and due < wake:
                wake = due
            if deadline is not None and deadline < wake:
                wake = deadline
            ready = select.select(list(readers), [], [], max(0.0, wake - now - SLACK_S))[0]
            now = time.monotonic()
            for fd in ready:
                if fd in readers:  # a control client may have gone in this round
                    readers[fd](now)
            self.backend.deliver(now + SLACK_S)


def raise_priority() -> str:
    """Real time if allowed, else nice -10, else as it was; says which."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
        return "SCHED_FIFO"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
        return f"nice {NICE}"
    except PermissionError:
        return "default"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdd.launch.wan_forwarder", description=__doc__)
    parser.add_argument("--config", required=True, help="DaemonConfig as JSON")
    config = DaemonConfig.from_json(parser.parse_args(argv).config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    priority = raise_priority()
    state = LinkState(config.link)
    backend: Backend = (TunForwarder if config.backend == "tun" else NetemShaper)(config, state)
    daemon = Daemon(config, state, backend)
    readers: dict[int, Callable[[float], None]] = {}
    ControlServer(Path(config.socket_path), daemon.handle, readers)
    print(f"WAN daemon {os.getpid()} ({config.backend}, {priority}) ready: {config.to_json()}",
          flush=True)  # fmt: skip
    try:
        daemon.run(readers)
    finally:
        Path(config.socket_path).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
