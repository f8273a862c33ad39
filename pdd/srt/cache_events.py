"""Feeds MD's radix tree changes to the cache-sync reporter.

SGLang's trees report every node they store or drop to a KV-event recorder (`kv_events`); MD
puts a recorder in front of it that also tells the reporter, then passes each call on, so
SGLang's own KV events (`--kv-events-config`) keep working.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

from pdd.cache.reporter import CacheReporter

logger = logging.getLogger(__name__)


def _path(node: Any) -> tuple[array, int]:
    """The node's full token path from the root, and where the node's own tokens start."""
    keys = []
    cur = node
    while cur is not None and cur.parent is not None:
        keys.append(cur.key.raw_token_ids())
        cur = cur.parent
    path = array("q")
    for key in reversed(keys):
        path.extend(key)
    return path, len(path) - len(keys[0]) if keys else 0


def _on_device(medium: Any) -> bool:
    # Host (CPU) tiers of a hierarchical cache do not hold KV MD can decode from.
    return medium is None or getattr(medium, "name", "GPU") == "GPU"


def _namespace(node: Any) -> str | None:
    key = node.key
    parts = [p for p in (key.extra_key, key.cache_salt) if p]
    return "/".join(parts) or None


class ReportingRecorder:
    def __init__(self, inner: Any, reporter: CacheReporter) -> None:
        self._inner = inner
        self._reporter = reporter

    def record_store(self, node: Any, medium: Any = None, **kwargs: Any) -> None:
        if _on_device(medium):
            path, start = _path(node)
            self._reporter.stored(path, start, _namespace(node))
        self._inner.record_store(node, medium, **kwargs)

    def record_remove(self, node: Any, medium: Any = None, **kwargs: Any) -> None:
        if _on_device(medium):
            path, start = _path(node)
            self._reporter.removed(path, start, _namespace(node))
        self._inner.record_remove(node, medium, **kwargs)

    def record_all_cleared(self, *args: Any, **kwargs: Any) -> None:
        self._reporter.cleared()
        self._inner.record_all_cleared(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def install(tree_cache: Any, reporter: CacheReporter) -> bool:
    """Puts the reporting recorder on the tree (or its core); False if the tree has none."""
    for owner in (getattr(tree_cache, "tree_core", None), tree_cache):
        if owner is not None and hasattr(getattr(owner, "kv_events", None), "record_store"):
            owner.kv_events = ReportingRecorder(owner.kv_events, reporter)
            logger.info("PDD cache sync: reporting %s in %d-token blocks",
                        type(tree_cache).__name__, reporter.block)  # fmt: skip
            return True
    logger.warning("PDD cache sync: %s reports no tree events to Python; MD's cache is not "
                   "reported (routers predict no hit)", type(tree_cache).__name__)  # fmt: skip
    return False
