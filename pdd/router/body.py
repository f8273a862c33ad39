"""Checks on a client's SGLang-native /generate body (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


class BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class GenerateRequest:
    body: dict[str, Any]  # what goes to the SGLang servers (minus rid, rooms, stream)
    stream: bool
    path: str | None  # the request's own pdd_path


def is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def parse_generate(body: object) -> GenerateRequest:
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
    params = body.get("sampling_params")
    if params is not None:
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        if (params.get("n") or 1) != 1:
            raise BadRequest("sampling_params.n > 1 is not supported: send n requests")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    path = body.get(PATH_FIELD)
    if path is not None and path not in PATHS:
        raise BadRequest(f"{PATH_FIELD} must be one of {', '.join(PATHS)}")
    forward = {k: v for k, v in body.items() if k not in (PATH_FIELD, "stream")}
    return GenerateRequest(forward, stream, path)
