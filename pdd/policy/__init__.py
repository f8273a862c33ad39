"""Routing and handoff policy: pure functions shared by the router and the cluster simulator."""

from pdd.policy.balance import pick_least_loaded
from pdd.policy.handoff import HandoffPolicy, Step, choose_mode, handoff_tokens, next_step
from pdd.policy.path import LABELS, PATHS, PathChoice, choose_path, handoff_blockers

__all__ = [
    "LABELS",
    "PATHS",
    "HandoffPolicy",
    "PathChoice",
    "Step",
    "choose_mode",
    "choose_path",
    "handoff_blockers",
    "handoff_tokens",
    "next_step",
    "pick_least_loaded",
]
