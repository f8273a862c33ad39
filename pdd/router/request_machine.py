"""One request's state machine, read in one place: the states a request goes through (named
after DESIGN.md) and every transition, with the event that causes it and the handler that
takes it. The handlers do the I/O (pdd_request: P, RLD and MD's streams, deadlines;
handoff_flow: READY, Catch-Up, the handoff, MD dropping out; resume_flow: the other side
finishing) and call `RequestMachine.enter` at each transition; each tier's own progress is in
`MdState` and `RelayState` (request_types).

    state      the client is fed by    ends with (event -> next state, handler)
    PREFILL    nobody yet              RLD's first token -> RELAY (_on_relay_chunk)
                                       P answered on P->MD -> TRANSFER (_on_prefill)
                                       MD's first token on P->MD -> MAIN (_on_main_chunk)
                                       READY after RLD failed -> READY (_take_over)
    RELAY      RLD                     READY, MD takes over -> READY (_take_over)
    TRANSFER   nobody yet: P's KV      MD's first token -> MAIN (_on_main_chunk)
               crosses to MD
    READY      RLD; MD holds the KV    handoff sent, RLD stopped -> HANDOFF (_handoff)
               (Catch-Up chunks go     MD dropped out, RLD finishes -> RELAY (_md_dead)
               while RLD decodes on)
    HANDOFF    nobody: MD extends      MD's first token -> MAIN (_on_main_chunk)
    MAIN       MD
    RESUME     nobody: P prefills the  the other side's first token -> RELAY or MAIN
               prompt plus the client's
               tokens for the other side
    any but DONE: the side feeding the client (or about to) failed -> RESUME (_resume), once
    any: the final chunk, a failure, the client gone -> DONE (_final, _fail, close)

P->RLD only is PREFILL, RELAY, DONE; P->MD is PREFILL, [TRANSFER,] MAIN, DONE; P->RLD->MD is
PREFILL, RELAY, READY, HANDOFF, MAIN, DONE (READY and HANDOFF within one event in
Extend-Decode mode), or PREFILL, RELAY, DONE when RLD finishes first. Each request's states,
with the second each began, are in its `meta_info["pdd"]["states"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class State(Enum):
    PREFILL = "prefill"
    RELAY = "relay"
    TRANSFER = "transfer"
    READY = "ready"
    HANDOFF = "handoff"
    MAIN = "main"
    RESUME = "resume"
    DONE = "done"


_S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    _S.PREFILL: frozenset({_S.RELAY, _S.TRANSFER, _S.MAIN, _S.READY, _S.RESUME, _S.DONE}),
    _S.RELAY: frozenset({_S.READY, _S.RESUME, _S.DONE}),
    _S.TRANSFER: frozenset({_S.MAIN, _S.RESUME, _S.DONE}),
    _S.READY: frozenset({_S.HANDOFF, _S.RELAY, _S.DONE}),
    _S.HANDOFF: frozenset({_S.MAIN, _S.RESUME, _S.DONE}),
    _S.MAIN: frozenset({_S.RESUME, _S.DONE}),
    _S.RESUME: frozenset({_S.RELAY, _S.MAIN, _S.DONE}),
    _S.DONE: frozenset(),
}


class IllegalTransition(Exception):
    pass


@dataclass
class RequestMachine:
    state: State = State.PREFILL
    # (state, seconds since the request arrived) for each state entered, the first included.
    history: list[tuple[str, float]] = field(default_factory=lambda: [(State.PREFILL.value, 0.0)])

    def enter(self, state: State, now_s: float) -> None:
        """Moves to `state` (staying put is no transition). A move the table does not allow is a
        bug in a handler: the state is entered all the same, since the handler has acted, and
        IllegalTransition tells the caller to report it."""
        if state is self.state:
            return
        before, self.state = self.state, state
        self.history.append((state.value, round(now_s, 6)))
        if state not in TRANSITIONS[before]:
            raise IllegalTransition(f"{before.value} -> {state.value}")
