"""ZMQ transport for control messages: one PULL socket to receive, cached PUSH sockets to send.

Both directions are non-blocking by construction: receiving drains what is queued and returns,
and sending queues at most `hwm` messages per peer and drops (with a logged reason) beyond
that, so a dead or slow peer never stalls the MainDecode scheduler loop or the router.
`ControlSocket` is the synchronous API (MD's scheduler loop); `AsyncControlSocket` is the
asyncio one (the router). With `curve` keys (pdd.control.curve) the PULL is a CURVE server and
every PUSH its client: the connections are encrypted, and a peer without the keys (plaintext,
or another secret) fails ZMQ's handshake, so its messages never arrive; the receiver goes on.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pdd.control.curve import CurveKeys
from pdd.control.messages import (
    MAX_MESSAGE_BYTES,
    ControlError,
    Message,
    Origin,
    encode,
    open_envelope,
)
from pdd.control.replay import ReplayGuard

logger = logging.getLogger(__name__)

DEFAULT_HWM = 10_000
MAX_PEERS = 256
# Messages still queued to a peer when its socket closes are dropped after this long.
LINGER_MS = 100
# Log the first few malformed messages, then one in LOG_EVERY, so a noisy peer cannot flood logs.
LOG_FIRST = 10
LOG_EVERY = 1000


@dataclass
class ChannelStats:
    received: int = 0
    received_bytes: int = 0
    malformed: int = 0  # every rejected message: bad bytes, bad tag, replayed, out of order
    replayed: int = 0  # ... of which replayed, out of order or stale
    sent: int = 0
    sent_bytes: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class Received:
    msg: Message
    nbytes: int  # size on the wire, for per-request control-byte accounting


class _Inbox:
    """Decoding and bookkeeping shared by the sync and async receivers."""

    def __init__(self, secret: bytes | None, stats: ChannelStats) -> None:
        self.secret = secret
        self.stats = stats
        self.guard = ReplayGuard()

    def accept(self, parts: list[bytes]) -> Received | None:
        if len(parts) != 1:
            self._reject(f"multipart message with {len(parts)} parts")
            return None
        try:
            env = open_envelope(parts[0], self.secret)
        except ControlError as err:
            self._reject(str(err))
            return None
        problem = self.guard.check(env.origin, env.ts, time.time())
        if problem is not None:
            self.stats.replayed += 1
            self._reject(problem)
            return None
        self.stats.received += 1
        self.stats.received_bytes += len(parts[0])
        return Received(env.msg, len(parts[0]))

    def _reject(self, reason: str) -> None:
        self.stats.malformed += 1
        n = self.stats.malformed
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            logger.warning("dropped malformed control message (%d so far): %s", n, reason)


class _Peers:
    """One PUSH socket per peer address, created on first use, least recently used evicted."""

    def __init__(
        self,
        context: zmq.Context,
        secret: bytes | None,
        hwm: int,
        stats: ChannelStats,
        curve: CurveKeys | None,
    ) -> None:
        self.context = context
        self.secret = secret
        self.hwm = hwm
        self.stats = stats
        self.curve = curve
        self.sockets: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.origins = Origin.new_sender()  # this socket's sender id and message numbers

    def _socket(self, addr: str) -> zmq.Socket:
        sock = self.sockets.get(addr)
        if sock is not None:
            self.sockets.move_to_end(addr)
            return sock
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        if self.curve is not None:
            self.curve.client(sock)
        try:
            sock.connect(addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.sockets[addr] = sock
        while len(self.sockets) > MAX_PEERS:
            _, old = self.sockets.popitem(last=False)
            old.close()
        return sock

    def send(self, addr: str, msg: Message) -> int:
        """Bytes queued for `addr`, or 0 when dropped (logged): also for an invalid message, so
        a sender's bug costs one message, never the scheduler loop that sends it."""
        try:
            data = encode(msg, self.secret, next(self.origins))
        except ControlError as err:
            self._drop(addr, msg, f"invalid message: {err}")
            return 0
        try:
            self._socket(addr).send(data, zmq.NOBLOCK)
        except zmq.Again:
            self._drop(addr, msg, "peer queue full (peer down or not reading)")
            return 0
        except zmq.ZMQError as err:
            self._drop(addr, msg, str(err))
            return 0
        self.stats.sent += 1
        self.stats.sent_bytes += len(data)
        return len(data)

    def _drop(self, addr: str, msg: Message, reason: str) -> None:
        self.stats.dropped += 1
        rid = getattr(msg, "rid", "?")
        logger.warning("dropped control %s for %s to %s: %s", type(msg).__name__, rid, addr, reason)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()


