"""Each instance's load as the server itself reports it, so that several routers in front of the
same servers balance on the same numbers (a router's own count sees only what it sent).

SGLang's `/v1/loads` gives, per data-parallel rank, the requests running and waiting (on a
decode server the waiting include those whose KV is still in flight). Between two reports a
router adds the requests it has sent since it asked, so a burst does not all land on the
instance that looked idle. An instance that does not answer falls back to the router's count.
Each instance's capacity (the requests it runs at once, as SGLang resolved it) comes from its
`/server_info` once: the path policy keeps a small RelayDecode tier from being overfilled.
A small RLD's KV pool can bind before its request count does (SGLang's decode side admits a
request only if its prompt fits beside `num_reserved_decode_tokens` per active request), so its
KV room is tracked too: what `/v1/loads` reports committed (KV in use plus queued prompts), the
reservation of each request, and the prompts this router sent since asking.
An instance that is one DP rank of a server (an MD with DP attention) counts that rank alone;
an MD server with DP attention given whole (`--main`, not `--main-dp`) is reported as a
misconfiguration: SGLang would place its requests on any rank while the router talks to rank
0's control socket and mirrors rank 0's cache.
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


def dp_attention_size(doc: Any) -> int:
    """The DP ranks of a `/server_info` answer's server when it runs DP attention, else 1."""
    if not doc.get("enable_dp_attention"):
        return 1
    # SGLang resolves `--dp-size N --enable-dp-attention` to attn_dp_size N (and dp_size 1).
    return int(doc.get("attn_dp_size") or doc.get("dp_size") or 1)


def kv_reported(doc: Any, dp_rank: int | None = None) -> tuple[int, int] | None:
    """KV tokens committed (in use plus queued prompts) and the pool's size, over every DP rank
    of a `/v1/loads` answer (or `dp_rank`'s); None when the server does not report its pool."""
    loads = _rank_loads(doc, dp_rank)
    pool = sum(int(r.get("max_total_num_tokens") or 0) for r in loads)
    if pool <= 0:
        return None
    return sum(int(r.get("num_total_tokens") or 0) for r in loads), pool


def _rank_loads(doc: Any, dp_rank: int | None) -> list[Any]:
    loads = doc["loads"]
    if not isinstance(loads, list) or not loads:
        raise ValueError("no loads in the answer")
    if dp_rank is not None:
        loads = [r for r in loads if int(r["dp_rank"]) == dp_rank]
        if not loads:
            raise ValueError(f"no load of DP rank {dp_rank} in the answer")
    return loads


def requests_reported(doc: Any, dp_rank: int | None = None) -> int:
    """Running plus waiting requests over every DP rank of a `/v1/loads` answer (or `dp_rank`'s)."""
    loads = _rank_loads(doc, dp_rank)
    return sum(int(r["num_running_reqs"]) + int(r["num_waiting_reqs"]) for r in loads)


