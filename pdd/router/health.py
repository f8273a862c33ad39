"""Which instances are up: every instance's /ping, polled every `interval_s`.

SGLang's /ping is a flag check (healthy or not); its /health runs a generation and waits a
second, too heavy to poll every instance every few seconds.

An instance is down after `failures` failed checks in a row (or at once when a request finds
nothing listening there) and up again after one good check; pickers skip down instances, so new
requests avoid a dead server within one interval. A request whose connection dropped counts as
one failed check: a reset on the way is not a dead server, and a dead one refuses the next check.

A busy line is not a dead datacenter: while KV fills the WAN, a /ping to MD waits in the
link's queue behind it and may time out. A check that only timed out does not count while the
instance was heard from within `heard_window_s` on another channel (MD's answers to cache sync,
its control plane's heartbeat, or a load report): a dead server refuses or stays silent on
every channel, so it still goes down, one heard window later at most. A refused or failed
check always counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

logger = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 3.0  # a busy 2-core machine may take a while to answer


@dataclass
class InstanceHealth:
    url: str
    up: bool = True
    failures: int = 0
    last_error: str | None = None
    changed_at: float = 0.0
    heard_at: float | None = None  # the last sign of life on another channel
    downs: int = 0  # times it was marked down
    slow_checks: int = 0  # timed-out checks forgiven because it was heard meanwhile


class Health:
    def __init__(
        self,
        tiers: Mapping[str, Sequence[str]],
        interval_s: float,
        failures: int = 2,
        heard_window_s: float = 15.0,
        now: Callable[[], float] = time.monotonic,
    ):
        self.tiers = {t: [InstanceHealth(u) for u in urls] for t, urls in tiers.items()}
        self.interval_s = interval_s
        self.failures = failures
        self.heard_window_s = heard_window_s
        self.now = now

    def urls(self, tier: str) -> list[str]:
        return [h.url for h in self.tiers[tier]]

    def up(self, tier: str, i: int) -> bool:
        return self.tiers[tier][i].up

    def heard(self, tier: str, i: int) -> None:
        """Instance `i` of `tier` answered on a channel other than /ping."""
        self.tiers[tier][i].heard_at = self.now()

    def mark(self, tier: str, i: int, ok: bool, error: str | None = None) -> None:
        inst = self.tiers[tier][i]
        inst.failures = 0 if ok else inst.failures + 1
        inst.last_error = inst.last_error if ok else error
        now_up = ok or (inst.up and inst.failures < self.failures)
        if now_up != inst.up:
            inst.up, inst.changed_at = now_up, self.now()
            inst.downs += 0 if now_up else 1
            logger.warning("%s %s is %s%s", tier, inst.url, "up" if now_up else "DOWN",
                           "" if now_up else f": {error}")  # fmt: skip

    def mark_down(self, tier: str, i: int, error: str) -> None:
        """A request found the instance unreachable: no need to wait for the next check."""
        inst = self.tiers[tier][i]
        inst.failures = max(inst.failures, self.failures - 1)
        self.mark(tier, i, False, error)

    def request_lost(self, tier: str, i: int, error: str, unreachable: bool) -> None:
        """A request lost the instance: down now if no connection could be made, else (a dropped
        connection) one failure."""
        if unreachable:
            self.mark_down(tier, i, error)
        else:
            self.mark(tier, i, False, error)

    def timed_out(self, tier: str, i: int, error: str) -> None:
        """A check that got no answer in time: a failure unless the instance was heard lately."""
        inst = self.tiers[tier][i]
        quiet = None if inst.heard_at is None else self.now() - inst.heard_at
        if quiet is None or quiet > self.heard_window_s:
            self.mark(tier, i, False, error)
            return
        inst.slow_checks += 1
        logger.info("%s %s: %s, but heard %.1fs ago (a busy link): still up",
                    tier, inst.url, error, quiet)  # fmt: skip

    async def check(self, session: aiohttp.ClientSession, tier: str, i: int) -> None:
        url = self.tiers[tier][i].url
        timeout = aiohttp.ClientTimeout(total=max(CHECK_TIMEOUT_S, self.interval_s))
        try:
            async with session.get(f"{url}/ping", timeout=timeout) as resp:
                ok, error = resp.status == 200, f"/ping answered {resp.status}"
        except asyncio.TimeoutError as err:
            self.timed_out(tier, i, f"/ping timed out: {err!r}")
            return
        except (aiohttp.ClientError, OSError) as err:
            ok, error = False, f"/ping failed: {err!r}"
        self.mark(tier, i, ok, None if ok else error)

    async def loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            checks = [self.check(session, t, i) for t, insts in self.tiers.items()
                      for i in range(len(insts))]  # fmt: skip
            await asyncio.gather(*checks, return_exceptions=True)
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict[str, list[dict[str, object]]]:
        return {t: [{"url": h.url, "up": h.up, "last_error": h.last_error, "downs": h.downs,
                     "slow_checks": h.slow_checks} for h in insts]
                for t, insts in self.tiers.items()}  # fmt: skip
