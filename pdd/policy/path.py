"""Which path a request takes: P->RLD->MD ("pdd"), P->RLD ("relay") or P->MD ("main").

Pure functions; automatic selection by prefix hit rate and load comes later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PATHS = ("pdd", "relay", "main")
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


def choose_path(requested: str | None, default: str, blockers: Sequence[str]) -> PathChoice:
    """The request's own `pdd_path`, else the router default; a handoff path with blockers
    falls back to RLD only (P->MD stays: it never hands off)."""
    path = requested or default
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    reason = "requested" if requested else "default"
    if path == "pdd" and blockers:
        return PathChoice("relay", f"handoff unsupported with {', '.join(blockers)}")
    return PathChoice(path, reason)
