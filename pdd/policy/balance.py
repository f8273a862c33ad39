"""Load balancing across instances of one tier (pure)."""

from __future__ import annotations

from collections.abc import Sequence


def pick_least_loaded(loads: Sequence[int | None], cursor: int = 0) -> int:
    """Index of the least-loaded live instance (load None: down); ties go to the first one at or
    after `cursor` (the caller rotates it), so equal instances share the work."""
    n = len(loads)
    order = [(cursor + k) % n for k in range(n) if loads[(cursor + k) % n] is not None]
    if not order:
        raise ValueError("no live instances to choose from")
    return min(order, key=lambda i: loads[i] or 0)


def pick_by_prefix(
    loads: Sequence[int | None], prefixes: Sequence[int], slack: int, cursor: int = 0
) -> int:
    """The instance holding the longest cached prefix of the prompt, among the live ones
    (load not None) within `slack` requests of the least loaded, so a conversation sticks to
    the instance that has its KV without piling work on it. Ties: least loaded, then rotation."""
    live = [i for i, load in enumerate(loads) if load is not None]
    if not live:
        raise ValueError("no live instances to choose from")
    floor = min(loads[i] or 0 for i in live)
    near = [i for i in live if (loads[i] or 0) <= floor + slack]
    n = len(loads)
    rank = {i: (i - cursor) % n for i in near}
    return min(near, key=lambda i: (-prefixes[i], loads[i] or 0, rank[i]))
