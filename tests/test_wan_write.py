"""pdd.srt.wan_write's pure logic: how a write is cut into pieces, and how the poll loop treats
Mooncake's answers (a scripted engine). Real Mooncake transfers over several flows are in
tests/test_testbed.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

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
    assert piece_size(100, 16) == MIN_PIECE  # a small write stays whole


def test_flows_for_fills_twice_the_bandwidth_delay_product() -> None:
    # 1.5 Gbit/s at 80 ms: 15 MB in flight; 2 MB windows need 15 flows, 64 MB windows one
    assert flows_for(1.5e9, 0.08, 2 * MIB) == 15
    assert flows_for(1.5e9, 0.08, 64 * MIB) == 1
    assert flows_for(100e9, 0.05, 4 * MIB) == MAX_FLOWS  # never more than Mooncake's lanes
    assert flows_for(10e6, 0.04, 64 << 10) == 2  # the demo's scaled link


@dataclass
class ScriptedEngine:
    """Answers transfer_submit_write / transfer_check_status as Mooncake does (batch ids, then
    0 pending, 1 done, -1 failed), after `polls` checks per piece."""

    polls: int = 2
    fail_piece: int | None = None  # this submission's status is -1
    refuse_piece: int | None = None  # this submission returns 0 (not submitted)
    submitted: list[tuple[int, int, int]] = field(default_factory=list)
    checks: dict[int, int] = field(default_factory=dict)
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
        self.checks[batch] += 1
        if self.checks[batch] < self.polls:
            return 0
        del self.checks[batch]
        return -1 if batch - 1 == self.fail_piece else 1


# Twenty 2 MiB blocks (a layer's K or V each, say): smaller than a piece, so twenty entries.
BLOCKS = [(i * 4 * MIB, i * 4 * MIB, 2 * MIB) for i in range(20)]


def test_write_submits_every_piece_and_bounds_what_is_in_flight() -> None:
    engine = ScriptedEngine()
    assert write(engine, "peer", BLOCKS, 2) == 0
    assert engine.submitted == pieces(BLOCKS, 2) == BLOCKS
    assert engine.most_pending == PENDING_PER_FLOW * 2 and not engine.checks


@pytest.mark.parametrize("script", [{"fail_piece": 3}, {"refuse_piece": 3}])
def test_a_failed_piece_fails_the_write_after_every_submitted_one_finished(script: dict) -> None:
    engine = ScriptedEngine(**script)
    assert write(engine, "peer", BLOCKS, 2) == -1
    assert not engine.checks  # nothing left in flight when the write returns
    assert len(engine.submitted) < len(BLOCKS)  # the rest was not sent
