"""Waiting without spinning.

When SGLang's scheduler has nothing to run but is not idle (KV transfers in flight on P or on a
decode server, MD's parked requests), its loop goes round with `time.sleep(0)`: a whole core per
server for as long as a WAN transfer lasts, taken from the servers that do have work. Servers
with a PDD role wait on their input sockets for up to a tick instead, so a new request or
control message still wakes them at once. A KV transfer's status change (bootstrapped, sent,
landed, failed: SGLang's `CommonKVManager.update_status`, called from Mooncake's threads)
wakes them too, through an eventfd, so the tick can be long: the loop goes round a few dozen
times a second while it only waits.

Once per stretch of work, when such a server is fully idle again and SGLang's idle leak check
ran (it skips it while a decoder holds deferred KV releases), it logs IDLE_CHECKED: a test that
reads the log for leaks waits for that line instead of sleeping and hoping the check has run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.flags import PddConfig
from pdd.srt.hooks import Hook

logger = logging.getLogger(__name__)

IDLE_CHECKED = "pdd: fully idle after forward %d, SGLang's leak check ran"
TICK_MS = 25  # MD's cache-sync flush rides the loop: a longer tick delays the router's view
FOLLOWER_TICK_MS = 1
_wake_fd: int | None = None


def wake_fd() -> int:
    """This process's eventfd that KV status changes write to (made on first use)."""
    global _wake_fd
    if _wake_fd is None:
        _wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    return _wake_fd


class Waiter:
    def __init__(self, scheduler: Any) -> None:
        self.poller = zmq.Poller()
        self.sockets = 0
        ipc = getattr(scheduler, "ipc_channels", None)
        self.add(getattr(ipc, "recv_from_tokenizer", None))
        self.poller.register(wake_fd(), zmq.POLLIN)

    def add(self, socket: zmq.Socket | None) -> None:
        if socket is not None:
            self.poller.register(socket, zmq.POLLIN)
            self.sockets += 1

    def wait(self) -> None:
        # A rank without input sockets is paced by rank 0 (it blocks in SGLang's broadcast of
        # rank 0's requests), so its own wait only delays it.
        events = dict(self.poller.poll(TICK_MS if self.sockets else FOLLOWER_TICK_MS))
        if wake_fd() in events:
            try:
                os.eventfd_read(wake_fd())
            except BlockingIOError:  # another thread of this process drained it
                pass


def waiter(scheduler: Any) -> Waiter | None:
    """This scheduler's Waiter, made on first use; None on servers without a PDD role."""
    w = scheduler.__dict__.get("_pdd_waiter")
    if w is None:
        w = Waiter(scheduler) if PddConfig.from_env().role is not None else False
        scheduler._pdd_waiter = w
    return w or None


def leak_checked(scheduler: Any) -> bool:
    """Whether a fully idle `on_idle` ran SGLang's leak check: it skips it with hisparse and on
    a decoder holding deferred KV releases (those pages are out of the pool by design)."""
    if scheduler.enable_hisparse:
        return False
    if scheduler.disaggregation_mode != DisaggregationMode.DECODE:
        return True
    return not scheduler.disagg_decode_transfer_queue.has_pending_deferred_releases()


def _after_on_idle(result: None, scheduler: Any) -> None:
    w = waiter(scheduler)
    if w is None:
        return
    if not scheduler.is_fully_idle():
        w.wait()
        return
    # Fully idle: SGLang has just slept (--sleep-on-idle) or must not be slowed down.
    done = scheduler.forward_ct
    if scheduler.__dict__.get("_pdd_idle_checked") != done and leak_checked(scheduler):
        scheduler._pdd_idle_checked = done
        logger.info(IDLE_CHECKED, done)


def _after_update_status(result: None, manager: Any, *args: Any, **kwargs: Any) -> None:
    try:
        os.eventfd_write(wake_fd(), 1)
    except OSError:  # the counter is full: a wake-up is pending anyway
        pass


HOOKS = (
    Hook("sglang.srt.managers.scheduler.Scheduler.on_idle", _after_on_idle, HookType.AFTER,
         "(self)"),
    Hook("sglang.srt.disaggregation.common.conn.CommonKVManager.update_status",
         _after_update_status, HookType.AFTER, "(self, bootstrap_room, status)"),
)  # fmt: skip
