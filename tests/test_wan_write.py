"""pdd.srt.wan_write's pure logic: how a write is cut into pieces, and how the poll loop treats
Mooncake's answers (a scripted engine, on a clock that sleeping advances at once): a write
returns only once nothing of it can land any more, or stops the process. Real Mooncake transfers
over several flows are in tests/test_testbed.py; a real failed write to a stalled receiver is in
tests/test_wan_write_engine.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from pdd.srt import tcp_peers
from pdd.srt import wan_write as ww
from pdd.srt.wan_write import (
    MAX_FLOWS,
    MAX_PIECE,
    MIN_PIECE,
    PENDING_PER_FLOW,
    flows_for,
    piece_size,
    pieces,
    write,
)

MIB = 1 << 20


def test_pieces_cover_every_byte_once_in_order() -> None:
    blocks = [(1000, 50_000, 9 * MIB + 7), (20 * MIB, 90 * MIB, 300), (40 * MIB, 0, 2 * MIB)]
    out = pieces(blocks, 4)
    size = piece_size(sum(b[2] for b in blocks), 4)
    assert MIN_PIECE <= size <= MAX_PIECE
    assert all(0 < length <= size for _, _, length in out)
    for src, dst, length in blocks:  # each block's pieces tile it, source and destination alike
        mine = [p for p in out if src <= p[0] < src + length]
        assert sum(p[2] for p in mine) == length
        for a, b in zip(mine, mine[1:], strict=False):
            assert b[0] == a[0] + a[2] and b[1] == a[1] + a[2]
        assert mine[0][:2] == (src, dst)


def test_piece_size_aims_at_one_per_flow_within_bounds() -> None:
    assert piece_size(64 * MIB, 16) == 4 * MIB  # 16 pieces: one per flow
    assert len(pieces([(0, 0, 64 * MIB)], 16)) == 16
    assert piece_size(128 * MIB, 1) == 128 * MIB  # one lane: one piece, one round trip
    assert piece_size(4096 * MIB, 1) == MAX_PIECE
    assert piece_size(100, 16) == MIN_PIECE  # a tiny write stays whole
    assert piece_size(MIB, 16) == 64 << 10  # a suffix of 1 MiB still uses every lane


def test_flows_for_fills_twice_the_bandwidth_delay_product() -> None:
    # 1.5 Gbit/s at 80 ms: 15 MB in flight; 2 MB windows need 15 flows, 64 MB windows one
    assert flows_for(1.5e9, 0.08, 2 * MIB) == 15
    assert flows_for(1.5e9, 0.08, 64 * MIB) == 1
    assert flows_for(100e9, 0.05, 4 * MIB) == MAX_FLOWS  # never more than Mooncake's lanes
    assert flows_for(10e6, 0.04, 64 << 10) == 2  # the demo's scaled link


class FakeTime:
    """Stands in for wan_write's `time`: sleeping advances the clock at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(ww, "time", fake)
    monkeypatch.setattr(tcp_peers, "orphaned_bytes", lambda peers: 0)  # no real sockets here
    for name in ("PDD_WAN_WRITE_WATCHDOG_S", "MC_TRANSFER_TIMEOUT", "MC_TCP_ADMISSION_TIMEOUT_MS",
                 "MC_TCP_STATUS_TIMEOUT_SEC"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return fake


class Stopped(Exception):
    pass


@pytest.fixture
def stops(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """stop_process's calls; the stand-in raises instead of ending pytest."""
    calls: list[tuple[str, str]] = []

    def stop(session: str, why: str) -> None:
        calls.append((session, why))
        raise Stopped

    monkeypatch.setattr(ww, "stop_process", stop, raising=False)
    return calls


Script = dict[int, tuple[float | None, int]]  # submission index: (from when, status)


@dataclass
class ScriptedEngine:
    """Answers transfer_submit_write / transfer_check_status as Mooncake's TCP transport does:
    batch ids, then 0 while the piece runs, 1 finished, -1 failed, and the batch is freed once
    it answered 1 or -1. A piece settles after `polls` checks, or as `script` says: submission
    index -> (clock time from which it answers, status); a time of None never settles."""

    polls: int = 2
    fail_piece: int | None = None  # this submission's status is -1
    refuse_piece: int | None = None  # this submission returns 0 (not submitted)
    script: Script = field(default_factory=dict)
    clock: FakeTime = field(default_factory=FakeTime)
    submitted: list[tuple[int, int, int]] = field(default_factory=list)
    checks: dict[int, int] = field(default_factory=dict)  # the batches not settled yet
    most_pending: int = 0

    def transfer_submit_write(self, session: str, src: int, dst: int, length: int) -> int:
        if len(self.submitted) == self.refuse_piece:
            return 0
        self.submitted.append((src, dst, length))
        batch = len(self.submitted)
        self.checks[batch] = 0
        self.most_pending = max(self.most_pending, len(self.checks))
        return batch

    def transfer_check_status(self, batch: int) -> int:
        assert batch in self.checks, "checked a batch that Mooncake had already freed"
        self.checks[batch] += 1
        if batch - 1 in self.script:
            at, status = self.script[batch - 1]
            if at is None or self.clock.now < at:
                return 0
        elif self.checks[batch] < self.polls:
            return 0
        else:
            status = -1 if batch - 1 == self.fail_piece else 1
        del self.checks[batch]
        return status


# Twenty 2 MiB blocks (a layer's K or V each, say): smaller than a piece, so twenty entries.
BLOCKS = [(i * 4 * MIB, i * 4 * MIB, 2 * MIB) for i in range(20)]
PEER = "192.0.2.7:17000"  # an address, so that nothing is looked up


def test_write_submits_every_piece_and_bounds_what_is_in_flight() -> None:
    engine = ScriptedEngine()
    assert write(engine, PEER, BLOCKS, 2) == 0
    assert engine.submitted == pieces(BLOCKS, 2) == BLOCKS
    assert engine.most_pending == PENDING_PER_FLOW * 2 and not engine.checks


@pytest.mark.parametrize("script", [{"fail_piece": 3}, {"refuse_piece": 3}])
def test_a_failed_piece_fails_the_write_after_every_submitted_one_finished(script: dict) -> None:
    engine = ScriptedEngine(**script)
    assert write(engine, PEER, BLOCKS, 2) == -1
    assert not engine.checks  # nothing left in flight when the write returns
    assert len(engine.submitted) < len(BLOCKS)  # the rest was not sent


def test_a_failure_waits_for_the_pieces_still_in_flight_however_long(clock: FakeTime) -> None:
    """One piece fails at once; the seven beside it settle only after 100 s, long past Mooncake's
    synchronous limit: the write returns -1 then, not before, and sent nothing more."""
    late = ww.deadline_s(sum(b[2] for b in BLOCKS)) + 70
    script: Script = {i: (late, 1) for i in range(PENDING_PER_FLOW * 2)}
    script[2] = (0.0, -1)
    engine = ScriptedEngine(script=script, clock=clock)
    assert write(engine, PEER, BLOCKS, 2) == -1
    assert not engine.checks and clock.now >= late
    assert len(engine.submitted) == PENDING_PER_FLOW * 2


def test_a_slow_write_is_never_given_up_on_a_deadline(clock: FakeTime) -> None:
    """Every piece finishes, but after Mooncake's synchronous limit: that is a success."""
    late = ww.deadline_s(sum(b[2] for b in BLOCKS)) + 70
    engine = ScriptedEngine(script={i: (late, 1) for i in range(len(BLOCKS))}, clock=clock)
    assert write(engine, PEER, BLOCKS, 2) == 0
    assert not engine.checks and len(engine.submitted) == len(BLOCKS)


@pytest.mark.parametrize("failed", [None, 1])
def test_pieces_that_never_settle_stop_the_process_at_the_watchdog(
    clock: FakeTime, monkeypatch: pytest.MonkeyPatch, stops: list, failed: int | None
) -> None:
    monkeypatch.setenv("PDD_WAN_WRITE_WATCHDOG_S", "500")
    script: Script = {i: (None, 0) for i in range(len(BLOCKS))}
    if failed is not None:
        script[failed] = (0.0, -1)
    engine = ScriptedEngine(script=script, clock=clock)
    with pytest.raises(Stopped):
        write(engine, PEER, BLOCKS, 2)
    assert 500 < clock.now < 501
    [(session, why)] = stops
    stuck = PENDING_PER_FLOW * 2 - (failed is not None)
    assert session == PEER and PEER in why and f"{stuck} pieces not settled" in why
    assert f"{BLOCKS[0][2]} bytes {BLOCKS[0][0]:#x}->{BLOCKS[0][1]:#x}" in why
    assert (f"a piece of {BLOCKS[0][2]} bytes failed" in why) == (failed is not None)


def test_after_a_failure_closed_connections_must_drain_first(
    clock: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece that failed for want of an ack can have bytes queued in a closed socket, which the
    kernel still delivers: the write returns once no closed connection holds bytes for the peer."""
    asked: list[set] = []

    def orphaned(peers: set) -> int:
        asked.append(peers)
        return 4096 if clock.now < 50 else 0

    monkeypatch.setattr(tcp_peers, "orphaned_bytes", orphaned)
    assert write(ScriptedEngine(fail_piece=3, clock=clock), PEER, BLOCKS, 2) == -1
    assert clock.now >= 50 and asked[0] == tcp_peers.peer_addresses(PEER)


def test_closed_connections_that_never_drain_stop_the_process(
    clock: FakeTime, monkeypatch: pytest.MonkeyPatch, stops: list
) -> None:
    monkeypatch.setenv("PDD_WAN_WRITE_WATCHDOG_S", "30")
    monkeypatch.setattr(tcp_peers, "orphaned_bytes", lambda peers: 4096)
    with pytest.raises(Stopped):
        write(ScriptedEngine(fail_piece=3, clock=clock), PEER, BLOCKS, 2)
    [(_, why)] = stops
    assert "4096 bytes" in why and 30 < clock.now < 31


def test_a_successful_write_does_not_wait_for_closed_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp_peers, "orphaned_bytes", lambda peers: 4096)  # another write's
    assert write(ScriptedEngine(), PEER, BLOCKS, 2) == 0


def test_the_watchdog_is_well_beyond_mooncakes_own_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    gb = 10**9
    mooncake = ww.ADMISSION_TIMEOUT_S + ww.deadline_s(gb) + ww.PIECE_TIMEOUT_S  # 120 + 31 + 90
    assert ww.watchdog_s(gb) == 2 * mooncake
    monkeypatch.setenv("MC_TCP_ADMISSION_TIMEOUT_MS", "10000")  # as Mooncake reads them
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "5")
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "8")
    assert ww.watchdog_s(gb) == 2 * (10 + 9 + 5)
    monkeypatch.setenv("PDD_WAN_WRITE_WATCHDOG_S", "7.5")
    assert ww.watchdog_s(gb) == 7.5
    monkeypatch.setenv("PDD_WAN_WRITE_WATCHDOG_S", "soon")  # ignored, with a warning
    assert ww.watchdog_s(gb) == 2 * (10 + 9 + 5)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "later")  # every variable read the same way
    assert ww.deadline_s(0) == 30
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "2")  # Mooncake's own floor for a sync write
    assert ww.deadline_s(0) == 5


def test_stop_process_resets_connections_says_why_and_exits_with_its_code() -> None:
    code = (
        "import logging; logging.basicConfig(); from pdd.srt.wan_write import stop_process; "
        "stop_process('127.0.0.1:1', 'KV write to 127.0.0.1:1: 3 pieces not settled')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == ww.STOP_EXIT_CODE, done.stderr
    assert "3 pieces not settled. Stopping this process" in done.stderr
    assert "connections to 127.0.0.1:1 reset; exiting with code" in done.stderr
