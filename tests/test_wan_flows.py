"""pdd.srt.wan_flows: the flows of each KV write, chosen per peer, on a modelled link (one flow
carries half its window per round trip; the line caps the sum). The real writes are measured by
eval/bench_wan_mooncake.py on the testbed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdd.srt import wan_transfer
from pdd.srt.wan_flows import START_FLOWS, FlowChooser, fixed_flows
from pdd.srt.wan_write import MAX_FLOWS

PEER = "10.0.0.2:17000"
WRITE = 64 << 20


class Link:
    def __init__(self, mbit: float, rtt_s: float, window: int) -> None:
        self.rate, self.rtt_s, self.window = mbit * 1e6 / 8, rtt_s, window

    def seconds(self, nbytes: int, flows: int) -> float:
        return nbytes / min(self.rate, flows * self.window / (2 * self.rtt_s))


def settle(link: Link, writes: int = 8, fixed: int | None = None) -> tuple[FlowChooser, list[int]]:
    clock = [0.0]
    chooser = FlowChooser(fixed, link.window, rtt=lambda s: link.rtt_s, now=lambda: clock[0])
    used = []
    for _ in range(writes):
        write = chooser.begin(PEER)
        clock[0] += link.seconds(WRITE, write.flows)
        chooser.end(write, WRITE, ok=True)
        used.append(write.flows)
    return chooser, used


@pytest.mark.parametrize(
    ("link", "flows"),
    [
        (Link(100, 0.04, 64 << 10), MAX_FLOWS),  # high BDP, capped window: as many as allowed
        (Link(100, 0.002, 64 << 10), 1),  # low BDP: one flow fills it
        (Link(100, 0.04, 64 << 20), 1),  # uncapped: more flows would only overrun the queue
    ],
)
def test_each_link_shape_gets_the_flows_it_needs(link: Link, flows: int) -> None:
    chooser, used = settle(link)
    assert used[0] == START_FLOWS and used[-3:] == [flows] * 3, used
    assert link.seconds(WRITE, used[-1]) <= 1.05 * min(link.seconds(WRITE, n) for n in range(1, 17))


def test_a_slower_line_is_measured_again() -> None:
    link = Link(100, 0.04, 64 << 10)
    chooser, _ = settle(link)
    assert chooser.status()[PEER]["flows"] == MAX_FLOWS
    link.rate = 20e6 / 8  # the line now carries a fifth: 4 flows' windows cover it twice
    clock = [1000.0]
    chooser.now = lambda: clock[0]
    for _ in range(6):
        write = chooser.begin(PEER)
        clock[0] += link.seconds(WRITE, write.flows)
        chooser.end(write, WRITE, ok=True)
    assert chooser.status()[PEER]["flows"] == 4
    assert chooser.status()[PEER]["line_mbit"] == pytest.approx(20)


def test_only_whole_large_writes_that_ran_alone_teach() -> None:
    link = Link(100, 0.002, 64 << 10)  # one flow would do
    clock = [0.0]
    chooser = FlowChooser(None, link.window, rtt=lambda s: link.rtt_s, now=lambda: clock[0])
    a, b = chooser.begin(PEER), chooser.begin(PEER)  # two requests' KV at once
    clock[0] += 2 * link.seconds(WRITE, START_FLOWS)
    chooser.end(a, WRITE, ok=True)
    chooser.end(b, WRITE, ok=True)
    small = chooser.begin(PEER)  # 1 MiB: TCP start-up, not the line
    clock[0] += 1.0
    chooser.end(small, 1 << 20, ok=True)
    failed = chooser.begin(PEER)
    clock[0] += 0.1
    chooser.end(failed, WRITE, ok=False)
    assert chooser.status()[PEER] == {"flows": START_FLOWS, "rtt_s": 0.002, "line_mbit": None}


def test_a_fixed_number_is_used_as_given() -> None:
    _, used = settle(Link(100, 0.04, 64 << 20), fixed=6)
    assert used == [6] * 8
    assert fixed_flows("auto") is None and fixed_flows("16") == 16
    for bad in ("0", "17", "x"):
        with pytest.raises(ValueError, match="must be 'auto' or in 1-16"):
            fixed_flows(bad)


def test_the_rtt_is_read_at_the_first_writes_end_and_the_second_write_teaches() -> None:
    link = Link(200, 0.004, 256 << 10)  # low BDP: one flow fills it
    clock = [0.0]
    connections: list[str] = []  # the kernel measures an RTT only once a connection exists
    chooser = FlowChooser(None, link.window, now=lambda: clock[0],
                          rtt=lambda s: link.rtt_s if connections else None)  # fmt: skip
    for k in range(2):
        write = chooser.begin(PEER)
        assert write.flows == START_FLOWS
        assert chooser.status()[PEER]["rtt_s"] == (None if k == 0 else link.rtt_s)
        connections.append(PEER)  # the first write opened them
        clock[0] += link.seconds(WRITE, START_FLOWS)
        chooser.end(write, WRITE, ok=True)
        assert chooser.status()[PEER]["rtt_s"] == link.rtt_s  # not RTT_EVERY_S later
    assert chooser.begin(PEER).flows == 1


def test_transfer_threads_starting_at_once_share_one_chooser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's transfer threads make their first KV writes together: each must get the same
    chooser, or a write begun on a replaced one ends on another that never saw its peer."""
    monkeypatch.setattr(wan_transfer, "_chooser", None)

    def slow_flows() -> int | None:
        time.sleep(0.05)  # widens the window between the check and the assignment
        return None

    monkeypatch.setattr(wan_transfer, "flows", slow_flows)
    start = threading.Barrier(8)

    def first_write(_: int) -> FlowChooser:
        start.wait()
        return wan_transfer.chooser()

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(first_write, range(8)))
    assert len({id(c) for c in got}) == 1
