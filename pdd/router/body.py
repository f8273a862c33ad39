"""Checks on a client's SGLang-native /generate body (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

from pdd.policy.path import PATHS

# The router sets these per instance; a client value would break the fan-out.
RESERVED = (
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "kv_hints",
)
PATH_FIELD = "pdd_path"
# A test control (the router honours it only with --test-controls): the P->RLD->MD handoff
# happens when the client has exactly this many of RLD's tokens (see pdd.router.hold).
HOLD_FIELD = "pdd_hold_relay"
MAX_STOP = 64  # stop strings or stop token ids per request
MAX_STOP_CHARS = 1000


class BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    """What the served model accepts, where the router knows it (from --tokenizer's model
    directory): token ids below vocab_size, prompt plus output within context_tokens."""

    vocab_size: int | None = None
    context_tokens: int | None = None


@dataclass(frozen=True)
class GenerateRequest:
    body: dict[str, Any]  # what goes to the SGLang servers (minus rid, rooms, stream)
    stream: bool
    path: str | None  # the request's own pdd_path
    hold_relay: int | None = None  # the request's own pdd_hold_relay


def is_token(t: object) -> TypeGuard[int]:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _number(params: dict[str, Any], name: str, low: float, high: float) -> None:
    value = params.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"sampling_params.{name} must be a number")
    if not low <= value <= high:
        raise BadRequest(f"sampling_params.{name} is {value}, outside [{low:g}, {high:g}]")


def _check_sampling(params: dict[str, Any], limits: Limits, prompt_tokens: int | None) -> None:
    """SGLang's own ranges (SamplingParams.verify), checked before any server sees the request,
    plus the context window where known."""
    if (params.get("n") or 1) != 1:
        raise BadRequest("sampling_params.n > 1 is not supported: send n requests")
    for name, low, high in (("temperature", 0, 1e6), ("top_p", 1e-9, 1), ("min_p", 0, 1),
                            ("frequency_penalty", -2, 2), ("presence_penalty", -2, 2),
                            ("repetition_penalty", 0, 2)):  # fmt: skip
        _number(params, name, low, high)
    top_k = params.get("top_k")
    if top_k is not None and (not is_token(top_k) and top_k != -1 or top_k == 0):
        raise BadRequest("sampling_params.top_k must be -1 (off) or a positive integer")
    new = params.get("max_new_tokens")
    if new is not None and not is_token(new):
        raise BadRequest("sampling_params.max_new_tokens must be a non-negative integer")
    context = limits.context_tokens
    if context is not None and prompt_tokens is not None and new is not None:
        if prompt_tokens + new > context:
            raise BadRequest(f"{prompt_tokens} prompt tokens + max_new_tokens {new} exceed the "
                             f"model's context window of {context}")  # fmt: skip
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (not isinstance(stops, list) or len(stops) > MAX_STOP or not all(
        isinstance(x, str) and len(x) <= MAX_STOP_CHARS for x in stops
    )):  # fmt: skip
        raise BadRequest(f"sampling_params.stop must be a string or up to {MAX_STOP} strings "
                         f"of at most {MAX_STOP_CHARS} characters")  # fmt: skip
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP
                                 or not all(_in_vocab(t, limits) for t in stop_ids)):  # fmt: skip
        raise BadRequest(f"sampling_params.stop_token_ids must be up to {MAX_STOP} token ids")


def _in_vocab(t: object, limits: Limits) -> bool:
    return is_token(t) and (limits.vocab_size is None or t < limits.vocab_size)


def parse_generate(body: object, limits: Limits = Limits()) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    reserved = [k for k in RESERVED if k in body]
    if reserved:
        raise BadRequest(f"the router sets {', '.join(reserved)}; leave them out")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("give exactly one of text or input_ids")
    if has_text and not isinstance(body["text"], str):
        if isinstance(body["text"], list):
            raise BadRequest("batch requests are not supported: send one prompt per request")
        raise BadRequest("text must be a string")
    if has_ids:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            raise BadRequest("batch requests are not supported: send one prompt per request")
        if not isinstance(ids, list) or not ids or not all(is_token(t) for t in ids):
            raise BadRequest("input_ids must be a non-empty list of non-negative integers")
        vocab = limits.vocab_size
        if vocab is not None and max(ids) >= vocab:
            raise BadRequest(f"input_ids has {max(ids)}, outside the vocabulary [0, {vocab})")
        context = limits.context_tokens
        if context is not None and len(ids) >= context:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the model's context window is "
                             f"{context}")  # fmt: skip
    params = body.get("sampling_params")
    if params is not None:
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        _check_sampling(params, limits, len(body["input_ids"]) if has_ids else None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    path = body.get(PATH_FIELD)
    if path is not None and path not in PATHS:
        raise BadRequest(f"{PATH_FIELD} must be one of {', '.join(PATHS)}")
    hold = body.get(HOLD_FIELD)
    if hold is not None and (not is_token(hold) or hold < 1):
        raise BadRequest(f"{HOLD_FIELD} must be a positive integer")
    forward = {k: v for k, v in body.items() if k not in (PATH_FIELD, HOLD_FIELD, "stream")}
    return GenerateRequest(forward, stream, path, hold)
