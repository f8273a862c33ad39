"""Which instances are up: every instance's /ping, polled every `interval_s`.

SGLang's /ping is a flag check (healthy or not); its /health runs a generation and waits a
second, too heavy to poll every instance every few seconds.

An instance is down after `failures` failed checks in a row (or at once when a request finds it
unreachable) and up again after one good check; pickers skip down instances, so new requests
avoid a dead server within one interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
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


class Health:
    def __init__(self, tiers: Mapping[str, Sequence[str]], interval_s: float, failures: int = 2):
        self.tiers = {t: [InstanceHealth(u) for u in urls] for t, urls in tiers.items()}
        self.interval_s = interval_s
        self.failures = failures

    def urls(self, tier: str) -> list[str]:
        return [h.url for h in self.tiers[tier]]

    def up(self, tier: str, i: int) -> bool:
        return self.tiers[tier][i].up

    def mark(self, tier: str, i: int, ok: bool, error: str | None = None) -> None:
        inst = self.tiers[tier][i]
        inst.failures = 0 if ok else inst.failures + 1
        inst.last_error = inst.last_error if ok else error
        now_up = ok or (inst.up and inst.failures < self.failures)
        if now_up != inst.up:
            inst.up, inst.changed_at = now_up, time.monotonic()
            logger.warning("%s %s is %s%s", tier, inst.url, "up" if now_up else "DOWN",
                           "" if now_up else f": {error}")  # fmt: skip

    def mark_down(self, tier: str, i: int, error: str) -> None:
        """A request found the instance unreachable: no need to wait for the next check."""
        inst = self.tiers[tier][i]
        inst.failures = max(inst.failures, self.failures - 1)
        self.mark(tier, i, False, error)

    async def check(self, session: aiohttp.ClientSession, tier: str, i: int) -> None:
        url = self.tiers[tier][i].url
        timeout = aiohttp.ClientTimeout(total=max(CHECK_TIMEOUT_S, self.interval_s))
        try:
            async with session.get(f"{url}/ping", timeout=timeout) as resp:
                ok, error = resp.status == 200, f"/ping answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            ok, error = False, f"/ping failed: {err!r}"
        self.mark(tier, i, ok, None if ok else error)

    async def loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            checks = [self.check(session, t, i) for t, insts in self.tiers.items()
                      for i in range(len(insts))]  # fmt: skip
            await asyncio.gather(*checks, return_exceptions=True)
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict[str, list[dict[str, object]]]:
        return {t: [{"url": h.url, "up": h.up, "last_error": h.last_error} for h in insts]
                for t, insts in self.tiers.items()}  # fmt: skip
