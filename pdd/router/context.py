"""What every request of the router shares: HTTP session, control socket, loads, metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdd.control.channel import AsyncControlSocket, Received
from pdd.control.messages import CacheSync, Message
from pdd.policy.balance import pick_by_prefix, pick_least_loaded
from pdd.router.config import RouterConfig
from pdd.router.estimates import (
    FirstTokenResidual,
    PrefillSpeed,
    RelaySpeed,
    WanEstimate,
    wan_estimate,
)
from pdd.router.health import Health
from pdd.router.md_caches import SILENT_INTERVALS, MdCaches
from pdd.router.metrics import Metrics
from pdd.router.prefix_index import PrefixIndex
from pdd.router.server_loads import Load

logger = logging.getLogger(__name__)

TIERS = ("prefill", "relay", "main")


class NoInstance(Exception):
    """Every instance a request needs is down: the client gets a 503 with the reason."""


@dataclass
class RouterContext:
    config: RouterConfig
    session: aiohttp.ClientSession
    control: AsyncControlSocket
    reply_to: str  # the control address MD servers send READY/ACK/ERROR to
    metrics: Metrics = field(default_factory=Metrics)
    loads: dict[str, Load] = field(default_factory=dict)
    subscribers: dict[str, asyncio.Queue[Any]] = field(default_factory=dict)
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    unknown_rids: int = 0
    caches: MdCaches = field(init=False)
    health: Health = field(init=False)
    wan: list[WanEstimate] = field(init=False)  # per MD
    first_token_residual: list[FirstTokenResidual] = field(init=False)  # per MD
    relay_speed: RelaySpeed = field(default_factory=RelaySpeed)
    prefill_speed: PrefillSpeed = field(default_factory=PrefillSpeed)
    prefill_index: list[PrefixIndex] = field(init=False)  # per P

    def __post_init__(self) -> None:
        cfg = self.config
        names = [t.control_addr for t in cfg.main]
        urls = {
            "prefill": [t.url for t in cfg.prefill],
            "relay": [t.url for t in cfg.relay],
            "main": [t.url for t in cfg.main],
        }
        # MD's cache-sync answers prove it alive for as long as the router calls it fresh.
        window = SILENT_INTERVALS * cfg.cache_sync_interval_s
        self.health = Health(urls, cfg.health_interval_s, heard_window_s=window)
        self.caches = MdCaches(names, self.send, self.reply_to, cfg.cache_sync_interval_s,
                               on_heard=lambda i: self.health.heard("main", i))  # fmt: skip
        self.wan = [wan_estimate(cfg.wan_mbit) for _ in cfg.main]
        self.first_token_residual = [FirstTokenResidual() for _ in cfg.main]
        self.prefill_index = [PrefixIndex(cfg.prefill_index_blocks) for _ in cfg.prefill]
        for tier in TIERS:
            self.loads.setdefault(tier, Load([0] * len(urls[tier])))
        self.loads["main"].dp_ranks = [t.dp_rank for t in cfg.main]
        self.loads["main"].per_dp_rank = True

    def live_loads(self, tier: str) -> list[int | None]:
        """Each instance's requests (as the server reports them); None for one that is down."""
        values = self.loads[tier].values()
        return [n if self.health.up(tier, i) else None for i, n in enumerate(values)]

    def relay_capacity(self, i: int) -> int | None:
        """Requests RLD `i` runs at once: the router's --relay-max-load, else what the server
        reported (None until it has)."""
        given = self.config.relay_capacity
        return given if given is not None else self.loads["relay"].capacity[i]

    def pick(self, tier: str, prefixes: list[int] | None = None, fail_open: bool = False) -> int:
        """The instance a new request should use. All down: NoInstance, or with `fail_open`
        (a tier nothing can replace) any of them, and the request finds out for itself."""
        loads, load = self.live_loads(tier), self.loads[tier]
        if all(n is None for n in loads):
            if not fail_open:
                raise NoInstance(f"every {tier} instance is down")
            loads = list(load.values())
        if prefixes is None:
            return load.advance(pick_least_loaded(loads, load.cursor))
        slack = self.config.prefix_slack
        return load.advance(pick_by_prefix(loads, prefixes, slack, load.cursor))

    def hold(self, tier: str, i: int, tokens: int = 0) -> None:
        self.loads[tier].hold(i, tokens)

    def release(self, tier: str, i: int) -> None:
        self.loads[tier].release(i)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task the router keeps a reference to until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def send(self, addr: str, msg: Message) -> int:
        n = self.control.send(addr, msg)
        self.metrics.inc("control_bytes_total", n, direction="out")
        return n

    def subscribe(self, rid: str, queue: asyncio.Queue[Any]) -> None:
        self.subscribers[rid] = queue

    def unsubscribe(self, rid: str) -> None:
        self.subscribers.pop(rid, None)

    def dispatch(self, received: Received) -> None:
        self.metrics.inc("control_bytes_total", received.nbytes, direction="in")
        msg = received.msg
        if isinstance(msg, CacheSync):
            self.caches.on_sync(msg)
            return
        rid = getattr(msg, "rid", None)
        queue = None if rid is None else self.subscribers.get(rid)
        if queue is None:
            # Normal for a message that crosses the request's end (e.g. READY after a CANCEL).
            self.unknown_rids += 1
            logger.debug("control %s for unknown request %s", msg, rid)
            return
        queue.put_nowait(received)

    async def control_loop(self) -> None:
        while True:
            try:
                self.dispatch(await self.control.recv())
            except asyncio.CancelledError:
                raise
            except Exception:  # the control plane must outlive any one bad message
                logger.exception("control loop error")
                await asyncio.sleep(0.01)
