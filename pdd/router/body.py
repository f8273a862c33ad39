"""Checks on a client's SGLang-native /generate body (pure).

An allow-list: every field the router forwards to SGLang is here with a check of its type and
range (SGLang's own, and the model's limits where the router knows them), and anything else is
refused with a 400 naming the field. A value SGLang accepts but cannot serve would otherwise
reach a scheduler whose exception takes the whole server down (P first: it sees every request).
The OpenAI routes build their native body and come through here too. sampling_params:
pdd.router.sampling_checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdd.policy.path import PATHS
from pdd.router.limits import BadRequest, Limits, is_token, show
from pdd.router.sampling_checks import Prompt, check_sampling

__all__ = ["BadRequest", "GenerateRequest", "Limits", "is_token", "parse_generate"]

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
# Top logprobs per position: OpenAI's bound, well inside the 128 a PD prefill can hand its
# decoder (a larger number raises in P's scheduler, which takes P down).
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 64
# SGLang fields the router does not forward, with why where it helps; any other field gets
# "is not supported by the PDD router".
UNSUPPORTED = {
    "input_embeds": "is not supported by the PDD router: send text or input_ids",
    **{f: "is not supported by the PDD router: it serves text-only requests"
       for f in ("image_data", "video_data", "audio_data", "modalities", "mm_hashes",
                 "mm_content_hashes", "video_config", "images_config", "mm_processor_kwargs")},
    **{f: "is not supported by the PDD router: it does not serve LoRA adapters"
       for f in ("lora_path", "lora_id")},
    **{f: "is not supported by the PDD router: its tiers are chosen per request"
       for f in ("session_params", "session_id", "routed_dp_rank", "data_parallel_rank")},
    **{f: "is not supported by the PDD router: the PD servers set it between themselves"
       for f in ("decode_tp_size", "disagg_prefill_dp_rank")},
    "custom_logit_processor": "is not supported by the PDD router",
    "return_hidden_states": "is not supported by the PDD router",
}  # fmt: skip
_BOOLS = ("stream", "return_logprob", "return_text_in_logprobs")


@dataclass(frozen=True)
class GenerateRequest:
    body: dict[str, Any]  # what goes to the SGLang servers (minus rid, rooms, stream)
    stream: bool
    path: str | None  # the request's own pdd_path
    hold_relay: int | None = None  # the request's own pdd_hold_relay


def _prompt(body: dict[str, Any], limits: Limits) -> int | None:
    """Checks text or input_ids; the prompt's length in tokens where known."""
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("text or input_ids", "is required: give exactly one of them")
    if has_text:
        text = body["text"]
        if isinstance(text, list):
            raise BadRequest("text", "is a list: batch requests are not supported, send one "
                                     "prompt per request")  # fmt: skip
        if not isinstance(text, str) or not text:
            raise BadRequest("text", f"must be a non-empty string, got {show(text)}")
        return None
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        raise BadRequest("input_ids", "is a list of lists: batch requests are not supported, "
                                      "send one prompt per request")  # fmt: skip
    if not isinstance(ids, list) or not ids or not all(is_token(t) for t in ids):
        raise BadRequest("input_ids", "must be a non-empty list of non-negative integers")
    vocab = limits.vocab_size
    if vocab is not None and max(ids) >= vocab:
        raise BadRequest("input_ids", f"has {show(max(ids))}, outside the vocabulary [0, {vocab})")
    context = limits.context_tokens
    if context is not None and len(ids) >= context:
        raise BadRequest("input_ids", f"has {len(ids)} tokens; the model's context window is "
                                      f"{context}")  # fmt: skip
    return len(ids)


def _logprobs(body: dict[str, Any], prompt_tokens: int | None, limits: Limits) -> None:
    """return_logprob's companions: bounded so that P's scheduler can serve them."""
    top = body.get("top_logprobs_num")
    if top is not None:
        most = min(MAX_TOP_LOGPROBS, limits.vocab_size or MAX_TOP_LOGPROBS)
        if not is_token(top) or top > most:
            raise BadRequest("top_logprobs_num", f"must be an integer in [0, {most}], got "
                                                 f"{show(top)}")  # fmt: skip
    start = body.get("logprob_start_len")
    if start is not None:
        # -1: output logprobs only; else the prompt position input logprobs start from.
        last = prompt_tokens if prompt_tokens is not None else limits.context_tokens
        ok = isinstance(start, int) and not isinstance(start, bool) and start >= -1
        if not ok or (last is not None and start > last):
            where = "the prompt's length" if last is None else str(last)
            raise BadRequest("logprob_start_len", f"must be -1 or an integer in [0, {where}], "
                                                  f"got {show(start)}")  # fmt: skip
    ids = body.get("token_ids_logprob")
    if ids is not None:
        vocab = limits.vocab_size
        if (not isinstance(ids, list) or not all(is_token(t) for t in ids)
                or len(ids) > MAX_TOKEN_IDS_LOGPROB):  # fmt: skip
            raise BadRequest("token_ids_logprob", f"must be a list of at most "
                                                  f"{MAX_TOKEN_IDS_LOGPROB} token ids")  # fmt: skip
        if vocab is not None and ids and max(ids) >= vocab:
            raise BadRequest("token_ids_logprob", f"has {show(max(ids))}, outside the vocabulary "
                                                  f"[0, {vocab})")  # fmt: skip


NO_LIMITS = Limits()
ALLOWED = frozenset(("text", "input_ids", "sampling_params", *_BOOLS, "top_logprobs_num",
                     "logprob_start_len", "token_ids_logprob", PATH_FIELD, HOLD_FIELD))  # fmt: skip


# The only GenerateReqInput fields whose default is true (every other one's is null or false).
DEFAULT_TRUE = ("log_metrics",)


def parse_generate(body: object, limits: Limits = NO_LIMITS) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body", "must be a JSON object")
    unset = []
    for name, value in body.items():
        if name in RESERVED:
            raise BadRequest(name, "is set by the router: leave it out")
        if name in ALLOWED:
            continue
        if value is None or value is (name in DEFAULT_TRUE):
            # SGLang's default, so it asks for nothing: SGLang's own clients (bench_serving)
            # send e.g. "lora_path": null and "return_routed_experts": false with every request.
            # Dropped, not forwarded.
            unset.append(name)
            continue
        raise BadRequest(name, UNSUPPORTED.get(name, "is not supported by the PDD router"))
    if unset:
        body = {k: v for k, v in body.items() if k not in unset}
    prompt_tokens = _prompt(body, limits)
    for name in _BOOLS:
        # SGLang takes null for each but return_text_in_logprobs (a 400 from the tier).
        value, nullable = body.get(name), name != "return_text_in_logprobs"
        if name in body and not isinstance(value, bool) and (value is not None or not nullable):
            raise BadRequest(name, f"must be true or false, got {show(value)}")
    _logprobs(body, prompt_tokens, limits)
    if body.get("sampling_params") is not None:
        check_sampling(body["sampling_params"], Prompt(prompt_tokens, limits))
    path = body.get(PATH_FIELD)
    if path is not None and path not in PATHS:
        raise BadRequest(PATH_FIELD, f"must be one of {', '.join(PATHS)}, got {show(path)}")
    hold = body.get(HOLD_FIELD)
    if hold is not None and (not is_token(hold) or hold < 1):
        raise BadRequest(HOLD_FIELD, f"must be a positive integer, got {show(hold)}")
    forward = {k: v for k, v in body.items() if k not in (PATH_FIELD, HOLD_FIELD, "stream")}
    return GenerateRequest(forward, body.get("stream") is True, path, hold)