def _bound_pull(context: zmq.Context, hwm: int, addr: str, curve: CurveKeys | None) -> zmq.Socket:
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    # ZMQ disconnects a peer that sends more than this, before buffering it.
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if curve is not None:
        curve.serve(sock)
    try:
        sock.bind(addr)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


class ControlSocket:
    """Synchronous control endpoint: `bind` to receive, `send` to any peer, never blocks."""

    def __init__(
        self,
        secret: bytes | None = None,
        *,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self.context = context or zmq.Context.instance()
        self.secret = secret or None
        self.hwm = hwm
        self.curve = curve
        self.stats = ChannelStats()
        self._inbox = _Inbox(self.secret, self.stats)
        self._peers = _Peers(self.context, self.secret, hwm, self.stats, curve)
        self._pull: zmq.Socket | None = None

    def bind(self, addr: str) -> str:
        """Bind the receiving socket (`tcp://host:port`, port `*` for any); the bound address."""
        if self._pull is not None:
            raise RuntimeError("ControlSocket is already bound")
        self._pull = _bound_pull(self.context, self.hwm, addr, self.curve)
        return self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def socket(self) -> zmq.Socket:
        if self._pull is None:
            raise RuntimeError("ControlSocket is not bound")
        return self._pull

    @property
    def fd(self) -> int:
        """For external pollers. ZMQ's fd is edge-triggered: drain with recv_nowait on wake-up."""
        return int(self.socket.getsockopt(zmq.FD))

    def recv_received(self, limit: int = 10_000) -> list[Received]:
        """Every valid message queued now (at most `limit`), with its size; never blocks."""
        out: list[Received] = []
        sock = self.socket
        while len(out) < limit:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = self._inbox.accept(parts)
            if got is not None:
                out.append(got)
        return out

    def recv_nowait(self, limit: int = 10_000) -> list[Message]:
        return [r.msg for r in self.recv_received(limit)]

    def send(self, addr: str, msg: Message) -> int:
        """Queue `msg` for `addr`; the bytes queued, or 0 when dropped (logged)."""
        return self._peers.send(addr, msg)

    def close(self) -> None:
        self._peers.close()
        if self._pull is not None:
            self._pull.close()
            self._pull = None


class AsyncControlSocket:
    """The router's control endpoint: `await recv()` for the next valid message, `send` as in
    ControlSocket (sending never blocks, so it needs no await)."""

    def __init__(
        self,
        secret: bytes | None = None,
        *,
        hwm: int = DEFAULT_HWM,
        curve: CurveKeys | None = None,
    ) -> None:
        self.secret = secret or None
        self.hwm = hwm
        self.curve = curve
        self.stats = ChannelStats()
        self._inbox = _Inbox(self.secret, self.stats)
        self._actx = zmq.asyncio.Context()
        self._peers = _Peers(zmq.Context.instance(), self.secret, hwm, self.stats, curve)
        self._pull: zmq.asyncio.Socket | None = None

    def bind(self, addr: str) -> str:
        if self._pull is not None:
            raise RuntimeError("AsyncControlSocket is already bound")
        sock = _bound_pull(self._actx, self.hwm, addr, self.curve)
        self._pull = sock  # type: ignore[assignment]
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> Received:
        if self._pull is None:
            raise RuntimeError("AsyncControlSocket is not bound")
        while True:
            parts = await self._pull.recv_multipart()
            got = self._inbox.accept(parts)
            if got is not None:
                return got

    def send(self, addr: str, msg: Message) -> int:
        return self._peers.send(addr, msg)

    def close(self) -> None:
        self._peers.close()
        if self._pull is not None:
            self._pull.close()
            self._pull = None
        self._actx.destroy(linger=0)
