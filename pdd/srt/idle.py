"""Waiting without spinning.

When SGLang's scheduler has nothing to run but is not idle (KV transfers in flight on P or on a
decode server, MD's parked requests), its loop goes round with `time.sleep(0)`: a whole core per
server for as long as a WAN transfer lasts, taken from the servers that do have work. Servers
with a PDD role wait on their input sockets for a few milliseconds instead, so a new request or
control message still wakes them at once and a finished transfer is seen within one tick.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.flags import PddConfig
from pdd.srt.hooks import Hook

TICK_MS = 5


class Waiter:
    def __init__(self, scheduler: Any) -> None:
        self.poller = zmq.Poller()
        self.sockets = 0
        ipc = getattr(scheduler, "ipc_channels", None)
        self.add(getattr(ipc, "recv_from_tokenizer", None))

    def add(self, socket: zmq.Socket | None) -> None:
        if socket is not None:
            self.poller.register(socket, zmq.POLLIN)
            self.sockets += 1

    def wait(self) -> None:
        if self.sockets:
            self.poller.poll(TICK_MS)
        else:  # a rank without input sockets
            time.sleep(TICK_MS / 1000)


def waiter(scheduler: Any) -> Waiter | None:
    """This scheduler's Waiter, made on first use; None on servers without a PDD role."""
    w = scheduler.__dict__.get("_pdd_waiter")
    if w is None:
        w = Waiter(scheduler) if PddConfig.from_env().role is not None else False
        scheduler._pdd_waiter = w
    return w or None


def _after_on_idle(result: None, scheduler: Any) -> None:
    w = waiter(scheduler)
    # Fully idle: SGLang has just slept (--sleep-on-idle) or must not be slowed down.
    if w is not None and not scheduler.is_fully_idle():
        w.wait()


HOOKS = (Hook("sglang.srt.managers.scheduler.Scheduler.on_idle", _after_on_idle, HookType.AFTER),)
