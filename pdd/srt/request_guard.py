"""Requests SGLang 0.5.23 accepts and its model then dies of, refused in SGLang's own request
validation (`TokenizerManager._validate_one_request`, whose ValueError is the client's 400).

A token id outside [0, vocab) reaches the embedding and raises IndexError in the scheduler,
which takes the whole server down: every later request fails until it is restarted by hand.
An empty prompt has nothing to prefill. Both come only from `input_ids` (text tokenizes into
the vocabulary), so a server reached directly, not only through the router, refuses them.
Likewise the values SGLang type-checks but does not range-check and whose exception in the
scheduler takes the server down (generate_problem). The router refuses all of these itself
(pdd.router.body); this guard is for what reaches a server without it.

A disaggregated server also keys each request's KV transfer by its bootstrap room, so two
requests in flight with one room share a transfer state: P's scheduler raises on the state the
other left ("Unexpected poll state") and dies, or a decoder waits for KV that never comes.
`n > 1` makes exactly that (SGLang sends every sample with the request's room), and so does a
client that reuses a room. Both are refused where SGLang refuses a duplicate request id
(`TokenizerManager._init_req_state`), so a room is unique among a server's live requests.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.hooks import Hook

_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"


def token_ids_problem(input_ids: object, vocab_size: int) -> str | None:
    """Why `input_ids` cannot be prefilled by a model of `vocab_size` tokens, or None."""
    if not isinstance(input_ids, list):
        return None  # SGLang's own checks cover the other shapes
    if not input_ids:
        return "the prompt is empty: give at least one token"
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"input_ids[{i}] is {t!r}, not a token id"
        if not 0 <= t < vocab_size:
            return f"input_ids[{i}] is {t}, outside the vocabulary [0, {vocab_size})"
    return None


# Top logprobs a PD prefill can hand its decoder (SGLang's metadata buffers): more raises in
# P's scheduler after the prefill.
PD_MAX_TOP_LOGPROBS = 128
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"; past 2^31 its int32 top-k tensor overflows


def logprobs_problem(
    return_logprob: object, top: object, start: object, vocab_size: int, disaggregated: bool
) -> str | None:
    """Why a request's logprob fields would crash the scheduler, or None. SGLang checks their
    types only: a negative or huge top_logprobs_num reaches torch.topk, a start below -1 the
    prefill's slicing, and over 128 top logprobs P's transfer buffers."""
    if return_logprob is not True:
        return None  # SGLang ignores them then
    most = min(vocab_size, PD_MAX_TOP_LOGPROBS) if disaggregated else vocab_size
    if isinstance(top, int) and not 0 <= top <= most:
        return f"top_logprobs_num is {top}, outside [0, {most}]"
    if isinstance(start, int) and start < -1:
        return f"logprob_start_len is {start}: give -1 (output only) or a prompt position"
    return None


def generate_problem(obj: Any, vocab_size: int, disaggregated: bool) -> str | None:
    """Why the scheduler would die of this generate request (its ids checked apart), or None.
    The first three each took a live P down in the fuzz (tests/test_hostile_input.py); the
    logprob bounds are where SGLang's own code raises (logprobs_problem)."""
    # Typed Any for SGLang's in-process callers (embedding tensors): from HTTP it is plain JSON,
    # which the scheduler calls .reconstruct() on.
    if getattr(obj, "positional_embed_overrides", None) is not None:
        return "positional_embed_overrides cannot be given over HTTP"
    params = getattr(obj, "sampling_params", None)
    params = params if isinstance(params, dict) else {}
    n = params.get("n")
    if disaggregated and n is not None and n != 1:
        return (f"sampling_params.n is {n!r}: a disaggregated server serves one sample per "
                "bootstrap room; send n requests")  # fmt: skip
    top_k = params.get("top_k")
    if isinstance(top_k, int) and top_k > TOP_K_ALL:
        return f"sampling_params.top_k is {top_k}, above {TOP_K_ALL} (the whole vocabulary)"
    # The min_new_tokens penalty scatters into a vocabulary-wide row at each stop id.
    stop_ids = params.get("stop_token_ids")
    for t in stop_ids if isinstance(stop_ids, list) else ():
        if isinstance(t, int) and not 0 <= t < vocab_size:
            outside = f"outside the vocabulary [0, {vocab_size})"
            return f"sampling_params.stop_token_ids has {t}, {outside}"
    return logprobs_problem(getattr(obj, "return_logprob", None),
                            getattr(obj, "top_logprobs_num", None),
                            getattr(obj, "logprob_start_len", None), vocab_size,
                            disaggregated)  # fmt: skip


def room_problem(rooms: list[object], in_flight: set[int]) -> str | None:
    """Why a request's bootstrap rooms (one per prompt of a batch) cannot be admitted next to
    the live requests' `in_flight` rooms, or None."""
    seen: set[object] = set()
    for room in rooms:
        if room is None:
            continue  # SGLang assigns one (fake transfer) or refuses the request itself
        if room in in_flight:
            return f"bootstrap_room {room} is already in use by a request on this server"
        if room in seen:
            return f"bootstrap_room {room} is given twice in one batch"
        seen.add(room)
    return None


def _disaggregated(manager: Any) -> bool:
    """Whether this TokenizerManager's server is a P or a decoder (its requests carry rooms)."""
    return getattr(manager.disaggregation_mode, "value", "null") != "null"


def _rooms(obj: Any) -> list[object]:
    room = getattr(obj, "bootstrap_room", None)
    return room if isinstance(room, list) else [room]


def _before_init_req_state(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    if not _disaggregated(self):
        return  # no KV transfer, no rooms
    in_flight = {r for state in self.rid_to_state.values() for r in _rooms(state.obj)
                 if isinstance(r, int)}  # fmt: skip
    problem = room_problem(_rooms(obj), in_flight)
    if problem is not None:
        raise ValueError(problem)


def _before_validate_one_request(
    self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any
) -> None:
    # Embedding requests (no generation) go through here too; their ids reach the same table.
    vocab = self.model_config.vocab_size
    problem = token_ids_problem(input_ids, vocab)
    if problem is None and hasattr(obj, "top_logprobs_num"):  # a generate request
        problem = generate_problem(obj, vocab, _disaggregated(self))
    if problem is not None:
        raise ValueError(problem)


HOOKS = (
    Hook(
        f"{_MANAGER}._validate_one_request",
        _before_validate_one_request,
        HookType.BEFORE,
        "(self, obj, input_ids)",
    ),
    Hook(
        f"{_MANAGER}._init_req_state",
        _before_init_req_state,
        HookType.BEFORE,
        "(self, obj, request)",
    ),
)
