"""The allow-list of a /generate request's sampling_params, each key with its check (pure).

Every key SGLang's SamplingParams takes is either on the list, with a type and a range (SGLang's
own, from SamplingParams.verify and normalize, and the model's limits where the router knows
them), or refused naming it. SGLang type-checks these keys at its HTTP door but not their
values: an out-of-range value that SGLang does not verify reaches the scheduler, whose
exception takes the whole server down, so the router refuses it before any tier sees it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from pdd.router.limits import BadRequest, Limits, is_token, show

MAX_STOP = 32  # stop strings, as SGLang's MAX_STOP_COUNT; and stop token ids
MAX_STOP_CHARS = 1000
MAX_STOP_REGEX = 32  # SGLang's MAX_STOP_REGEX_COUNT and MAX_STOP_REGEX_LEN (UTF-8 bytes)
MAX_STOP_REGEX_BYTES = 256
MAX_GRAMMAR_CHARS = 32 * 1024  # a grammar is compiled on P and each decoder: bounded work
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_RANGE = 100.0  # OpenAI's range; a logit moved further is banned or forced already
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"; larger overflows its int32 top-k tensor
MAX_TEMPERATURE = 1e6
INT64 = 2**63
SGLANG_DEFAULT_MAX_NEW = 128  # what SGLang generates when max_new_tokens is left out
GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")

# SamplingParams keys the router refuses, and why (the field is named in every message).
REFUSED = {
    "stream_interval": "is not supported by the PDD router: it relays every token as it comes",
    "custom_params": "is not supported by the PDD router (it feeds custom logit processors)",
    "watermark": "is not supported by the PDD router",
    "choice": "is not supported by the PDD router: use regex",
}


@dataclass(frozen=True)
class Prompt:
    """What the sampling checks need to know of the prompt: its length where known (None for
    a text prompt the router did not tokenize)."""

    tokens: int | None
    limits: Limits


def _field(name: str) -> str:
    return f"sampling_params.{name}"


def _int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: object, low: float, high: float, *, open_low: bool = False) -> None:
    # An int is finite however large (math.isfinite would overflow converting it).
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise BadRequest(_field(name), f"must be a finite number, got {show(value)}")
    if value < low or value > high or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise BadRequest(_field(name), f"is {show(value)}, outside {bracket}{low:g}, {high:g}]")


def _ranged(low: float, high: float, *, open_low: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        _number(name, value, low, high, open_low=open_low)

    return check


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise BadRequest(_field(name), f"must be true or false, got {show(value)}")


def _top_k(name: str, value: object) -> None:
    if not _int(value) or not (value == -1 or 1 <= value <= TOP_K_ALL):
        raise BadRequest(_field(name), f"must be -1 (off) or an integer in [1, {TOP_K_ALL}], "
                                       f"got {show(value)}")  # fmt: skip


def _n(name: str, value: object) -> None:
    if value != 1 or not _int(value):
        raise BadRequest(_field(name), "> 1 is not supported: send n requests")


def _beam_width(name: str, value: object) -> None:
    if value != 1 or not _int(value):
        raise BadRequest(_field(name), "is not supported by the PDD router (no beam search)")


def _seed(name: str, value: object) -> None:
    if not _int(value) or not -INT64 <= value < INT64:
        raise BadRequest(_field(name), f"must be a 64-bit integer, got {show(value)}")


def _strings(name: str, value: object, most: int) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(_field(name), "must be a non-empty string or a list of them")
    if len(items) > most:
        raise BadRequest(_field(name), f"has {len(items)} entries; at most {most}")
    return items


def _stop(name: str, value: object) -> None:
    for s in _strings(name, value, MAX_STOP):
        if len(s) > MAX_STOP_CHARS:
            raise BadRequest(_field(name), f"has a string of {len(s)} characters; at most "
                                           f"{MAX_STOP_CHARS}")  # fmt: skip


# Regex nodes that repeat their content, and what inside one makes matching backtrack
# exponentially on a decoder's output ("(a+)+$", "(a|a)*"): the stop regexes run in the
# decoder's own loop, so one such pattern would stall every request it serves.
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
_AMBIGUOUS = (*_REPEATS, "BRANCH", "GROUPREF", "GROUPREF_EXISTS")


def _nodes(parsed: Any) -> list[tuple[str, Any]]:
    """Every (opcode name, argument) in a parsed regex, depth first."""
    found: list[tuple[str, Any]] = []
    for op, arg in parsed:
        found.append((str(op), arg))
        for part in arg if isinstance(arg, tuple | list) else (arg,):
            if hasattr(part, "data"):  # a SubPattern
                found += _nodes(part)
            elif isinstance(part, list):  # a BRANCH's alternatives
                found += [n for alt in part if hasattr(alt, "data") for n in _nodes(alt)]
    return found


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a stop regex, or None: it must compile and must not nest a
    repetition around another repetition or an alternation (catastrophic backtracking)."""
    import re._parser as sre_parse  # SGLang reads stop regexes with the same parser

    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        return f"is not a valid regular expression: {err}"
    for op, arg in _nodes(parsed):
        if op in ("GROUPREF", "GROUPREF_EXISTS"):
            return "uses a backreference"
        if op in _REPEATS and arg[1] > 1:
            inner = [o for o, _ in _nodes(arg[2])]
            if any(o in _AMBIGUOUS for o in inner):
                return "nests a repetition around a repetition or alternation (exponential)"
    return None


