"""A decoder does not give up on a prefill server whose KV keeps arriving.

SGLang's decoders check each prefill server's bootstrap `/health` every few seconds (HTTP, 3 s
read timeout) and, after a few misses in a row, fail every request whose KV that server still
owes them (`CommonKVManager._handle_node_failure`). Across a WAN the answer crosses the same
link as the KV: while KV fills it, the answer waits in the link's queue behind it, misses the
timeout, and a busy line fails the very transfers that fill it (MD gives up, the request
resumes on RLD after a whole prompt's KV crossed for nothing).

So a decoder counts a missed heartbeat only when nothing from that prefill server got through
lately either: if one of its connections from the server's addresses (Mooncake's KV, the
bootstrap's answers) received data within the span the misses took, the server is alive and
the link busy; the misses are forgiven and logged. A server that is gone sends nothing, so it is
still declared failed, at most one span later.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.hooks import Hook
from pdd.srt.tcp_peers import Address, last_received_s, peer_addresses

logger = logging.getLogger(__name__)


def prefill_addresses(manager: Any, bootstrap_addr: str) -> set[Address]:
    """The bootstrap server's host and every rank's address SGLang connected to for it."""
    found = peer_addresses(bootstrap_addr)
    with manager.connection_lock:
        for key, infos in manager.connection_pool.items():
            if key.startswith(bootstrap_addr):
                for info in infos:
                    if info.get("rank_ip"):
                        found |= peer_addresses(f"{info['rank_ip']}:0")
    return found


def _around_handle_node_failure(original: Any, manager: Any, failed_bootstrap_addr: str) -> None:
    span = manager.heartbeat_interval * manager.max_failures
    heard = last_received_s(prefill_addresses(manager, failed_bootstrap_addr))
    if heard is not None and heard < span:
        logger.warning(
            "pdd: %d heartbeats to prefill %s missed, but its data arrived %.1fs ago: the link is "
            "busy, not the server gone; not counted", manager.heartbeat_failures.get(
                failed_bootstrap_addr, 0), failed_bootstrap_addr, heard)  # fmt: skip
        manager.heartbeat_failures[failed_bootstrap_addr] = 0
        return
    original(manager, failed_bootstrap_addr)


HOOKS = (
    Hook("sglang.srt.disaggregation.common.conn.CommonKVManager._handle_node_failure",
         _around_handle_node_failure, HookType.AROUND, "(self, failed_bootstrap_addr)"),
)  # fmt: skip
