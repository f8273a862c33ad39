"""Load balancing across instances of one tier (pure)."""

from __future__ import annotations

from collections.abc import Sequence


def pick_least_loaded(loads: Sequence[int], cursor: int = 0) -> int:
    """Index of the least-loaded instance; ties go to the first one at or after `cursor` (the
    caller rotates it), so equal instances share the work."""
    if not loads:
        raise ValueError("no instances to choose from")
    n = len(loads)
    order = [(cursor + k) % n for k in range(n)]
    return min(order, key=lambda i: loads[i])
