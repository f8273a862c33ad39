"""MainDecode's handoff extend, as a batch of SGLang's own scheduler loop.

One step's Catch-Up chunks and Extend-Decode handoffs become one EXTEND `ScheduleBatch`: each
request's prompt KV (and the handed-over tokens MD already holds) is its cached prefix, the newly
handed-over tokens are its extend tokens. SGLang's loop runs it like any batch (`run_batch`,
with or without the overlap scheduler); MD takes its result instead of SGLang's prefill result
processing, because the token the extend samples is not wanted: for a chunk MD knows no more
tokens yet, and for a handoff the next decode step's input is the last handed-over token.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from pdd.control.messages import RouteHint


@dataclass
class Parked:
    req: Any  # sglang Req
    hint: RouteHint
    prompt_len: int
    # MD's own radix-cache prefix at admission; SGLang's decode path expects it back.
    prefix_len: int
    parked_at: float = field(default_factory=time.monotonic)
    # Handed-over tokens whose KV MD has computed (Catch-Up chunks).
    done: int = 0


@dataclass
class Work:
    """One request's part of a handoff extend: the KV of tokens [parked.done, upto)."""

    parked: Parked
    upto: int
    tokens: tuple[int, ...]  # every handed-over token so far
    handoff: bool  # an Extend-Decode handoff (decodes afterwards), else a Catch-Up chunk


@dataclass
class Flight:
    """A handoff extend SGLang's loop has been given and whose result MD has not taken yet."""

    batch: Any  # the ScheduleBatch handed to SGLang
    work: list[Work]
    # (cached_tokens, already_computed) per request: the extend's cache accounting would count
    # handed-over tokens as cache hits.
    accounting: list[tuple[int, int]]
    problem: str | None = None

    def rids(self) -> set[str]:
        return {w.parked.req.rid for w in self.work}

    def holds(self, batch: Any) -> bool:
        """Whether `batch` is this extend (SGLang's overlap loop hands back a copy)."""
        reqs = [w.parked.req for w in self.work]
        return (
            batch.forward_mode.is_extend()
            and len(batch.reqs) == len(reqs)
            and all(a is b for a, b in zip(batch.reqs, reqs, strict=True))
        )


def extend_batch(scheduler: Any, work: list[Work]) -> Flight:
    """Prepares the EXTEND batch computing each request's tokens [done, upto)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    accounting = [(w.parked.req.cached_tokens, w.parked.req.already_computed) for w in work]
    for w in work:
        req, parked = w.parked.req, w.parked
        req.output_ids = array("q", w.tokens[: w.upto])
        req.refresh_fill_ids()
        req.prefix_len = parked.prompt_len + parked.done
        req.extend_end = parked.prompt_len + w.upto
    s = scheduler
    batch = ScheduleBatch.init_new(
        [w.parked.req for w in work],
        s.req_to_token_pool,
        s.token_to_kv_pool_allocator,
        s.tree_cache,
        s.model_config,
        False,
        s.spec_algorithm,
    )
    batch.prepare_for_extend()
    return Flight(batch=batch, work=work, accounting=accounting)


def land(flight: Flight) -> None:
    """After the extend ran: MD holds the KV of each request's tokens up to `upto`."""
    for w, (cached, computed) in zip(flight.work, flight.accounting, strict=True):
        w.parked.req.cached_tokens, w.parked.req.already_computed = cached, computed
        w.parked.done = w.upto


def join_decoding(parked: Parked, tokens: tuple[int, ...]) -> Any:
    """Makes a handed-off request look like one whose KV came from P: every handed-over token
    is output, the last (no KV yet) is the next decode step's input. Returns the request."""
    req = parked.req
    req.output_ids = array("q", tokens)
    req.refresh_fill_ids()
    req.prefix_len = parked.prefix_len
    req.extend_end = req.kv.kv_committed_len
    return req
