"""Which path a request takes: P->RLD->MD ("pdd"), P->RLD ("relay") or P->MD ("main").

Pure functions (the router and the simulator share them). `auto` decides from what the router
knows before sending: MD's cached prefix of the prompt (cache sync), the estimated time for the
uncached suffix's KV to reach MD (measured WAN bandwidth and latency), how long RLD would take
to produce the whole answer, and RLD's load:
- P->MD when the suffix arrives fast enough (high hit): no relay needed;
- P->RLD when RLD would finish before the KV reached MD ("singular" traffic: long uncached
  input, short output), unless relay-only traffic already fills its share of RLD;
- P->RLD->MD otherwise (RLD hides the transfer), unless RLD is overloaded: then P->MD.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PATHS = ("pdd", "relay", "main")
DEFAULT_PATHS = ("auto", *PATHS)  # what the router's --path accepts
LABELS = {"pdd": "P->RLD->MD", "relay": "P->RLD", "main": "P->MD"}
# Penalty parameters and their neutral values.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def handoff_blockers(body: Mapping[str, Any]) -> list[str]:
    """Request features a mid-stream handoff would break: MD's sampler state (penalties, grammar,
    min_new_tokens, logprobs) would not have seen RLD's tokens."""
    blockers = []
    if body.get("return_logprob"):
        blockers.append("return_logprob")
    params = body.get("sampling_params") or {}
    if isinstance(params, Mapping):
        for name, neutral in _NEUTRAL.items():
            value = params.get(name)
            if value is not None and value != neutral:
                blockers.append(name)
        blockers += [g for g in _GRAMMARS if params.get(g)]
        if (params.get("min_new_tokens") or 0) > 0:
            blockers.append("min_new_tokens")
        if (params.get("n") or 1) > 1:
            blockers.append("n")
    return blockers


@dataclass(frozen=True)
class PathChoice:
    path: str
    reason: str

    @property
    def label(self) -> str:
        return LABELS[self.path]


@dataclass(frozen=True)
class PathPolicy:
    direct_max_s: float = 0.25  # P->MD when the suffix's KV reaches MD within this
    relay_max_load: int = 32  # an RLD with this many requests takes no new one
    relay_only_max_load: int = 16  # relay-only traffic stops here: it must not swamp RLD
    margin: float = 1.5  # RLD "finishes first" when its decode time x margin < the transfer

    def __post_init__(self) -> None:
        if self.direct_max_s < 0 or self.margin < 1:
            raise ValueError("direct_max_s must be >= 0 and margin >= 1")
        if not 0 <= self.relay_only_max_load <= self.relay_max_load:
            raise ValueError("need 0 <= relay_only_max_load <= relay_max_load")


@dataclass(frozen=True)
class Signals:
    """What the router knows about one request before sending it."""

    prompt_tokens: int
    max_new_tokens: int
    md_cached_tokens: int | None = None  # the router's view of MD's hit; None: unknown
    transfer_s: float | None = None  # the uncached suffix's KV to MD; None: unknown
    relay_decode_s: float | None = None  # RLD producing all max_new_tokens; None: unknown
    relay_load: int | None = None  # requests on the chosen RLD; None: no RLD available
    md_available: bool = True


def auto_path(s: Signals, policy: PathPolicy) -> PathChoice:
    if s.relay_load is None and not s.md_available:
        raise ValueError("no RLD and no MD available")
    if not s.md_available:
        return PathChoice("relay", "no MD available")
    if s.relay_load is None:
        return PathChoice("main", "no RLD available")
    cached = s.md_cached_tokens or 0
    hit = f"{cached}/{s.prompt_tokens} tokens cached on MD"
    t = s.transfer_s
    if t is not None and t <= policy.direct_max_s:
        return PathChoice("main", f"high hit: {hit}, the rest reaches MD in ~{t:.2f}s")
    if s.relay_load >= policy.relay_max_load:
        return PathChoice("main", f"RLD overloaded ({s.relay_load} requests)")
    d = s.relay_decode_s
    if t is not None and d is not None and d * policy.margin < t:
        if s.relay_load < policy.relay_only_max_load:
            return PathChoice(
                "relay", f"singular: RLD finishes in ~{d:.2f}s, before the KV (~{t:.2f}s)"
            )
    when = "unknown" if t is None else f"~{t:.2f}s"
    return PathChoice("pdd", f"low hit: {hit}, the KV reaches MD in {when}")


def choose_path(
    requested: str | None,
    default: str,
    blockers: Sequence[str],
    signals: Signals | None = None,
    policy: PathPolicy | None = None,
) -> PathChoice:
    """The request's own `pdd_path`, else the router default (`auto`: decided from `signals`);
    a handoff path with blockers falls back to RLD only (P->MD stays: it never hands off)."""
    path = requested or default
    if path not in DEFAULT_PATHS:
        raise ValueError(f"path must be one of {DEFAULT_PATHS}, got {path!r}")
    if path == "auto":
        if signals is None:
            raise ValueError("path auto needs the request's signals")
        choice = auto_path(signals, policy or PathPolicy())
    else:
        choice = PathChoice(path, "requested" if requested else "default")
    if choice.path == "pdd" and blockers:
        return PathChoice("relay", f"handoff unsupported with {', '.join(blockers)}")
    return choice


def transfer_seconds(
    suffix_tokens: int,
    kv_bytes_per_token: float | None,
    bytes_per_s: float | None,
    overhead_s: float,
) -> float | None:
    """How long the KV of `suffix_tokens` takes to reach MD; None while a rate is unknown."""
    if suffix_tokens <= 0:
        return overhead_s
    if not kv_bytes_per_token or not bytes_per_s:
        return None
    return overhead_s + suffix_tokens * kv_bytes_per_token / bytes_per_s
