"""Routing and handoff policy: pure functions shared by the router and the cluster simulator."""

from pdd.policy.balance import pick_least_loaded
from pdd.policy.handoff import (
    HandoffPolicy,
    Step,
    choose_mode,
    handoff_tokens,
    next_step,
    relay_finishes,
)
from pdd.policy.path import (
    DEFAULT_PATHS,
    LABELS,
    PATHS,
    PathChoice,
    PathPolicy,
    Signals,
    auto_path,
    choose_path,
    handoff_blockers,
    transfer_seconds,
)

__all__ = [
    "DEFAULT_PATHS",
    "LABELS",
    "PATHS",
    "HandoffPolicy",
    "PathChoice",
    "PathPolicy",
    "Signals",
    "Step",
    "auto_path",
    "choose_mode",
    "relay_finishes",
    "choose_path",
    "handoff_blockers",
    "handoff_tokens",
    "next_step",
    "pick_least_loaded",
    "transfer_seconds",
]
