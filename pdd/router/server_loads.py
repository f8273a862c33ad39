"""Each instance's load as the server itself reports it, so that several routers in front of the
same servers balance on the same numbers (a router's own count sees only what it sent).

SGLang's `/v1/loads` gives, per data-parallel rank, the requests running and waiting (on a
decode server the waiting include those whose KV is still in flight). Between two reports a
router adds the requests it has sent since it asked, so a burst does not all land on the
instance that looked idle. An instance that does not answer falls back to the router's count.
Each instance's capacity (the requests it runs at once, as SGLang resolved it) comes from its
`/server_info` once: the path policy keeps a small RelayDecode tier from being overfilled.
An instance that is one DP rank of a server (an MD with DP attention) counts that rank alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)
LOADS_PATH = "/v1/loads?include=core"
INFO_PATH = "/server_info"


def capacity_reported(doc: Any, dp_rank: int | None = None) -> int:
    """Requests the server runs at once, over every DP rank of a `/server_info` answer (or on
    `dp_rank` alone)."""
    states = doc.get("internal_states")
    if isinstance(states, list) and states:
        per_rank = [int(s["effective_max_running_requests_per_dp"]) for s in states]
        if dp_rank is None:
            return sum(per_rank)
        # One state per DP rank, in rank order; a server without DP reports one for all.
        return per_rank[dp_rank] if len(per_rank) > dp_rank else per_rank[0]
    value = doc.get("max_running_requests")
    if value is None:
        raise ValueError("no max running requests in the answer")
    return int(value)


def requests_reported(doc: Any, dp_rank: int | None = None) -> int:
    """Running plus waiting requests over every DP rank of a `/v1/loads` answer (or `dp_rank`'s)."""
    loads = doc["loads"]
    if not isinstance(loads, list) or not loads:
        raise ValueError("no loads in the answer")
    if dp_rank is not None:
        loads = [r for r in loads if int(r["dp_rank"]) == dp_rank]
        if not loads:
            raise ValueError(f"no load of DP rank {dp_rank} in the answer")
    return sum(int(r["num_running_reqs"]) + int(r["num_waiting_reqs"]) for r in loads)


@dataclass
class Load:
    """The load of each instance of one tier."""

    active: list[int]  # this router's requests in flight on each instance
    # The server's own count at its last report (None: no report, use `active`), and this
    # router's requests sent since that report was asked for.
    reported: list[int | None] = field(default_factory=list)
    sent_since: list[int] = field(default_factory=list)
    capacity: list[int | None] = field(default_factory=list)  # None: not reported (yet)
    dp_ranks: list[int | None] = field(default_factory=list)  # an instance that is one DP rank
    cursor: int = 0

    def __post_init__(self) -> None:
        n = len(self.active)
        self.reported = self.reported or [None] * n
        self.sent_since = self.sent_since or [0] * n
        self.capacity = self.capacity or [None] * n
        self.dp_ranks = self.dp_ranks or [None] * n

    def value(self, i: int) -> int:
        reported = self.reported[i]
        return self.active[i] if reported is None else reported + self.sent_since[i]

    def values(self) -> list[int]:
        return [self.value(i) for i in range(len(self.active))]

    def hold(self, i: int) -> None:
        self.active[i] += 1
        self.sent_since[i] += 1

    def release(self, i: int) -> None:
        self.active[i] -= 1

    def advance(self, i: int) -> int:
        self.cursor = (i + 1) % len(self.active)
        return i

    async def poll(self, session: aiohttp.ClientSession, i: int, url: str, timeout: float) -> bool:
        """Asks instance `i` for its load; whether it answered."""
        if self.capacity[i] is None:
            await self._ask_capacity(session, i, url, timeout)
        before = self.sent_since[i]
        try:
            async with session.get(
                f"{url}{LOADS_PATH}", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                resp.raise_for_status()
                reported = requests_reported(await resp.json(), self.dp_ranks[i])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as err:
            if self.reported[i] is not None:
                logger.warning("%s%s failed (%r): counting own requests", url, LOADS_PATH, err)
            self.reported[i] = None
            return False
        self.reported[i] = reported
        # Those sent before the question are in the answer; later ones may not be yet.
        self.sent_since[i] = max(0, self.sent_since[i] - before)
        return True

    async def _ask_capacity(
        self, session: aiohttp.ClientSession, i: int, url: str, timeout: float
    ) -> None:
        try:
            async with session.get(
                f"{url}{INFO_PATH}", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                resp.raise_for_status()
                self.capacity[i] = capacity_reported(await resp.json(), self.dp_ranks[i])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
                TypeError) as err:  # fmt: skip
            logger.debug("%s%s failed (%r): capacity unknown for now", url, INFO_PATH, err)


async def poll_loop(
    session: aiohttp.ClientSession,
    tiers: Sequence[tuple[str, Load, Sequence[str]]],
    interval_s: float,
    heard: Callable[[str, int], None],
) -> None:
    """Asks every instance of every tier for its load each `interval_s`; `heard(tier, i)` for
    each answer (a sign of life for the health checks)."""

    async def poll(tier: str, load: Load, i: int, url: str) -> None:
        if await load.poll(session, i, url, max(interval_s, 1.0)):
            heard(tier, i)

    while True:
        polls = [poll(tier, load, i, url) for tier, load, urls in tiers
                 for i, url in enumerate(urls)]  # fmt: skip
        await asyncio.gather(*polls, return_exceptions=True)
        await asyncio.sleep(interval_s)
