"""The router's request state machine (pdd.router.request_machine): the table's shape and how a
move is recorded. Which handler takes which transition is checked on live requests
(tests/test_router_paths.py, `states`)."""

from __future__ import annotations

import pytest

from pdd.router.request_machine import TRANSITIONS, IllegalTransition, RequestMachine, State


def reachable(start: State) -> set[State]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_prefill_and_every_state_can_end() -> None:
    assert reachable(State.PREFILL) == set(State)
    assert all(State.DONE in reachable(s) for s in State)
    assert TRANSITIONS[State.DONE] == frozenset()


def test_a_resume_ends_only_when_a_side_feeds_the_client_or_the_request_ends() -> None:
    # From RESUME only a side's first token (or the end) leads on: never straight to RESUME.
    assert TRANSITIONS[State.RESUME] == {State.RELAY, State.MAIN, State.DONE}


def test_moves_are_recorded_with_their_second_and_staying_put_is_not_a_move() -> None:
    m = RequestMachine()
    for state, t in [(State.RELAY, 0.5), (State.RELAY, 0.6), (State.READY, 1.25),
                     (State.HANDOFF, 1.25), (State.MAIN, 1.5), (State.DONE, 2.0)]:  # fmt: skip
        m.enter(state, t)
    assert m.history == [("prefill", 0.0), ("relay", 0.5), ("ready", 1.25), ("handoff", 1.25),
                         ("main", 1.5), ("done", 2.0)]  # fmt: skip
    assert m.state is State.DONE


def test_a_move_the_table_forbids_is_entered_and_reported() -> None:
    m = RequestMachine(State.MAIN)
    with pytest.raises(IllegalTransition, match="main -> relay"):
        m.enter(State.RELAY, 3.0)
    assert m.state is State.RELAY and m.history[-1] == ("relay", 3.0)
