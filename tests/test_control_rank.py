"""MD's rank-0 gatherer (pure logic): what each scheduler step's ControlBatch carries."""

from __future__ import annotations

import time

from pdd.control.messages import Cancel, Chunk, Handoff, Message, SyncRequest
from pdd.srt.control_rank import Gatherer


class Inbox:
    """Stands in for the control socket: what arrived since the last drain."""

    def __init__(self) -> None:
        self.queued: list[Message] = []

    def recv_nowait(self) -> list[Message]:
        out, self.queued = self.queued, []
        return out


def gatherer(window_s: float) -> tuple[Gatherer, Inbox, list[Message]]:
    inbox, synced = Inbox(), []
    return Gatherer(inbox, window_s), inbox, synced  # type: ignore[arg-type]


def test_without_a_window_each_step_carries_what_arrived() -> None:
    g, inbox, synced = gatherer(0.0)
    inbox.queued = [Handoff("a", 0, (1,)), Chunk("b", 0, (2,)), Cancel("c", "done")]
    assert g.gather(synced.append) == [Handoff("a", 0, (1,)), Chunk("b", 0, (2,)),
                                       Cancel("c", "done")]  # fmt: skip
    assert g.gather(synced.append) == [] and not g.waiting()


def test_handoffs_wait_for_the_window_then_go_together() -> None:
    g, inbox, synced = gatherer(0.2)
    inbox.queued = [Handoff("a", 0, (1,))]
    assert g.gather(synced.append) == [] and g.waiting()
    inbox.queued = [Handoff("b", 0, (2,)), Chunk("c", 0, (3,))]
    assert g.gather(synced.append) == []
    time.sleep(0.25)
    assert g.gather(synced.append) == [Handoff("a", 0, (1,)), Handoff("b", 0, (2,)),
                                       Chunk("c", 0, (3,))]  # fmt: skip
    assert not g.waiting()


def test_a_cancel_releases_what_is_held_ahead_of_it() -> None:
    g, inbox, synced = gatherer(10.0)
    inbox.queued = [Chunk("a", 0, (1,))]
    assert g.gather(synced.append) == []
    inbox.queued = [Cancel("a", "RLD finished")]
    assert g.gather(synced.append) == [Chunk("a", 0, (1,)), Cancel("a", "RLD finished")]


def test_sync_requests_are_answered_at_once_not_broadcast() -> None:
    g, inbox, synced = gatherer(10.0)
    sync = SyncRequest("tcp://r:1", "tcp://md:2", "none", 0)
    inbox.queued = [sync]
    assert g.gather(synced.append) == [] and synced == [sync] and not g.waiting()