def _stop_regex(name: str, value: object) -> None:
    for pattern in _strings(name, value, MAX_STOP_REGEX):
        size = len(pattern.encode("utf-8", "surrogatepass"))
        if size > MAX_STOP_REGEX_BYTES:
            raise BadRequest(_field(name), f"has a pattern of {size} bytes; at most "
                                           f"{MAX_STOP_REGEX_BYTES}")  # fmt: skip
        problem = regex_problem(pattern)
        if problem is not None:
            raise BadRequest(_field(name), f"{show(pattern)} {problem}")


def _grammar(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise BadRequest(_field(name), f"must be a string, got {type(value).__name__}")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise BadRequest(_field(name), f"has {len(value)} characters; at most "
                                       f"{MAX_GRAMMAR_CHARS}")  # fmt: skip
    if name in ("json_schema", "structural_tag") and value:
        try:
            parsed = json.loads(value)
        except ValueError as err:
            raise BadRequest(_field(name), f"must be JSON text: {err}") from err
        if not isinstance(parsed, dict | bool):
            raise BadRequest(_field(name), "must be a JSON object")
    if name == "regex" and value:
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as err:
            raise BadRequest(_field(name), f"is not a valid regular expression: {err}") from err


CHECKS: dict[str, Callable[[str, Any], None]] = {
    "temperature": _ranged(0, MAX_TEMPERATURE),
    "top_p": _ranged(0, 1, open_low=True),
    "top_k": _top_k,
    "min_p": _ranged(0, 1),
    "frequency_penalty": _ranged(-2, 2),
    "presence_penalty": _ranged(-2, 2),
    "repetition_penalty": _ranged(0, 2, open_low=True),
    "n": _n,
    "beam_width": _beam_width,
    "sampling_seed": _seed,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stop": _stop,
    "stop_regex": _stop_regex,
    **{g: _grammar for g in GRAMMARS},
}
# Checked with the prompt and the model's limits (check_sampling).
_WITH_LIMITS = ("max_new_tokens", "min_new_tokens", "stop_token_ids", "logit_bias")
ALLOWED = frozenset((*CHECKS, *_WITH_LIMITS))


def _token_ids(name: str, value: object, limits: Limits, most: int) -> None:
    vocab = limits.vocab_size
    if not isinstance(value, list) or not all(is_token(t) for t in value):
        raise BadRequest(_field(name), "must be a list of non-negative token ids")
    if len(value) > most:
        raise BadRequest(_field(name), f"has {len(value)} ids; at most {most}")
    if vocab is not None and value and max(value) >= vocab:
        outside = f"has {show(max(value))}, outside the vocabulary [0, {vocab})"
        raise BadRequest(_field(name), outside)


def _logit_bias(value: object, limits: Limits) -> None:
    name, vocab = "logit_bias", limits.vocab_size
    if not isinstance(value, dict):
        raise BadRequest(_field(name), "must be an object of token id -> bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(_field(name), f"has {len(value)} entries; at most {MAX_LOGIT_BIAS}")
    for key, bias in value.items():
        # SGLang reads keys with int(); digits only, so " 5", "+5" and "\u0665" are not ids.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
            raise BadRequest(_field(name), f"key {show(key)} is not a token id")
        if vocab is not None and int(key) >= vocab:
            outside = f"key {show(key)} is outside the vocabulary [0, {vocab})"
            raise BadRequest(_field(name), outside)
        _number(f"{name}[{key!r}]", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)


def _lengths(params: dict[str, Any], prompt: Prompt) -> None:
    """max_new_tokens and min_new_tokens, against each other and the context window."""
    context = prompt.limits.context_tokens
    new = params.get("max_new_tokens")
    if new is not None and not is_token(new):
        problem = f"must be a non-negative integer, got {show(new)}"
        raise BadRequest(_field("max_new_tokens"), problem)
    if context is not None and new is not None:
        # A text prompt has at least one token; SGLang refuses prompt + output > context.
        tokens = prompt.tokens if prompt.tokens is not None else 1
        if tokens + new > context:
            what = f"{prompt.tokens} prompt tokens" if prompt.tokens is not None else "the prompt"
            problem = f"is {show(new)}: with {what}, beyond the model's context window of {context}"
            raise BadRequest(_field("max_new_tokens"), problem)
    least = params.get("min_new_tokens")
    if least is None:
        return
    if not is_token(least):
        problem = f"must be a non-negative integer, got {show(least)}"
        raise BadRequest(_field("min_new_tokens"), problem)
    most = SGLANG_DEFAULT_MAX_NEW if "max_new_tokens" not in params else new
    if most is not None and least > most:
        problem = f"is {show(least)}, above max_new_tokens ({most})"
        raise BadRequest(_field("min_new_tokens"), problem)
    if most is None and context is not None and least >= context:
        problem = f"is {show(least)}, beyond the model's context window of {context}"
        raise BadRequest(_field("min_new_tokens"), problem)


def check_sampling(params: object, prompt: Prompt) -> None:
    """Raises BadRequest naming the first key of `params` that is not allowed or not valid."""
    if not isinstance(params, dict):
        raise BadRequest("sampling_params", "must be an object")
    for name, value in params.items():
        if name in REFUSED:
            if value is not None:
                raise BadRequest(_field(name), REFUSED[name])
            continue
        if name not in ALLOWED:
            raise BadRequest(_field(name), "is not supported by the PDD router")
        if value is None and name == "n":
            # SGLang reads n before its defaults apply: null fails there (a 500).
            raise BadRequest(_field(name), "must be 1, not null")
        if value is None or name in _WITH_LIMITS:
            continue  # null is SGLang's default; the limited ones are checked below
        CHECKS[name](name, value)
    _lengths(params, prompt)
    if params.get("stop_token_ids") is not None:
        _token_ids("stop_token_ids", params["stop_token_ids"], prompt.limits, MAX_STOP)
    if params.get("logit_bias") is not None:
        _logit_bias(params["logit_bias"], prompt.limits)
    grammars = [g for g in GRAMMARS if params.get(g)]
    if len(grammars) > 1:
        raise BadRequest(_field(grammars[1]), f"cannot be combined with {grammars[0]}: one "
                                              f"grammar per request")  # fmt: skip
