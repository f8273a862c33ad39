"""Writing KV with Mooncake over several TCP flows, without spinning (pdd.srt.wan_transfer has
the why). Plain Mooncake calls: the benchmarks use the same code as the servers."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# A piece costs its lane 1-2 round trips (request and the receiver's ack), so a write makes one
# piece per lane: 16 pieces of 8 MiB on one lane took 3.4x as long as one of 128 MiB.
MIN_PIECE = 1 << 20
MAX_PIECE = 1 << 30
PENDING_PER_FLOW = 4  # submitted, unfinished pieces per lane: lanes never wait for work
POLL_SLEEP_S = (0.0002, 0.01)  # the poll's sleep grows from the first to the second
ADMISSION_TIMEOUT_S = 120.0  # Mooncake may queue a piece this long before a lane takes it
MAX_FLOWS = 16  # Mooncake's most lanes per peer

Block = tuple[int, int, int]  # (source address, destination address, bytes)


def mooncake_env(n: int) -> dict[str, str]:
    """What Mooncake's TCP transport reads at engine start-up to use `n` lanes per peer. Queue
    limits are raised because a slow WAN keeps entries queued far longer than a LAN does."""
    return {
        "MC_TCP_ENABLE_CONNECTION_POOL": "1",
        "MC_TCP_LANES_PER_PEER": str(n),
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",  # its most
        "MC_TCP_ADMISSION_TIMEOUT_MS": str(int(ADMISSION_TIMEOUT_S * 1000)),
    }


def flows_for(rate_bit_s: float, rtt_s: float, window_bytes: int) -> int:
    """The TCP flows that fill a link: twice its bandwidth-delay product over one flow's window
    (a flow averages well under its full window: slow start, ack clocking), 1-MAX_FLOWS. More
    flows than needed hurt: their bursts overrun the bottleneck's queue and they finish unevenly."""
    bdp = rate_bit_s * rtt_s / 8
    return max(1, min(MAX_FLOWS, math.ceil(2 * bdp / window_bytes)))


def piece_size(total: int, n: int) -> int:
    """One piece per lane, 1 MiB-1 GiB."""
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
    """How long a write may take: as Mooncake's own synchronous write allows (MC_TRANSFER_TIMEOUT
    seconds, at least 5, default 30, plus a second per GB)."""
    try:
        base = max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT") or 30))
    except ValueError:
        base = 30
    return base + nbytes / 1e9


def _sleeps() -> Iterator[float]:
    s = POLL_SLEEP_S[0]
    while True:
        yield s
        s = min(s * 2, POLL_SLEEP_S[1])


def write(engine: Any, session: str, blocks: Sequence[Block], n: int) -> int:
    """Writes `blocks` to `session` over up to `n` TCP flows: 0 when every byte landed; -1 when
    a piece failed (once the pieces already submitted have finished, so none outlives the call)
    or the write ran past `deadline_s`."""
    todo = deque(pieces(blocks, n))
    pending: list[int] = []
    failed: str | None = None
    deadline = time.monotonic() + deadline_s(sum(b[2] for b in blocks))
    sleeps = _sleeps()
    while todo or pending:
        while todo and failed is None and len(pending) < PENDING_PER_FLOW * n:
            src, dst, length = todo.popleft()
            batch = engine.transfer_submit_write(session, src, dst, length)
            if batch in (0, (1 << 64) - 1):
                failed = f"submitting {length} bytes to {session} failed"
            else:
                pending.append(batch)
        if failed is not None:
            todo.clear()
        still = []
        for batch in pending:
            status = engine.transfer_check_status(batch)
            if status == 0:
                still.append(batch)
            elif status < 0 and failed is None:
                failed = f"a piece to {session} {'timed out' if status == -2 else 'failed'}"
        if len(still) < len(pending):
            sleeps = _sleeps()
        elif time.monotonic() > deadline:
            logger.error("PDD: KV write to %s timed out with %d of its pieces in flight",
                         session, len(still))  # fmt: skip
            return -1
        pending = still
        if pending:
            time.sleep(next(sleeps))
    if failed is not None:
        logger.warning("PDD: KV write failed: %s", failed)
        return -1
    return 0
