"""Handoff policy: mode choice, Catch-Up chunk planning, path choice, load balancing (pure)."""

from __future__ import annotations

import pytest

from pdd.policy import (
    HandoffPolicy,
    Step,
    choose_mode,
    choose_path,
    handoff_blockers,
    handoff_tokens,
    next_step,
    pick_least_loaded,
    relay_finishes,
)


def test_policy_validates() -> None:
    bad_values = [
        {"mode": "fast"},
        {"chunk": 0},
        {"threshold": -1},
        {"auto_max_relay_load": -1},
        {"max_chunks": -1},
        {"finish_on_relay": -1},
    ]
    for bad in bad_values:
        with pytest.raises(ValueError):
            HandoffPolicy(**bad)  # type: ignore[arg-type]


def test_rld_finishes_an_answer_with_few_tokens_left() -> None:
    policy = HandoffPolicy(finish_on_relay=8)
    assert relay_finishes(policy, left=8) and relay_finishes(policy, left=0)
    assert not relay_finishes(policy, left=9)
    assert not relay_finishes(HandoffPolicy(finish_on_relay=0), left=1)


@pytest.mark.parametrize(
    "mode, pending, relay_load, want",
    [
        ("extend", 500, 1, "extend"),
        ("catchup", 500, 100, "catchup"),
        ("catchup", 64, 1, "extend"),  # at the threshold one extend suffices
        ("catchup", 65, 1, "catchup"),
        ("auto", 500, 1, "catchup"),  # RLD idle: let it keep decoding while MD catches up
        ("auto", 500, 4, "catchup"),
        ("auto", 500, 5, "extend"),  # RLD busy: free its slot at once
        ("auto", 10, 1, "extend"),
    ],
)
def test_choose_mode(mode: str, pending: int, relay_load: int, want: str) -> None:
    policy = HandoffPolicy(mode=mode, chunk=64, threshold=64, auto_max_relay_load=4)
    assert choose_mode(policy, pending=pending, relay_load=relay_load) == want


def simulate_catchup(policy: HandoffPolicy, emitted0: int, rate: int) -> list[Step]:
    """RLD makes `rate` tokens per chunk round trip; plan until the final handoff."""
    steps, done, available = [], 0, emitted0
    while True:
        step = next_step(policy, done=done, available=available)
        steps.append(step)
        if step.final:
            return steps
        done = step.end
        available += rate


@pytest.mark.parametrize("emitted0, rate", [(65, 0), (300, 10), (1000, 40), (130, 63)])
def test_catchup_converges_and_covers_every_token_once(emitted0: int, rate: int) -> None:
    policy = HandoffPolicy(mode="catchup", chunk=64, threshold=64)
    steps = simulate_catchup(policy, emitted0, rate)
    # Contiguous, no gaps or overlaps, middle chunks at most `chunk`, the last one the handoff.
    assert steps[0].start == 0
    for a, b in zip(steps, steps[1:], strict=False):
        assert b.start == a.end
    assert all(not s.final and 1 <= s.size <= 64 for s in steps[:-1])
    final = steps[-1]
    assert final.final and 1 <= final.size <= 64
    assert final.end == emitted0 + rate * (len(steps) - 1)


def test_catchup_gives_up_chunking_when_rld_outpaces_it() -> None:
    policy = HandoffPolicy(mode="catchup", chunk=64, threshold=64, max_chunks=8)
    done, available = 0, 200
    for sent in range(8):
        step = next_step(policy, done=done, available=available, chunks_sent=sent)
        assert not step.final
        done, available = step.end, available + 100  # RLD makes more than a chunk per round
    final = next_step(policy, done=done, available=available, chunks_sent=8)
    assert final.final and final == Step(True, done, available)


def test_catchup_never_leaves_the_handoff_empty() -> None:
    policy = HandoffPolicy(mode="catchup", chunk=64, threshold=0)
    assert next_step(policy, done=0, available=1) == Step(True, 0, 1)
    assert next_step(policy, done=0, available=2) == Step(False, 0, 1)
    assert next_step(policy, done=0, available=65) == Step(False, 0, 64)
    assert next_step(policy, done=10, available=10) == Step(True, 10, 10)
    with pytest.raises(ValueError):
        next_step(policy, done=5, available=4)


def test_handoff_tokens() -> None:
    assert handoff_tokens((5, 6, 7), 0, 5) == (5, 6, 7)
    assert handoff_tokens((5, 6, 7), 2, 5) == (7,)
    # Nothing reached the client yet: MD continues from its own copy of P's first token.
    assert handoff_tokens((), 0, 42) == (42,)
    with pytest.raises(ValueError):
        handoff_tokens((5, 6), 2, 5)
    with pytest.raises(ValueError):
        handoff_tokens((5,), 3, 5)


def test_handoff_blockers() -> None:
    assert handoff_blockers({"text": "hi", "sampling_params": {"temperature": 0}}) == []
    assert handoff_blockers({"sampling_params": {"frequency_penalty": 0.0}}) == []
    body = {
        "return_logprob": True,
        "sampling_params": {"presence_penalty": 0.5, "regex": "a+", "min_new_tokens": 3},
    }
    assert handoff_blockers(body) == [
        "return_logprob",
        "presence_penalty",
        "regex",
        "min_new_tokens",
    ]


def test_choose_path() -> None:
    assert choose_path(None, "pdd", []).label == "P->RLD->MD"
    assert choose_path("main", "pdd", []).label == "P->MD"
    assert choose_path("relay", "pdd", []).reason == "requested"
    fallback = choose_path("pdd", "main", ["return_logprob"])
    assert fallback.path == "relay" and "return_logprob" in fallback.reason
    assert choose_path("main", "pdd", ["return_logprob"]).path == "main"
    with pytest.raises(ValueError):
        choose_path("x", "pdd", [])


def test_pick_least_loaded() -> None:
    assert pick_least_loaded([3, 1, 2]) == 1
    assert pick_least_loaded([0, 0, 0], cursor=2) == 2
    assert pick_least_loaded([0, 1, 0], cursor=1) == 2
    with pytest.raises(ValueError):
        pick_least_loaded([])