@dataclass
class Load:
    """The load of each instance of one tier."""

    active: list[int]  # this router's requests in flight on each instance
    # The server's own count at its last report (None: no report, use `active`), and this
    # router's requests sent since that report was asked for.
    reported: list[int | None] = field(default_factory=list)
    sent_since: list[int] = field(default_factory=list)
    # KV: (committed tokens, pool) at the last report (None: not reported), the prompt tokens
    # sent since, and the tokens SGLang reserves per active request (`/server_info`).
    kv: list[tuple[int, int] | None] = field(default_factory=list)
    tokens_since: list[int] = field(default_factory=list)
    reserve: list[int] = field(default_factory=list)
    capacity: list[int | None] = field(default_factory=list)  # None: not reported (yet)
    dp_ranks: list[int | None] = field(default_factory=list)  # an instance that is one DP rank
    # Whether a server with DP attention must be given rank by rank (MD: a request's rank
    # owns its parked KV, its control socket and its cache); what is wrong with each, if any.
    per_dp_rank: bool = False
    problems: list[str | None] = field(default_factory=list)
    cursor: int = 0

    def __post_init__(self) -> None:
        n = len(self.active)
        self.reported = self.reported or [None] * n
        self.sent_since = self.sent_since or [0] * n
        self.kv = self.kv or [None] * n
        self.tokens_since = self.tokens_since or [0] * n
        self.reserve = self.reserve or [0] * n
        self.capacity = self.capacity or [None] * n
        self.dp_ranks = self.dp_ranks or [None] * n
        self.problems = self.problems or [None] * n

    def value(self, i: int) -> int:
        reported = self.reported[i]
        return self.active[i] if reported is None else reported + self.sent_since[i]

    def values(self) -> list[int]:
        return [self.value(i) for i in range(len(self.active))]

    def kv_room(self, i: int) -> int | None:
        """Prompt tokens instance `i` could still take in (its pool less what is committed, the
        prompts sent since the report and a reservation for each request and the next one);
        None without a report."""
        kv = self.kv[i]
        if kv is None:
            return None
        committed, pool = kv
        return pool - committed - self.tokens_since[i] - self.reserve[i] * (self.value(i) + 1)

    def kv_pool(self, i: int) -> int | None:
        """Instance `i`'s KV pool in tokens, as it last reported it."""
        kv = self.kv[i]
        return None if kv is None else kv[1]

    def hold(self, i: int, tokens: int = 0) -> None:
        self.active[i] += 1
        self.sent_since[i] += 1
        self.tokens_since[i] += tokens

    def release(self, i: int) -> None:
        self.active[i] -= 1

    def advance(self, i: int) -> int:
        self.cursor = (i + 1) % len(self.active)
        return i

    async def poll(self, session: aiohttp.ClientSession, i: int, url: str, timeout: float) -> bool:
        """Asks instance `i` for its load; whether it answered."""
        if self.capacity[i] is None:
            await self._ask_capacity(session, i, url, timeout)
        before, tokens_before = self.sent_since[i], self.tokens_since[i]
        try:
            async with session.get(
                f"{url}{LOADS_PATH}", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                resp.raise_for_status()
                doc = await resp.json()
                reported = requests_reported(doc, self.dp_ranks[i])
                kv = kv_reported(doc, self.dp_ranks[i])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
                TypeError) as err:  # fmt: skip
            if self.reported[i] is not None:
                logger.warning("%s%s failed (%r): counting own requests", url, LOADS_PATH, err)
            self.reported[i], self.kv[i] = None, None
            return False
        self.reported[i], self.kv[i] = reported, kv
        # Those sent before the question are in the answer; later ones may not be yet.
        self.sent_since[i] = max(0, self.sent_since[i] - before)
        self.tokens_since[i] = max(0, self.tokens_since[i] - tokens_before)
        return True

    async def _ask_capacity(
        self, session: aiohttp.ClientSession, i: int, url: str, timeout: float
    ) -> None:
        try:
            async with session.get(
                f"{url}{INFO_PATH}", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                resp.raise_for_status()
                doc = await resp.json()
                self.capacity[i] = capacity_reported(doc, self.dp_ranks[i])
                if doc.get("disaggregation_mode") == "decode":
                    self.reserve[i] = int(doc.get("num_reserved_decode_tokens") or 0)
                self._check_dp(i, url, dp_attention_size(doc))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
                TypeError) as err:  # fmt: skip
            logger.debug("%s%s failed (%r): capacity unknown for now", url, INFO_PATH, err)

    def _check_dp(self, i: int, url: str, dp_size: int) -> None:
        if not self.per_dp_rank or self.dp_ranks[i] is not None or dp_size == 1:
            return
        self.problems[i] = (f"{url} runs DP attention with {dp_size} ranks but is given as one "
                            f"MD: give it with --main-dp {url} CONTROL_PORT {dp_size}")  # fmt: skip
        logger.error("%s", self.problems[i])


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
