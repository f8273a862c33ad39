"""Writing KV with Mooncake over several TCP flows, without spinning (pdd.srt.wan_transfer has
the why), and never returning while a byte of the write could still land. Plain Mooncake calls:
the benchmarks use the same code as the servers.

Why a write waits (docs/wan.md, "When a write fails"): once a write returned an error SGLang
fails the request and frees its KV slots (P's at once, a decoder's after a timeout), and they
go to other requests. Mooncake's TCP transport cannot cancel a piece, times out neither a piece
waiting in its queue for a lane nor one whose bytes are on the wire, and refuses to free a batch
still running; and a connection it closed after a failure keeps sending in the kernel. A piece
left running would write into slots another request owns: wrong output, silently. So a write
returns only once Mooncake reported every submitted piece finished or failed (its status call
then frees the piece's batch), and after a failure only once no closed connection still holds
bytes for the peer; if that does not happen within `watchdog_s`, the process stops."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NoReturn

from pdd.srt import tcp_peers

logger = logging.getLogger(__name__)

# A piece costs its lane 1-2 round trips (request and the receiver's ack), so a write makes one
# piece per lane: 16 pieces of 8 MiB on one lane took 3.4x as long as one of 128 MiB. Small
# writes are cut too: a suffix's KV of a few blocks (a model's layers) on a few lanes waits
# several round trips for windows that idle lanes would carry at once (1 MB over 4 lanes: 0.29 s
# at RTT 40 ms and 64 KB windows); below about one window a piece's header and ack cost more
# than its bytes.
MIN_PIECE = 64 << 10
MAX_PIECE = 1 << 30
PENDING_PER_FLOW = 4  # submitted, unfinished pieces per lane: lanes never wait for work
POLL_SLEEP_S = (0.0002, 0.01)  # the poll's sleep grows from the first to the second
# Mooncake fails a piece that waited this long for room in its per-peer queue (set below; a
# piece that got room waits for a lane without a limit)
ADMISSION_TIMEOUT_S = 120.0
# Mooncake's limits on one piece's time on the wire (MC_TCP_PROGRESS_TIMEOUT_SEC, no completion
# on its connection; MC_TCP_STATUS_TIMEOUT_SEC, the receiver's ack once the piece's bytes are in
# the socket): 30 s by default, set here. With one piece per lane a piece lasts as long as the
# whole write, so on a busy line a write MD still waits for (the router's READY timeout, 60 s)
# would fail for being slow, its KV crossed for nothing.
PIECE_TIMEOUT_S = 90.0
ENV_WATCHDOG = "PDD_WAN_WRITE_WATCHDOG_S"
ORPHAN_POLL_S = 0.05
STOP_EXIT_CODE = 70  # EX_SOFTWARE: what a process stopped by the watchdog exits with
MAX_FLOWS = 16  # Mooncake's most lanes per peer

Block = tuple[int, int, int]  # (source address, destination address, bytes)


def mooncake_env(n: int) -> dict[str, str]:
    """What Mooncake's TCP transport reads at engine start-up to use `n` lanes per peer. Queue
    and piece limits are raised because a slow WAN keeps entries queued and on the wire far
    longer than a LAN does."""
    return {
        "MC_TCP_ENABLE_CONNECTION_POOL": "1",
        "MC_TCP_LANES_PER_PEER": str(n),
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",  # its most
        "MC_TCP_ADMISSION_TIMEOUT_MS": str(int(ADMISSION_TIMEOUT_S * 1000)),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(int(PIECE_TIMEOUT_S)),
        "MC_TCP_STATUS_TIMEOUT_SEC": str(int(PIECE_TIMEOUT_S)),
    }


def flows_for(rate_bit_s: float, rtt_s: float, window_bytes: int) -> int:
    """The TCP flows that fill a link: twice its bandwidth-delay product over one flow's window
    (a flow averages well under its full window: slow start, ack clocking), 1-MAX_FLOWS. More
    flows than needed hurt: their bursts overrun the bottleneck's queue and they finish unevenly."""
    bdp = rate_bit_s * rtt_s / 8
    return max(1, min(MAX_FLOWS, math.ceil(2 * bdp / window_bytes)))


