"""MainDecode (MD): park requests whose KV has landed, then take over from RelayDecode.

MD is an SGLang decode server. A request the router sends with a `pdd.route` hint (`park`)
receives its prompt KV from P as usual, but instead of decoding it waits ("parks") holding its
KV, and MD tells the router READY. The router answers with the tokens RelayDecode has produced:
- CHUNK (Catch-Up handoff): MD computes their KV in an extend and stays parked.
- HANDOFF (Extend-Decode handoff): MD computes the KV of the remaining tokens but the last, sets
  the request's output to all handed-over tokens and lets SGLang's decode path continue exactly
  as for a request whose KV came from P: the last token is the next decode input.
- CANCEL: the request finished on RelayDecode; MD frees it.

MD also tells every router that asks (SYNC_REQUEST) what its radix cache holds (CACHE_SYNC,
pdd.cache.reporter), so the router knows MD's cached prefix of a request before sending it.

A step's chunks and handoffs are one extend batch that SGLang's own loop runs, with or without
its overlap scheduler (pdd.srt.handoff_extend). At TP > 1 every rank runs the same extends in the
same step: TP rank 0 owns the control socket and its messages reach the other ranks through
SGLang's request broadcast (pdd.srt.control_rank).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

import msgspec
import torch
import zmq

from pdd.cache.reporter import CacheReporter
from pdd.control.channel import ControlSocket
from pdd.control.messages import (
    Ack,
    Cancel,
    Chunk,
    ControlError,
    Error,
    Handoff,
    Message,
    Ready,
    RouteHint,
    parse_route_hint,
)
from pdd.control.ports import rank_control_port
from pdd.srt.cache_events import install
from pdd.srt.control_rank import ControlBatch, Gatherer
from pdd.srt.flags import PddConfig
from pdd.srt.handoff_attention import HandoffAttention
from pdd.srt.handoff_extend import Flight, Parked, Work, extend_batch, join_decoding, land
from pdd.srt.idle import waiter

logger = logging.getLogger(__name__)
STATS_LOG_S = 30.0  # MD logs its counters at most this often, when they changed
MAX_EARLY_CANCELS = 10_000  # bounds what CANCELs for unknown requests can make MD remember


@dataclass
class Stats:
    parked: int = 0
    handoffs: int = 0
    chunks: int = 0
    cancelled: int = 0
    timed_out: int = 0
    extend_tokens: int = 0
    extend_forwards: int = 0
    rejected_messages: int = 0


class MainDecode:
    """Per-scheduler state of an MD server: one per TP rank, all in step (see control_rank).

    With DP attention each DP rank is its own MainDecode (its own waiting queue, KV pool and
    radix cache): its attention-TP rank 0 binds the control port plus the DP rank, and its
    messages reach the ranks of its attention-TP group only, through the same broadcast.
    """

    def __init__(self, scheduler: Any, config: PddConfig) -> None:
        from sglang.srt.runtime_context import get_parallel
        from sglang.utils import TypeBasedDispatcher

        self.scheduler = scheduler
        self.config = config
        # The ranks that share this scheduler's waiting queue (all TP ranks without DP attention).
        self.tp = scheduler.attn_tp_group
        self.leader = self.tp.rank_in_group == 0
        self.dp_rank = int(get_parallel().attn_dp_rank)
        self.parked: dict[str, Parked] = {}
        # CANCELs that arrived before the request's KV did: rid -> (reason, when).
        self.early_cancels: dict[str, tuple[str, float]] = {}
        self.inbox: list[ControlBatch] = []  # this step's control input, the same on every rank
        self.flights: deque[Flight] = deque()  # handoff extends SGLang's loop is running
        self.aborted: set[str] = set()  # aborted while their extend was running
        self.unsent: ControlBatch | None = None  # rank 0: gathered, not yet back from SGLang
        self.stats = Stats()
        self.stats_logged = Stats()
        self.stats_logged_at = 0.0
        self.kv_bytes_per_token = _kv_bytes_per_token(scheduler)
        backend = scheduler.model_worker.model_runner.attn_backend
        self.attention = HandoffAttention(backend, config.extend_kernel)
        # SGLang dispatches what its request broadcast carries by type; ours goes to `receive`.
        scheduler._request_dispatcher += TypeBasedDispatcher([(ControlBatch, self.receive)])
        self.control = ControlSocket(secret=config.secret(), curve=config.curve())
        self.gatherer = Gatherer(self.control, config.handoff_batch_s)
        self.reporter = CacheReporter(config.cache_block, self.control.send)
        if not self.leader:
            return
        port = rank_control_port(config.control_port or 0, self.dp_rank)
        addr = f"tcp://{config.control_host}:{port}"
        self.control.bind(addr)
        install(scheduler.tree_cache, self.reporter)
        # A control message must wake the scheduler when it waits between transfer polls.
        w = waiter(scheduler)
        if w is not None:
            w.add(self.control.socket)
        sleeper = getattr(scheduler, "idle_sleeper", None)  # --sleep-on-idle
        if sleeper is not None and hasattr(sleeper, "poller"):
            sleeper.poller.register(self.control.socket, zmq.POLLIN)
        wire = "CURVE-encrypted" if config.control_encrypt else "cleartext"
        logger.info("PDD MainDecode: control plane on %s (DP rank %d, attention TP size %d, %s)",
                    addr, self.dp_rank, self.tp.world_size, wire)  # fmt: skip

    def busy(self) -> bool:
        """Holds KV or has control output or input pending: the loop must come round."""
        pending = self.leader and (
            self.reporter.dirty or self.gatherer.waiting() or self.unsent is not None
        )
        return bool(self.parked or self.inbox) or pending

    def send(self, to: str, msg: Message) -> None:
        if self.leader:  # every rank decides the same; one tells the router
            self.control.send(to, msg)

    # -- parking ----------------------------------------------------------------------------

    def take_parkable(self, reqs: list[Any]) -> list[Any]:
        """Parks the requests with a `park` route hint; returns the others. Every request routed
        to MD gets a READY."""
        rest = []
        for req in reqs:
            hint = _route_hint(req)
            if hint is None or hint.role != "main":
                rest.append(req)
                continue
            if not hint.park:  # P -> MD: decodes at once; READY only tells the router the WAN
                self.send(hint.reply_to, self._ready(req))
                rest.append(req)
                continue
            prompt_len = len(req.origin_input_ids)
            parked = Parked(req=req, hint=hint, prompt_len=prompt_len, prefix_len=req.prefix_len)
            self.parked[req.rid] = parked
            self.stats.parked += 1
            early = self.early_cancels.pop(req.rid, None)
            if early is not None:  # RLD finished it: keep the prompt's KV for the next turn
                self.cancel(parked, f"cancelled by the router: {early[0]}")
                self.stats.cancelled += 1
                continue
            self.send(hint.reply_to, self._ready(req))
        return rest

    def _ready(self, req: Any) -> Ready:
        """The request's KV has landed: what crossed the WAN for it."""
        prompt_len = len(req.origin_input_ids)
        cached = int(getattr(req.kv, "cache_protected_len", 0) or 0)
        return Ready(
            rid=req.rid,
            prompt_len=prompt_len,
            cached_len=cached,
            wan_kv_bytes=(prompt_len - cached) * self.kv_bytes_per_token,
            first_token=int(req.output_ids[0]),
        )

    # -- control messages -------------------------------------------------------------------

    def gather(self) -> ControlBatch | None:
        """TP rank 0: this step's control input for every rank, or None when there is none."""
        if not self.leader:
            return None
        # A batch SGLang did not deliver (its receive skipper drops a step's input) goes again.
        batch = self.unsent or ControlBatch()
        batch.messages += self.gatherer.gather(self.reporter.on_sync_request)
        now = time.monotonic()
        limit = self.config.park_timeout_s
        batch.forgotten = [r for r, (_, at) in self.early_cancels.items() if now - at > limit]
        batch.expired = [
            (rid, f"no handoff within {limit:.0f} s of the KV landing on MD")
            for rid, p in self.parked.items()
            if now - p.parked_at > limit
        ]
        self.unsent = batch if batch.messages or batch.expired or batch.forgotten else None
        return self.unsent

    def receive(self, batch: ControlBatch) -> None:
        """Every rank: SGLang's dispatch hands over the broadcast batch; `poll` acts on it."""
        if batch is self.unsent:  # rank 0 gets its own object back
            self.unsent = None
        self.inbox.append(batch)

    def poll(self) -> Any | None:
        """Acts on this step's control input. Returns the handoff extend batch SGLang's loop
        should run this step (see pdd.srt.handoff_extend), or None."""
        work: list[Work] = []
        joining: list[tuple[Parked, tuple[int, ...]]] = []
        later: list[Message] = []  # for requests whose previous extend is still in flight
        seen: set[str] = set()
        busy = self._running()
        batches, self.inbox = self.inbox, []
        for msg in (m for b in batches for m in b.messages):
            # Each step acts at most once per request, after its running extend: the next
            # message for it (a handoff right behind a chunk) waits for the next step.
            rid = getattr(msg, "rid", None)
            if (rid in busy or rid in seen) and isinstance(msg, Chunk | Handoff | Cancel):
                later.append(msg)
                continue
            parked = self._check(msg)
            if parked is None or not isinstance(msg, Chunk | Handoff | Cancel):
                continue
            seen.add(msg.rid)
            if isinstance(msg, Cancel):
                self.cancel(parked, f"cancelled by the router: {msg.reason}")
                self.stats.cancelled += 1
            elif isinstance(msg, Chunk):
                upto = parked.done + len(msg.tokens)
                work.append(Work(parked, upto, _tokens(parked, msg), handoff=False))
            else:
                tokens = _tokens(parked, msg) or (int(parked.req.output_ids[0]),)
                # The last handed-over token has no KV yet: it is the next decode step's input.
                if len(tokens) - 1 > parked.done:
                    work.append(Work(parked, len(tokens) - 1, tokens, handoff=True))
                else:
                    joining.append((parked, tokens))
        if later:
            self.inbox.append(ControlBatch(messages=later))
        for parked, tokens in joining:
            self._join(parked, tokens)
        for batch in batches:  # not those acted on this step: their extend is about to run
            self._expire(batch, busy | seen)
        if self.leader:
            self.reporter.flush()
            self._log_stats()
        return self._launch(work) if work else None

    def _log_stats(self) -> None:
        now = time.monotonic()
        if now - self.stats_logged_at >= STATS_LOG_S and self.stats != self.stats_logged:
            logger.info("PDD MainDecode: %s, parked now %d, cache sync %s, %d blocks held, "
                        "extend attention %s", self.stats, len(self.parked),
                        self.reporter.stats, len(self.reporter.held),
                        self.attention.stats)  # fmt: skip
            self.stats_logged, self.stats_logged_at = replace(self.stats), now

    def _check(self, msg: Message) -> Parked | None:
        if not isinstance(msg, Chunk | Handoff | Cancel):
            rid = getattr(msg, "rid", "-")
            self._reject(None, rid, f"MD does not accept {type(msg).__name__}")
            return None
        parked = self.parked.get(msg.rid)
        if parked is None and isinstance(msg, Cancel):
            # Its KV is still on the way (or it already left): act when it lands.
            if len(self.early_cancels) >= MAX_EARLY_CANCELS:
                self.early_cancels.pop(next(iter(self.early_cancels)))
            self.early_cancels[msg.rid] = (msg.reason, time.monotonic())
            return None
        if parked is None:
            # A late message for a request that already left (finished, cancelled, expired).
            logger.info("PDD: %s for rid %s, which is not parked", type(msg).__name__, msg.rid)
            return None
        if isinstance(msg, Chunk | Handoff):
            reason = _token_problem(parked, msg, self.scheduler.model_config.vocab_size)
            if reason is not None:
                self._reject(parked, msg.rid, reason)
                return None
        return parked

    def _reject(self, parked: Parked | None, rid: str, reason: str) -> None:
        self.stats.rejected_messages += 1
        logger.warning("PDD: rejected control message for %s: %s", rid, reason)
        if parked is not None:
            self.send(parked.hint.reply_to, Error(rid=rid, reason=reason))

    # -- the handoff extend (a batch of SGLang's loop) ---------------------------------------

    def _launch(self, work: list[Work]) -> Any | None:
        """Prepares the extend on every rank; None (the requests failed) if any rank could not,
        e.g. no KV memory left."""
        problem = None
        try:
            flight = extend_batch(self.scheduler, work)
        except Exception as err:
            logger.exception("PDD: preparing the handoff extend failed")
            problem = str(err)
        problem = self._agree(problem)
        if problem is not None:
            self._fail(work, problem)
            return None
        self.stats.extend_forwards += 1
        logger.info("PDD MainDecode: handoff extend forward %d: %d requests, %d tokens",
                    self.stats.extend_forwards, len(work),
                    sum(w.upto - w.parked.done for w in work))  # fmt: skip
        self.flights.append(flight)
        return flight.batch

    def _running(self) -> set[str]:
        """The requests whose handoff extend SGLang's loop is running."""
        return {rid for f in self.flights for rid in f.rids()}

    def launched(self, batch: Any) -> Flight | None:
        """The flight `batch` is, when SGLang is about to run one of MD's extends."""
        last = self.flights[-1] if self.flights else None
        return last if last is not None and last.batch is batch else None

    def run(self, flight: Flight, forward: Callable[[], Any]) -> Any:
        """Runs SGLang's `run_batch` for a handoff extend under MD's attention choice; a rank
        that fails makes every rank fail those requests (when MD takes the result)."""
        from sglang.srt.managers.utils import GenerationBatchResult

        result, problem = None, None
        try:
            with self.attention.active():
                result = forward()
        except Exception as err:
            logger.exception("PDD: handoff extend failed")
            problem = str(err)
        flight.problem = self._agree(problem)
        return GenerationBatchResult() if result is None else result

    def take_result(self, batch: Any, result: Any) -> bool:
        """SGLang hands over a batch's result: True if it was MD's extend (MD handled it)."""
        if not self.flights or not self.flights[0].holds(batch):
            return False
        flight = self.flights.popleft()
        if getattr(result, "copy_done", None) is not None:
            result.copy_done.synchronize()  # the KV is written before the requests move on
        if flight.problem is not None:
            self._fail(flight.work, flight.problem)  # an abort meanwhile is moot: they are gone
            self.aborted.difference_update(flight.rids())
            return True
        self.stats.extend_tokens += sum(w.upto - w.parked.done for w in flight.work)
        land(flight)
        for w in flight.work:
            rid = w.parked.req.rid
            if rid in self.aborted:  # SGLang's abort came while the extend ran
                self.aborted.discard(rid)
                self.cancel(w.parked, "aborted")
                self.stats.cancelled += 1
            elif w.handoff:
                self._join(w.parked, w.tokens)
            else:
                self.stats.chunks += 1
                self.send(w.parked.hint.reply_to, Ack(rid=rid, done=w.upto))
        return True

    def _join(self, parked: Parked, tokens: tuple[int, ...]) -> None:
        del self.parked[parked.req.rid]
        self.stats.handoffs += 1
        self.scheduler.waiting_queue.append(join_decoding(parked, tokens))

    def _fail(self, work: list[Work], problem: str) -> None:
        for w in work:
            reason = f"MD could not compute the handed-over tokens: {problem}"
            self.send(w.parked.hint.reply_to, Error(rid=w.parked.req.rid, reason=reason))
            # A failed extend may have left the KV half written.
            self.cancel(w.parked, reason, keep_kv=False)

    def _agree(self, problem: str | None) -> str | None:
        """None if the step succeeded on every TP rank, else this rank's reason (or another
        rank's failure)."""
        if self.tp.world_size == 1:
            return problem
        flag = torch.tensor([0 if problem else 1], dtype=torch.int32)
        torch.distributed.all_reduce(flag, torch.distributed.ReduceOp.MIN, self.tp.cpu_group)
        return problem or (None if int(flag.item()) else "another TP rank failed the extend")

    # -- leaving without a handoff ----------------------------------------------------------

    def cancel(self, parked: Parked, reason: str, keep_kv: bool = True) -> None:
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        req = parked.req
        del self.parked[req.rid]
        req.prefix_len = parked.prefix_len
        prepare_abort(req, reason, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)
        # The KV crossed the WAN at a price: with the decode radix cache, MD keeps it for the
        # next turn of the conversation (a tree without it ignores the checkpoint) -- unless a
        # failed extend may have left it half written.
        release_kv_cache(req, self.scheduler.tree_cache, checkpoint=keep_kv)

    def abort(self, rid: str, abort_all: bool) -> None:
        """SGLang's own abort (client gone, /abort_request) also reaches parked requests; one
        whose extend is running leaves when MD takes the extend's result."""
        busy = self._running()
        for key in list(self.parked):
            if abort_all or key.startswith(rid):
                if key in busy:
                    self.aborted.add(key)
                    continue
                self.cancel(self.parked[key], "aborted")
                self.stats.cancelled += 1

    def _expire(self, batch: ControlBatch, busy: set[str]) -> None:
        """What rank 0's clock ran out (the same on every rank, unlike the clocks). A request
        whose extend runs is left alone: rank 0 names it again next step if still parked."""
        for rid in batch.forgotten:  # its KV never came (aborted, failed): forget it
            self.early_cancels.pop(rid, None)
        for rid, reason in batch.expired:
            parked = self.parked.get(rid)
            if parked is not None and rid not in busy:
                self.stats.timed_out += 1
                self.cancel(parked, reason)


