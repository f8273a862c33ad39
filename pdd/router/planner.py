"""Where one request goes: which P, RLD and MD instances, and which path (pdd.policy.path).

P: the one most likely to hold the prompt's prefix (the router's PrefixIndex), unless busier
than the others by more than --prefix-slack. MD: likewise, from MD's own cache sync. RLD: the
least loaded. Down instances are skipped; the path policy then sees what is left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdd.cache.blocks import PromptHashes
from pdd.policy.path import PathChoice, Signals, choose_path, direct_ttft_base
from pdd.router.context import NoInstance, RouterContext

DEFAULT_MAX_NEW = 128  # SGLang's default max_new_tokens


@dataclass(frozen=True)
class Plan:
    choice: PathChoice
    prefill: int
    relay: int | None
    main: int | None
    md_predicted: int | None  # MD's cached prefix of the prompt, as the router sees it
    hashes: PromptHashes | None  # the prompt's block hashes (None: a text prompt)
    direct_ttft_s: float | None = None  # P->MD's first token from compute + transfer alone


def prompt_ids(body: dict[str, Any]) -> list[int] | None:
    ids = body.get("input_ids")
    return ids if isinstance(ids, list) and all(isinstance(t, int) for t in ids) else None


def max_new_tokens(body: dict[str, Any]) -> int:
    params = body.get("sampling_params") or {}
    value = params.get("max_new_tokens") if isinstance(params, dict) else None
    return value if isinstance(value, int) and value > 0 else DEFAULT_MAX_NEW


def _try_pick(ctx: RouterContext, tier: str, prefixes: list[int] | None = None) -> int | None:
    if not ctx.loads[tier].active:
        return None
    try:
        return ctx.pick(tier, prefixes)
    except NoInstance:
        return None


def plan(ctx: RouterContext, body: dict[str, Any], requested: str | None,
         blockers: list[str]) -> Plan:  # fmt: skip
    cfg = ctx.config
    ids = prompt_ids(body)
    hashes = None if ids is None else PromptHashes(ids)
    p_prefix = None if hashes is None else [ix.cached_prefix(hashes) for ix in ctx.prefill_index]
    prefill = ctx.pick("prefill", p_prefix, fail_open=True)
    p_cached = 0 if p_prefix is None else p_prefix[prefill]
    md_prefix = None
    if hashes is not None:
        md_prefix = [ctx.caches.cached_prefix(t.control_addr, hashes) for t in cfg.main]
    main = _try_pick(ctx, "main", md_prefix)
    relay = _try_pick(ctx, "relay")
    if main is None and relay is None:
        raise NoInstance("every RLD and MD instance is down")
    predicted = None if main is None or md_prefix is None else md_prefix[main]
    prompt = 0 if ids is None else len(ids)
    transfer = None
    if main is not None and ids is not None:
        transfer = ctx.wan[main].transfer_s(prompt - (predicted or 0))
    max_new = max_new_tokens(body)
    now = time.monotonic()
    signals = Signals(
        prompt_tokens=prompt,
        max_new_tokens=max_new,
        md_cached_tokens=predicted,
        transfer_s=transfer,
        relay_decode_s=ctx.relay_speed.decode_s(max_new),
        relay_load=None if relay is None else ctx.loads["relay"].value(relay),
        md_available=main is not None,
        prefill_s=ctx.prefill_speed.prefill_s(max(prompt - p_cached, 0)),
        relay_capacity=None if relay is None else ctx.relay_capacity(relay),
        relay_kv_room=None if relay is None else ctx.loads["relay"].kv_room(relay),
        wan_stale=main is not None and ctx.wan[main].wants_probe(now),
        main_extra_s=0.0 if main is None else ctx.first_token_residual[main].value(now),
    )
    choice = choose_path(requested, cfg.path, blockers, signals, cfg.path_policy)
    if signals.wan_stale and choice.path == "pdd" and main is not None:
        ctx.wan[main].probed(now)  # this transfer measures the link: one probe is enough
    if choice.path == "pdd" and (relay is None or main is None):
        # One tier down: the other still serves the request, without a handoff.
        down = "RLD" if relay is None else "MD"
        choice = PathChoice("main" if relay is None else "relay", f"every {down} is down")
    if choice.path in ("pdd", "relay") and relay is None:
        raise NoInstance(f"path {choice.label} needs an RLD and every RLD is down")
    if choice.path in ("pdd", "main") and main is None:
        raise NoInstance(f"path {choice.label} needs an MD and every MD is down")
    return Plan(
        choice,
        prefill,
        relay if choice.path in ("pdd", "relay") else None,
        main if choice.path in ("pdd", "main") else None,
        predicted,
        hashes,
        direct_ttft_base(signals),
    )
