"""Cache sync as pure logic: MD's reporter, the wire format, the router's mirror.

Real MD servers reporting their radix trees are tested in test_main_decode and test_decode_cache.
"""

from __future__ import annotations

import random

import pytest

import pdd.cache.reporter as reporter_module
from pdd.cache.blocks import block_hashes, pack, unpack
from pdd.cache.mirror import CacheMirror
from pdd.cache.reporter import CacheReporter
from pdd.control.messages import CacheSync, ControlError, Message, SyncRequest, decode, encode
from pdd.router.md_caches import MdCaches

B = 4
ROUTER = "tcp://10.0.0.1:7000"
MD = "tcp://10.0.0.2:7001"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Wire:
    """MD -> router over encode/decode, so every message also passes the wire checks."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def __call__(self, addr: str, msg: Message) -> int:
        data = encode(msg)
        self.sent.append((addr, decode(data)))
        return len(data)

    def take(self) -> list[Message]:
        out = [m for _, m in self.sent]
        self.sent.clear()
        return out


def make(clock: Clock) -> tuple[CacheReporter, Wire]:
    wire = Wire()
    return CacheReporter(B, wire, flush_s=0.05, now=clock), wire


def feed(mirror: CacheMirror, msgs: list[Message]) -> list[bool]:
    return [mirror.apply(m) for m in msgs if isinstance(m, CacheSync)]


def subscribe(rep: CacheReporter, mirror: CacheMirror, wire: Wire) -> None:
    rep.on_sync_request(SyncRequest(ROUTER, MD, mirror.epoch or "none", mirror.seq))
    assert all(feed(mirror, wire.take()))


def test_block_hashes_name_whole_prefixes() -> None:
    a = list(range(20))
    b = [*a[:8], 99, *a[9:]]
    ha, hb = block_hashes(a, B), block_hashes(b, B)
    assert len(ha) == 5
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))
    assert block_hashes(a[:19], B) == ha[:4]  # a partial block has no hash
    assert block_hashes(a, B, start_block=3) == ha[3:]
    assert block_hashes(a, B, namespace="lora-1") != ha
    assert unpack(pack(ha)) == ha


def test_mirror_follows_stores_removals_and_clears() -> None:
    clock = Clock()
    rep, wire = make(clock)
    mirror = CacheMirror(now=clock)
    subscribe(rep, mirror, wire)
    turn1 = list(range(100, 130))  # 30 tokens: 7 blocks
    rep.stored(turn1, 0)
    clock.t += 0.1
    rep.flush()
    assert all(feed(mirror, wire.take()))
    assert mirror.cached_prefix([*turn1, 1, 2, 3]) == 28
    turn2 = [*turn1, *range(500, 510)]
    rep.stored(turn2, 30)  # a child node: tokens 30..39
    rep.removed(turn2, 30)  # evicted in the same batch: nothing of it reaches the router
    rep.removed(turn1, 12)  # the tail of turn 1 evicted: blocks ending after token 12
    clock.t += 0.1
    rep.flush()
    assert all(feed(mirror, wire.take()))
    assert mirror.cached_prefix(turn2) == 12
    rep.cleared()
    clock.t += 0.1
    rep.flush()
    assert all(feed(mirror, wire.take()))
    assert mirror.cached_prefix(turn1) == 0 and mirror.hashes == set()


def test_changes_are_batched_not_sent_per_token() -> None:
    clock = Clock()
    rep, wire = make(clock)
    mirror = CacheMirror(now=clock)
    subscribe(rep, mirror, wire)
    for i in range(50):
        rep.stored(list(range(i * 1000, i * 1000 + 40)), 0)
        rep.flush()  # within flush_s of the last: held back
    assert wire.take() == []
    clock.t += 0.1
    rep.flush()
    msgs = wire.take()
    assert len(msgs) == 1 and all(feed(mirror, msgs))
    assert len(mirror.hashes) == 50 * 10


def test_a_late_router_gets_a_snapshot_and_a_gap_forces_one() -> None:
    clock = Clock()
    rep, wire = make(clock)
    prompts = [[random.Random(i).randrange(1000) for _ in range(40)] for i in range(5)]
    for p in prompts:
        rep.stored(p, 0)
    clock.t += 0.1
    rep.flush()  # nobody subscribed yet
    mirror = CacheMirror(now=clock)
    subscribe(rep, mirror, wire)
    assert all(mirror.cached_prefix(p) == 40 for p in prompts)
    # A delta lost on the way: the next one leaves a gap and the mirror stops predicting.
    rep.stored(list(range(7000, 7040)), 0)
    clock.t += 0.1
    rep.flush()
    wire.take()
    rep.stored(list(range(8000, 8040)), 0)
    clock.t += 0.1
    rep.flush()
    assert feed(mirror, wire.take()) == [False]
    assert mirror.stale and mirror.cached_prefix(prompts[0]) == 0
    subscribe(rep, mirror, wire)  # what the router does on a gap
    assert not mirror.stale and mirror.cached_prefix(list(range(7000, 7040))) == 40


def test_a_restarted_md_is_a_new_epoch_and_starts_empty() -> None:
    clock = Clock()
    rep, wire = make(clock)
    mirror = CacheMirror(now=clock)
    subscribe(rep, mirror, wire)
    rep.stored(list(range(40)), 0)
    clock.t += 0.1
    rep.flush()
    feed(mirror, wire.take())
    assert mirror.cached_prefix(list(range(40))) == 40
    restarted, wire2 = make(clock)
    assert restarted.epoch != rep.epoch
    restarted.stored(list(range(900, 940)), 0)  # a delta before the router re-subscribed
    restarted.subscribers[ROUTER] = (MD, clock())
    clock.t += 0.1
    restarted.flush()
    assert feed(mirror, wire2.take()) == [False]  # another epoch, not a snapshot
    assert mirror.cached_prefix(list(range(40))) == 0 and mirror.hashes == set()
    subscribe(restarted, mirror, wire2)
    assert mirror.epoch == restarted.epoch and mirror.resyncs >= 1
    assert mirror.cached_prefix(list(range(900, 940))) == 40


def test_heartbeats_keep_an_up_to_date_mirror_as_is() -> None:
    clock = Clock()
    rep, wire = make(clock)
    mirror = CacheMirror(now=clock)
    subscribe(rep, mirror, wire)
    rep.on_sync_request(SyncRequest(ROUTER, MD, mirror.epoch, mirror.seq))
    msgs = wire.take()
    assert len(msgs) == 1 and isinstance(msgs[0], CacheSync)
    assert msgs[0].added == b"" and not msgs[0].cleared and rep.stats.heartbeats == 1


def test_big_snapshots_and_deltas_come_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reporter_module, "MAX_SYNC_HASHES", 7)
    clock = Clock()
    rep, wire = make(clock)
    prompts = [list(range(i * 100, i * 100 + 20)) for i in range(6)]  # 6 x 5 blocks
    for p in prompts:
        rep.stored(p, 0)
    mirror = CacheMirror(now=clock)
    subscribe(rep, mirror, wire)
    assert all(mirror.cached_prefix(p) == 20 for p in prompts)
    more = [list(range(5000 + i * 100, 5000 + i * 100 + 20)) for i in range(3)]
    for p in more:
        rep.stored(p, 0)
    clock.t += 0.1
    rep.flush()
    msgs = wire.take()
    assert len(msgs) == 3 and all(feed(mirror, msgs))
    assert all(mirror.cached_prefix(p) == 20 for p in prompts + more)


def test_silent_subscribers_are_dropped() -> None:
    clock = Clock()
    rep, wire = make(clock)
    subscribe(rep, CacheMirror(now=clock), wire)
    clock.t += rep.subscriber_ttl_s + 1
    rep.stored(list(range(8)), 0)
    rep.flush()
    assert wire.take() == [] and rep.subscribers == {}


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"added": b"\x00" * 7}, "multiple of 8"),
        ({"block": 0}, "block must be in"),
        ({"epoch": ""}, "epoch must be"),
        ({"cleared": 1}, "cleared must be a bool"),
        ({"name": "x" * 200}, "rid must have"),
    ],
)
def test_bad_cache_sync_is_rejected(body: dict, reason: str) -> None:
    from tests.test_control_messages import pack

    good = {"name": MD, "epoch": "e1", "seq": 1, "block": 4, "cleared": False,
            "added": b"", "removed": b""}  # fmt: skip
    with pytest.raises(ControlError, match=reason):
        decode(pack("cache_sync", {**good, **body}))


def test_router_view_goes_cold_when_md_is_silent() -> None:
    clock = Clock()
    sent: list[tuple[str, Message]] = []
    caches = MdCaches([MD], lambda a, m: sent.append((a, m)) or 1, ROUTER, 5.0, now=clock)
    rep, wire = make(clock)
    caches.ask(MD)
    assert isinstance(sent[-1][1], SyncRequest) and sent[-1][1].epoch == "none"
    rep.on_sync_request(sent[-1][1])  # type: ignore[arg-type]
    rep.stored(list(range(40)), 0)
    clock.t += 0.1
    rep.flush()
    for m in wire.take():
        caches.on_sync(m)  # type: ignore[arg-type]
    assert caches.cached_prefix(MD, list(range(40))) == 40
    clock.t += 16  # three intervals without a word from MD
    assert caches.cached_prefix(MD, list(range(40))) == 0 and not caches.status()[MD]["fresh"]
    caches.on_sync(CacheSync("tcp://elsewhere:1", "e", 1, 4, True, b"", b""))
    assert caches.unknown == 1


def test_md_answers_are_heard_and_their_round_trip_kept() -> None:
    clock = Clock()
    heard: list[int] = []
    caches = MdCaches([MD], lambda a, m: 1, ROUTER, 5.0, now=clock, on_heard=heard.append)
    caches.ask(MD)
    clock.t += 90.0  # MD was still starting: its first answer says nothing of the link
    caches.on_sync(CacheSync(MD, "e1", 0, 4, True, b"", b""))
    assert heard == [0] and caches.status()[MD]["sync_reply_p99_s"] is None
    caches.ask(MD)
    clock.t += 4.0  # the ask waited behind KV in the link's queue
    caches.ask(MD)  # asked again before the answer: the round trip counts from the first ask
    clock.t += 0.25
    caches.on_sync(CacheSync(MD, "e1", 1, 4, False, b"\x01" * 8, b""))  # a delta, not an answer
    assert heard == [0, 0] and caches.status()[MD]["sync_reply_p99_s"] is None
    clock.t += 0.25
    caches.on_sync(CacheSync(MD, "e1", 1, 4, False, b"", b""))  # the heartbeat answering
    assert heard == [0, 0, 0]
    assert caches.status()[MD]["sync_reply_p99_s"] == pytest.approx(4.5)
    caches.ask(MD)
    clock.t += 60.0  # MD cut off: reported silent, its unanswered ask forgotten
    caches.report_silence(MD)
    caches.on_sync(CacheSync(MD, "e1", 1, 4, False, b"", b""))
    assert caches.status()[MD]["sync_reply_p99_s"] == pytest.approx(4.5)


def test_unreachable_and_surplus_subscribers_are_dropped() -> None:
    clock = Clock()
    sent: list[str] = []
    rep = CacheReporter(B, lambda addr, msg: 0 if addr.endswith(":1") else sent.append(addr) or 9,
                        now=clock)  # fmt: skip
    rep.on_sync_request(SyncRequest("tcp://gone:1", MD, "none", 0))
    for i in range(40):
        rep.on_sync_request(SyncRequest(f"tcp://r{i}:2", MD, "none", 0))
    assert len(rep.subscribers) == reporter_module.MAX_SUBSCRIBERS
    assert "tcp://gone:1" not in rep.subscribers and "tcp://r39:2" in rep.subscribers
    rep.subscribers["tcp://gone:1"] = (MD, clock())
    rep.stored(list(range(8)), 0)
    clock.t += 1
    rep.flush()
    assert "tcp://gone:1" not in rep.subscribers  # its delta was dropped: unsubscribed