def piece_size(total: int, n: int) -> int:
    """One piece per lane, 64 KiB-1 GiB."""
    return max(MIN_PIECE, min(MAX_PIECE, -(-total // n)))


def pieces(blocks: Sequence[Block], n: int) -> list[Block]:
    """`blocks`, with each one larger than the piece size cut into pieces."""
    size = piece_size(sum(b[2] for b in blocks), n)
    out = []
    for src, dst, length in blocks:
        for off in range(0, length, size):
            out.append((src + off, dst + off, min(size, length - off)))
    return out


def deadline_s(nbytes: int) -> float:
    """How long Mooncake's own synchronous write allows (MC_TRANSFER_TIMEOUT seconds, at least 5,
    default 30, plus a second per GB): a write still running past it is slow, not yet stuck."""
    return max(5.0, _env_seconds("MC_TRANSFER_TIMEOUT", 30.0)) + nbytes / 1e9


def watchdog_s(nbytes: int) -> float:
    """How long a write waits for Mooncake to settle its pieces before it stops the process:
    PDD_WAN_WRITE_WATCHDOG_S, else twice the longest a piece takes within Mooncake's own limits
    (its wait for admission, the transfer within `deadline_s`, the receiver's ack)."""
    admission = _env_seconds("MC_TCP_ADMISSION_TIMEOUT_MS", ADMISSION_TIMEOUT_S * 1000) / 1000
    status = _env_seconds("MC_TCP_STATUS_TIMEOUT_SEC", PIECE_TIMEOUT_S)
    return _env_seconds(ENV_WATCHDOG, 2 * (admission + deadline_s(nbytes) + status))


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name) or default)
    except ValueError:
        logger.warning("PDD: ignoring %s=%r (not a number); using %s", name, os.environ[name],
                       default)  # fmt: skip
        return default
    return value if value > 0 else default


def _sleeps() -> Iterator[float]:
    s = POLL_SLEEP_S[0]
    while True:
        yield s
        s = min(s * 2, POLL_SLEEP_S[1])


def write(engine: Any, session: str, blocks: Sequence[Block], n: int) -> int:
    """Writes `blocks` to `session` over up to `n` TCP flows: 0 when every byte landed, -1 when a
    piece failed. Either way it returns only once no byte of the write can land any more: after
    a failure it submits no more pieces, waits until Mooncake settled each submitted one and
    until closed connections no longer hold bytes for the peer. A write that does not get there
    within `watchdog_s` stops the process (`stop_process`)."""
    todo = deque(pieces(blocks, n))
    pending: dict[int, Block] = {}  # batch id: piece
    failed: str | None = None
    start = time.monotonic()
    nbytes = sum(b[2] for b in blocks)
    slow, limit = deadline_s(nbytes), watchdog_s(nbytes)  # slow: warned about once, then 0
    sleeps = _sleeps()
    while todo or pending:
        while todo and failed is None and len(pending) < PENDING_PER_FLOW * n:
            piece = todo.popleft()
            batch = engine.transfer_submit_write(session, *piece)
            if batch in (0, (1 << 64) - 1):
                failed = f"submitting a piece of {piece[2]} bytes failed"
            else:
                pending[batch] = piece
        if failed is not None:
            todo.clear()
        settled = 0
        for batch, piece in list(pending.items()):
            # 1 finished, -1 failed: settled, and Mooncake freed the batch. Anything else leaves
            # the piece running (0; -2, a timeout, is not a TCP transport's answer): ask again.
            status = engine.transfer_check_status(batch)
            if status in (1, -1):
                del pending[batch]
                settled += 1
                if status == -1 and failed is None:
                    failed = f"a piece of {piece[2]} bytes failed"
        if not pending:
            continue
        if settled:
            sleeps = _sleeps()
        waited = time.monotonic() - start
        if waited > limit:
            stop_process(session, _unsettled(session, waited, pending.values(), failed))
        if slow and waited > slow:
            logger.warning("PDD: KV write to %s: %d pieces still in flight after %.0fs; waiting "
                           "for Mooncake to settle them (watchdog %.0fs)", session, len(pending),
                           waited, limit)  # fmt: skip
            slow = 0.0
        time.sleep(next(sleeps))
    if failed is None:
        return 0
    _drain_closed(session, start, limit, failed)
    logger.warning("PDD: KV write to %s failed: %s", session, failed)
    return -1


def _drain_closed(session: str, start: float, limit: float, failed: str) -> None:
    """Waits until closed connections no longer hold bytes for the peer: a piece whose ack did
    not come in time fails while its bytes may still be queued in the kernel, which keeps
    sending a closed socket's queue (or drops it after its retries)."""
    peers = tcp_peers.peer_addresses(session)
    while (left := tcp_peers.orphaned_bytes(peers)) > 0:
        waited = time.monotonic() - start
        if waited > limit:
            stop_process(session, f"KV write to {session} failed ({failed}) and closed "
                                  f"connections still hold {left} bytes for it after "
                                  f"{waited:.0f}s")  # fmt: skip
        time.sleep(ORPHAN_POLL_S)


def _unsettled(session: str, waited: float, pending: Collection[Block], failed: str | None) -> str:
    shown = ", ".join(
        f"{length} bytes {src:#x}->{dst:#x}" for src, dst, length in list(pending)[:8]
    )
    more = f" and {len(pending) - 8} more" if len(pending) > 8 else ""
    return (f"KV write to {session}: {len(pending)} pieces not settled by Mooncake after "
            f"{waited:.0f}s ({failed or 'none failed'}): {shown}{more}")  # fmt: skip


def stop_process(session: str, why: str) -> NoReturn:
    """Ends this process when a write's pieces may still land after the watchdog. Returning
    would let SGLang fail the request and free its slots, on P and, after its timeout, on the
    decoder, while Mooncake could still write into them for another request; raising does the
    same through SGLang's transfer worker; waiting on would hold the worker and still not stop
    the decoder from freeing its slots on its own timeout. Mooncake has no cancel, so the one
    way to end the pieces is to end the process that sends them, its connections reset first
    so that the kernel drops their unsent bytes instead of delivering them. SGLang's watchdog
    then takes the server down, and the decoders fail its requests."""
    logger.critical("PDD: %s. Stopping this process: a write that can still land must not meet "
                    "a freed KV slot", why)  # fmt: skip
    try:
        reset = tcp_peers.reset_on_exit(tcp_peers.peer_addresses(session))
        logger.critical("PDD: %d connections to %s reset; exiting with code %d", reset,
                        session, STOP_EXIT_CODE)  # fmt: skip
    except Exception:  # the exit must happen regardless
        logger.exception("PDD: resetting the connections to %s failed", session)
    os._exit(STOP_EXIT_CODE)