def _route_hint(req: Any) -> RouteHint | None:
    hints = getattr(req, "kv_hints", None)
    if hints is None:
        return None
    try:
        return parse_route_hint(msgspec.to_builtins(hints))
    except ControlError as e:
        logger.warning("PDD: request %s has a malformed pdd.route hint: %s", req.rid, e)
        return None


def _tokens(parked: Parked, msg: Chunk | Handoff) -> tuple[int, ...]:
    """All handed-over tokens so far: those MD already holds (from chunks) plus the new ones."""
    return (*parked.req.output_ids[: msg.start], *msg.tokens)


def _token_problem(parked: Parked, msg: Chunk | Handoff, vocab_size: int) -> str | None:
    if msg.start != parked.done:
        return f"{type(msg).__name__} starts at {msg.start}, MD holds KV for {parked.done} tokens"
    # RLD's tokens are what the client saw, so they win, even over the first token P sampled for
    # MD (with temperature > 0 P's two prefills may sample differently); they only must exist.
    vocab = vocab_size
    if any(not 0 <= t < vocab for t in msg.tokens):
        return f"a handed-over token is outside the vocabulary (size {vocab})"
    if isinstance(msg, Chunk) and not msg.tokens:
        return "empty chunk"
    budget = parked.req.sampling_params.max_new_tokens
    if budget is not None and msg.start + len(msg.tokens) > budget:
        return f"{msg.start + len(msg.tokens)} tokens exceed max_new_tokens={budget}"
    return None


def _kv_bytes_per_token(scheduler: Any) -> int:
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    return int(sum(item_lens)) // max(pool.page_size, 1)
