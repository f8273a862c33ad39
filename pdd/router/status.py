"""What the router tells about itself: /status (JSON) and /metrics (Prometheus)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from pdd.router.context import TIERS, RouterContext
from pdd.router.metrics import Labels


def _gauges(ctx: RouterContext) -> dict[str, list[tuple[Labels, float]]]:
    """The gauges only the router's state knows, for /metrics."""
    out: dict[str, list[tuple[Labels, float]]] = {
        "control_malformed": [((), ctx.control.stats.malformed)],
        "instance_load": [],
        "instance_up": [],
        "wan_bytes_per_second": [],
        "wan_overhead_seconds": [],
    }
    for tier in TIERS:
        for i, url in enumerate(ctx.health.urls(tier)):
            labels = _labels(tier, url, ctx.loads[tier].dp_ranks[i])
            out["instance_load"].append((labels, ctx.loads[tier].value(i)))
            out["instance_up"].append((labels, float(ctx.health.up(tier, i))))
    for target, est in zip(ctx.config.main, ctx.wan, strict=True):
        labels = _labels("main", target.url, target.dp_rank)
        if est.bytes_per_s is not None:
            out["wan_bytes_per_second"].append((labels, est.bytes_per_s))
        out["wan_overhead_seconds"].append((labels, est.overhead_s))
    return out


def _labels(tier: str, url: str, dp_rank: int | None) -> Labels:
    # The DP ranks of one MD server share its URL: each is a series of its own.
    rank = () if dp_rank is None else (("dp_rank", str(dp_rank)),)
    return (("tier", tier), ("url", url), *rank)


def metrics_text(ctx: RouterContext) -> str:
    return ctx.metrics.render(_gauges(ctx))


def status_body(ctx: RouterContext, uptime_s: float) -> dict[str, Any]:
    config = ctx.config
    instances: dict[str, Any] = {}
    tiers: dict[str, tuple[Any, ...]] = {
        "prefill": config.prefill,
        "relay": config.relay,
        "main": config.main,
    }
    health = ctx.health.status()
    for tier, targets in tiers.items():
        load = ctx.loads[tier]
        instances[tier] = [{**asdict(t), "active": load.active[i], "load": load.value(i),
                            "reported_load": load.reported[i], "capacity": load.capacity[i],
                            "kv_room": load.kv_room(i), "kv_pool": load.kv_pool(i),
                            "kv_reserve": load.reserve[i], "problem": load.problems[i],
                            **health[tier][i]}
                           for i, t in enumerate(targets)]  # fmt: skip
    now = time.monotonic()
    for i, est in enumerate(ctx.wan):
        instances["main"][i]["control_addr"] = config.main[i].control_addr  # md_caches' key
        instances["main"][i]["wan"] = est.to_dict()
        residual = ctx.first_token_residual[i]
        instances["main"][i]["first_token_extra_s"] = round(residual.value(now), 4)
        instances["main"][i]["first_token_samples"] = residual.samples(now)
    return {
        "uptime_s": round(uptime_s, 3),
        "default_path": config.path,
        "path_policy": asdict(config.path_policy),
        "relay_tpot_s": ctx.relay_speed.tpot_s.value,
        "prefill_s_per_token": ctx.prefill_speed.s_per_token.value,
        "handoff": asdict(config.handoff),
        "timeouts": asdict(config.timeouts),
        "control": {
            "reply_to": ctx.reply_to,
            "signed": config.secret is not None,
            **asdict(ctx.control.stats),
            "unknown_rids": ctx.unknown_rids,
        },
        "md_caches": ctx.caches.status(),
        "active_requests": ctx.metrics.active,
        "instances": instances,
        "counters": ctx.metrics.snapshot(),
    }
