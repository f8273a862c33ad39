"""Handoff policy: Extend-Decode vs Catch-Up, and how Catch-Up cuts the relay's tokens.

Pure functions (no SGLang, no I/O): the live router and the cluster simulator both call them.
Positions count output tokens: position 0 is P's first token. `done` is how many leading output
tokens MD already holds KV for; `available` is how many the client has received from RLD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODES = ("extend", "catchup", "auto")
Mode = Literal["extend", "catchup"]


@dataclass(frozen=True)
class HandoffPolicy:
    mode: str = "auto"  # one of MODES
    chunk: int = 64  # Catch-Up chunk size (tokens per middle extend)
    threshold: int = 64  # hand off in one extend when at most this many tokens are pending
    # `auto` uses Catch-Up only while an RLD runs at most this many relay requests: Catch-Up
    # keeps RLD decoding longer, which a loaded relay pool cannot afford.
    auto_max_relay_load: int = 4
    # If RLD outpaces the chunks, Catch-Up would never converge: after this many middle chunks
    # the rest goes in the final handoff, however long.
    max_chunks: int = 32
    # When MD is ready with at most this many tokens left to produce, RLD finishes the answer
    # itself: a handoff costs MD an extend and the client a WAN round trip, the time of a few
    # RLD tokens. MD keeps the prompt's KV in its cache either way.
    finish_on_relay: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"handoff mode must be one of {MODES}, got {self.mode!r}")
        if self.chunk < 1:
            raise ValueError(f"catch-up chunk must be >= 1, got {self.chunk}")
        if self.threshold < 0:
            raise ValueError(f"catch-up threshold must be >= 0, got {self.threshold}")
        if self.auto_max_relay_load < 0:
            raise ValueError(f"auto max relay load must be >= 0, got {self.auto_max_relay_load}")
        if self.max_chunks < 0:
            raise ValueError(f"max chunks must be >= 0, got {self.max_chunks}")
        if self.finish_on_relay < 0:
            raise ValueError(f"finish on relay must be >= 0, got {self.finish_on_relay}")


def relay_finishes(policy: HandoffPolicy, *, left: int) -> bool:
    """MD is ready and RLD, still decoding, has at most `left` tokens to go: no handoff."""
    return left <= policy.finish_on_relay


def choose_mode(policy: HandoffPolicy, *, pending: int, relay_load: int) -> Mode:
    """How to hand off when MD becomes ready with `pending` tokens to take over, while the
    request's RLD runs `relay_load` relay requests (this one included)."""
    if pending <= policy.threshold or policy.mode == "extend":
        return "extend"
    if policy.mode == "catchup":
        return "catchup"
    return "catchup" if relay_load <= policy.auto_max_relay_load else "extend"


@dataclass(frozen=True)
class Step:
    """One control message to send: a middle CHUNK (final=False) or the HANDOFF (final=True)
    covering output positions [start, end)."""

    final: bool
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def next_step(policy: HandoffPolicy, *, done: int, available: int, chunks_sent: int = 0) -> Step:
    """The next Catch-Up step. A middle chunk always leaves at least one token for the final
    HANDOFF, because MD needs the logits of the last handed-off token to continue decoding."""
    if not 0 <= done <= available:
        raise ValueError(f"need 0 <= done <= available, got done={done} available={available}")
    pending = available - done
    size = min(policy.chunk, pending - 1)
    if pending <= policy.threshold or size < 1 or chunks_sent >= policy.max_chunks:
        return Step(True, done, available)
    return Step(False, done, done + size)


def handoff_tokens(emitted: tuple[int, ...], done: int, first_token: int) -> tuple[int, ...]:
    """The tokens of the final HANDOFF: what the client got from RLD past `done`. When the
    client got nothing yet, MD continues from its own copy of P's first token."""
    if done > len(emitted):
        raise ValueError(f"done={done} exceeds the {len(emitted)} emitted tokens")
    if not emitted:
        return (first_token,)
    tokens = emitted[done:]
    if not tokens:
        raise ValueError("a catch-up chunk consumed every emitted token; nothing left to hand off")
    return tokens
