"""Which path a request takes: P->RLD->MD ("pdd"), P->RLD ("relay") or P->MD ("main").

Pure functions (the router and the simulator share them). `auto` is SLA-aware, as the paper's
policy is: MD, in the other datacenter, should decode almost everything, and RelayDecode (RLD),
a small tier beside P, only hides the WAN for the requests that need it. From what the router
knows before sending (MD's cached prefix of the prompt, P's compute, the measured WAN, RLD's
load and capacity):
- P->RLD when RLD would finish before the KV reached MD and the answer is a few tokens
  ("singular" traffic: long uncached input, short output), while relay-only traffic holds less
  than its share of RLD. A longer answer is a conversation's turn: its prompt goes to MD even
  when RLD answers first, so that MD's cache holds it for the next turn (kept on RLD alone, a
  session that opens with a long document would stay on RLD turn after turn);
- P->MD whenever its predicted time to first token (P's compute + the uncached suffix's KV
  crossing to MD) meets the TTFT SLA: high-hit requests, whose small suffix crosses quickly;
- P->RLD->MD otherwise (low hit, or P->MD slow lately: RLD hides the wait, then hands off),
  unless RLD is full (its running requests, or its KV pool: a request RLD cannot admit waits
  there, and P feeds MD only once RLD has taken the prompt): then P->MD even at a TTFT above
  the SLA. That guard is what keeps a low-hit burst from overloading RLD, the paper's named
  collapse; it can be switched off to show that collapse.
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
    ttft_sla_s: float = 3.0  # P->MD when its predicted TTFT is within this
    relay_max_load: int = 32  # RLD's capacity (requests) when its server reports none
    relay_only_share: float = 0.5  # relay-only traffic may hold this share of RLD's capacity
    margin: float = 1.5  # RLD "finishes first" when its decode time x margin < the transfer
    singular_max_new: int = 16  # relay-only answers are at most this long (singular traffic)
    guard: bool = True  # a full RLD takes no low-hit request (off: to show the collapse)

    def __post_init__(self) -> None:
        if self.ttft_sla_s <= 0 or self.margin < 1:
            raise ValueError("ttft_sla_s must be > 0 and margin >= 1")
        if self.relay_max_load < 0 or not 0 <= self.relay_only_share <= 1:
            raise ValueError("need relay_max_load >= 0 and 0 <= relay_only_share <= 1")
        if self.singular_max_new < 0:
            raise ValueError("singular_max_new must be >= 0")


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
    prefill_s: float | None = None  # P computing the prompt's uncached part; None: unknown
    relay_capacity: int | None = None  # requests the chosen RLD runs at once, as it reports
    relay_kv_room: int | None = None  # prompt tokens the chosen RLD's KV pool can still admit
    wan_stale: bool = False  # no transfer taught the WAN estimate for a while
    main_extra_s: float = 0.0  # what P->MD first tokens took lately beyond compute + transfer


def direct_ttft(s: Signals) -> float | None:
    """Predicted time to first token on P->MD: P's compute, then the suffix's KV to MD, plus
    what such first tokens took lately beyond those two."""
    base = direct_ttft_base(s)
    return None if base is None else base + s.main_extra_s


def direct_ttft_base(s: Signals) -> float | None:
    """P's compute and the suffix's KV to MD: what the learnt extra is measured against."""
    if s.transfer_s is None:
        return None
    return (s.prefill_s or 0.0) + s.transfer_s


def auto_path(s: Signals, policy: PathPolicy) -> PathChoice:
    if s.relay_load is None and not s.md_available:
        raise ValueError("no RLD and no MD available")
    if not s.md_available:
        return PathChoice("relay", "no MD available")
    if s.relay_load is None:
        return PathChoice("main", "no RLD available")
    hit = f"{s.md_cached_tokens or 0}/{s.prompt_tokens} tokens cached on MD"
    capacity = policy.relay_max_load if s.relay_capacity is None else s.relay_capacity
    t, d = s.transfer_s, s.relay_decode_s
    room = s.relay_kv_room
    fits = room is None or s.prompt_tokens <= room  # else RLD's KV pool would queue it
    short = s.max_new_tokens <= policy.singular_max_new
    if short and t is not None and d is not None and d * policy.margin < t:
        # The KV would cross for nothing: no WAN for answers RLD makes alone.
        if fits and s.relay_load < policy.relay_only_share * capacity:
            why = f"singular: RLD finishes in ~{d:.2f}s, before the KV (~{t:.2f}s)"
            if s.wan_stale:
                # RLD still answers first; MD gets the KV so that the link is measured again.
                return PathChoice("pdd", f"{why}; WAN estimate stale: MD fed to measure")
            return PathChoice("relay", why)
    ttft = direct_ttft(s)
    if ttft is not None and ttft <= policy.ttft_sla_s:
        return PathChoice("main", f"meets the SLA: {hit}, first token in ~{ttft:.2f}s on P->MD")
    when = "unknown" if ttft is None else f"~{ttft:.2f}s"
    if policy.guard and s.relay_load >= capacity:
        return PathChoice("main", f"RLD full ({s.relay_load}/{capacity}): {hit}, P->MD at {when}")
    if policy.guard and room is not None and not fits:
        why = f"RLD's KV full (room for {max(room, 0)} tokens)"
        return PathChoice("main", f"{why}: {hit}, P->MD at {when}")
    base = direct_ttft_base(s)
    if base is not None and base <= policy.ttft_sla_s:
        # P and the suffix's KV alone would meet it: what P->MD's first tokens took lately
        # beyond them (MD's queue, a busy link) is what misses it, not the hit.
        why = f"P->MD slow lately (+{s.main_extra_s:.2f}s)"
        return PathChoice("pdd", f"{why}: {hit}, first token on P->MD {when}: RLD hides it")
    return PathChoice("pdd", f"low hit: {hit}, first token on P->MD {when}: RLD hides it")


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
