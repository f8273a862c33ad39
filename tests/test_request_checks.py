"""The router's allow-list of request fields (pdd.router.body, pdd.router.sampling_checks), pure:
every field of SGLang's generate request and sampling parameters is either allowed with a check
or refused, each hostile value is a 400 naming its field, valid requests pass unchanged, and
whatever passes is something SGLang's own checks (its HTTP contract, SamplingParams.verify)
accept too. The same checks run behind the OpenAI routes."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.router.body import ALLOWED, RESERVED, UNSUPPORTED, BadRequest, Limits, parse_generate
from pdd.router.openai_api import OpenAIError, ServedModel
from pdd.router.sampling_checks import ALLOWED as SAMPLING_ALLOWED
from pdd.router.sampling_checks import REFUSED as SAMPLING_REFUSED
from pdd.router.sampling_checks import regex_problem
from pdd.router.tokenizer import load_tokenizer, model_limits
from pdd.srt.request_guard import (
    generate_problem,
    logprobs_problem,
    room_problem,
    token_ids_problem,
)
from tests.hostile_requests import (
    NAN,
    PROMPT,
    SAMPLING_INTERNAL,
    SGLANG_GENERATE_FIELDS,
    edges,
    refused,
)
from tests.test_router_openai import MESSAGES, MODEL, model_dir

VOCAB, CONTEXT = 100, 50
LIMITS = Limits(vocab_size=VOCAB, context_tokens=CONTEXT)

# One valid value for every allowed field: a request using all of them passes unchanged.
VALID_TOP: dict[str, Any] = {
    "input_ids": PROMPT,
    "stream": True,
    "return_logprob": True,
    "return_text_in_logprobs": False,
    "top_logprobs_num": 5,
    "logprob_start_len": 1,
    "token_ids_logprob": [4, 99],
    "pdd_path": "relay",
    "pdd_hold_relay": 3,
}
VALID_SAMPLING: dict[str, Any] = {
    "max_new_tokens": 20,
    "min_new_tokens": 2,
    "stop": ["\n\n", "END"],
    "stop_token_ids": [2, 99],
    "stop_regex": [r"\d{3}$", "(foo|bar)!"],
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "frequency_penalty": -1.5,
    "presence_penalty": 2,
    "repetition_penalty": 1.1,
    "n": 1,
    "beam_width": 1,
    "regex": "(yes|no)",
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "logit_bias": {"5": -100, "6": 2.5},
    "sampling_seed": -(2**63),
}


def refusal(body: object, limits: Limits = LIMITS) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse_generate(body, limits)
    return err.value


def test_every_sglang_field_is_allowed_or_refused_by_name() -> None:
    assert ALLOWED - {"pdd_path", "pdd_hold_relay"} <= set(SGLANG_GENERATE_FIELDS)
    for name in SGLANG_GENERATE_FIELDS:
        if name in ALLOWED:
            assert name in VALID_TOP or name in ("text", "sampling_params"), name
            continue
        err = refusal({"input_ids": PROMPT, name: 1})
        assert err.field == name and str(err).startswith(name), str(err)
        assert ("set by the router" in str(err)) == (name in RESERVED), str(err)
    assert set(UNSUPPORTED) <= set(SGLANG_GENERATE_FIELDS)
    for name in (*SAMPLING_REFUSED, *SAMPLING_INTERNAL, "beam_search", "max_tokens"):
        err = refusal({"input_ids": PROMPT, "sampling_params": {name: 2}})
        assert err.field == f"sampling_params.{name}", str(err)
    assert set(VALID_SAMPLING) == SAMPLING_ALLOWED


def test_valid_requests_pass_unchanged() -> None:
    body = {**VALID_TOP, "sampling_params": VALID_SAMPLING}
    parsed = parse_generate(json.loads(json.dumps(body)), LIMITS)
    router_fields = ("stream", "pdd_path", "pdd_hold_relay")
    assert parsed.body == {k: v for k, v in body.items() if k not in router_fields}
    assert parsed.stream and parsed.path == "relay" and parsed.hold_relay == 3
    for grammar in ("json_schema", "ebnf", "structural_tag"):
        value = '{"type": "object"}' if grammar != "ebnf" else 'root ::= "a" | "b"'
        params = {**VALID_SAMPLING, "regex": None, grammar: value}
        parse_generate({"text": "hi", "sampling_params": params}, LIMITS)
    # Null is SGLang's default for every field; limits unknown: nothing to check them against.
    assert parse_generate({"text": "x", "stream": None, "sampling_params": None}).stream is False
    assert parse_generate({"input_ids": [VOCAB * 9], "top_logprobs_num": 20}).body
    # Unsupported fields at SGLang's default ask for nothing (SGLang's bench_serving sends
    # them): dropped. Any other value of them is refused (the table below).
    client = {"input_ids": PROMPT, "lora_path": None, "return_routed_experts": False,
              "log_metrics": True}  # fmt: skip
    assert parse_generate(client).body == {"input_ids": PROMPT}
    plain = parse_generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None}})
    assert plain.body == {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None}}


@pytest.mark.parametrize("field, body", refused(VOCAB, CONTEXT))
def test_each_hostile_value_is_refused_naming_its_field(field: str, body: Any) -> None:
    err = refusal(body)
    assert err.field == field or err.field.startswith(f"{field}["), (field, str(err))
    assert str(err).startswith(err.field) and len(str(err)) < 300, str(err)


@pytest.mark.parametrize("what, body", edges(VOCAB, CONTEXT))
def test_the_edges_pass_and_sglang_accepts_them(what: str, body: dict[str, Any]) -> None:
    parsed = parse_generate(body, LIMITS)
    sglang_accepts(parsed.body)


def test_text_prompts_are_bounded_by_the_context_too() -> None:
    err = refusal({"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT}})
    assert err.field == "sampling_params.max_new_tokens" and "context window of 50" in str(err)
    parse_generate({"text": "hi", "sampling_params": {"max_new_tokens": CONTEXT - 1}}, LIMITS)
    err = refusal({"text": "hi", "logprob_start_len": CONTEXT + 1})
    assert err.field == "logprob_start_len"


def test_stop_regex_screen() -> None:
    for ok in ["a+", "foo|bar", "(ab)*c", r"\d{3}", "(a|b)+", "[a-z]+\n\n", "</?answer>"]:
        assert regex_problem(ok) is None, ok
    for bad in ["(a+)+$", "(?:x+y)+", "(a*)*", "(?>a+)+", r"(a)\1", "(", "a{2}{3}"]:
        assert regex_problem(bad) is not None, bad


def test_server_guard_names_the_bad_token() -> None:
    assert token_ids_problem([0, 5, 9], 10) is None
    assert token_ids_problem("text", 10) is None  # not ids: SGLang's own checks
    assert "empty" in (token_ids_problem([], 10) or "")
    assert "input_ids[1] is 10, outside the vocabulary [0, 10)" == token_ids_problem([1, 10], 10)
    assert "input_ids[0] is -1" in (token_ids_problem([-1], 10) or "")
    assert "not a token id" in (token_ids_problem([True], 10) or "")


def test_server_guard_refuses_logprob_fields_the_scheduler_dies_of() -> None:
    assert logprobs_problem(True, 20, -1, 1024, disaggregated=True) is None
    assert logprobs_problem(False, 10**9, -5, 1024, disaggregated=True) is None  # ignored
    assert logprobs_problem(True, 1024, 0, 1024, disaggregated=False) is None
    assert "[0, 128]" in (logprobs_problem(True, 200, -1, 1024, disaggregated=True) or "")
    assert "[0, 1024]" in (logprobs_problem(True, 1025, -1, 1024, disaggregated=False) or "")
    assert "top_logprobs_num is -1" in (logprobs_problem(True, -1, -1, 1024, True) or "")
    assert "logprob_start_len is -2" in (logprobs_problem(True, 0, -2, 1024, True) or "")


def test_server_guard_refuses_what_took_a_live_p_down() -> None:
    def req(**fields: Any) -> SimpleNamespace:
        base = {"return_logprob": False, "top_logprobs_num": 0, "logprob_start_len": -1,
                "positional_embed_overrides": None, "sampling_params": {}}  # fmt: skip
        return SimpleNamespace(**{**base, **fields})

    assert generate_problem(req(sampling_params={"top_k": 2**30}), 1024, True) is None
    top_k = generate_problem(req(sampling_params={"top_k": 2**31}), 1024, True)
    assert top_k is not None and top_k.startswith("sampling_params.top_k")
    embeds = req(positional_embed_overrides={"embeds": [], "positions": [5]})
    assert "positional_embed_overrides" in (generate_problem(embeds, 1024, True) or "")
    stop = req(sampling_params={"stop_token_ids": [3, 1029], "min_new_tokens": 2})
    assert "stop_token_ids has 1029" in (generate_problem(stop, 1024, True) or "")
    logprobs = req(return_logprob=True, top_logprobs_num=200)
    assert "top_logprobs_num" in (generate_problem(logprobs, 1024, True) or "")
    # n > 1 sends every sample with one bootstrap room: refused only where rooms exist.
    two = req(sampling_params={"n": 2})
    assert "sampling_params.n is 2" in (generate_problem(two, 1024, True) or "")
    assert generate_problem(two, 1024, False) is None
    assert generate_problem(req(sampling_params={"n": 1}), 1024, True) is None


def test_server_guard_keeps_each_bootstrap_room_to_one_live_request() -> None:
    assert room_problem([7], {5, 6}) is None
    assert room_problem([None], {5}) is None  # SGLang assigns one or refuses it itself
    assert (
        room_problem([5], {5, 6})
        == "bootstrap_room 5 is already in use by a request on this server"
    )
    assert room_problem([1, 2, 1], set()) == "bootstrap_room 1 is given twice in one batch"


# --- whatever the router lets through, SGLang's own checks accept -----------------------------

hostile_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 200),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-3, 2 * VOCAB), max_size=5), st.lists(st.text(max_size=4), max_size=4),
    st.dictionaries(st.sampled_from(["0", "5", "99", "100", "-1", "x"]),
                    st.floats(allow_nan=True) | st.integers(-200, 200), max_size=3),
)  # fmt: skip
TOP_FIELDS = st.sampled_from(sorted(ALLOWED - {"text", "input_ids", "sampling_params"}))
SAMPLING_FIELDS = st.sampled_from(sorted(SAMPLING_ALLOWED))


def sglang_accepts(forwarded: dict[str, Any]) -> None:
    """What SGLang 0.5.23 checks before its scheduler: the HTTP contract and verify()."""
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.sampling.sampling_params import SamplingParams

    GenerateRequest.from_json_value(forwarded)
    params = SamplingParams(**(forwarded.get("sampling_params") or {}))
    params.verify(VOCAB)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(TOP_FIELDS, hostile_values, SAMPLING_FIELDS, hostile_values)
def test_what_passes_sglang_accepts(top: str, value: Any, key: str, param: Any) -> None:
    body = {"input_ids": PROMPT, top: value, "sampling_params": {key: param}}
    try:
        parsed = parse_generate(body, LIMITS)
    except BadRequest as err:
        assert err.field == top or err.field.startswith(f"sampling_params.{key}"), str(err)
        return
    sglang_accepts(parsed.body)


# --- the OpenAI routes: the same checks, the client's own field names -------------------------


@pytest.fixture(scope="module")
def served() -> ServedModel:
    path = model_dir()  # the tiny model: vocabulary 1024, context 4096
    return ServedModel(MODEL, 64, load_tokenizer(path), model_limits(path))


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"seed": 2**64}, "seed"),
        ({"logit_bias": {"5": NAN}}, "logit_bias['5']"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"top_k": 2**40}, "top_k"),
        ({"min_tokens": 500, "max_tokens": 4}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"temperature": NAN}, "temperature"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_openai_requests_get_the_same_checks(
    served: ServedModel, extra: dict[str, Any], param: str
) -> None:
    for translate, body in ((served.chat, {"messages": MESSAGES}),
                            (served.completion, {"prompt": "hi"})):  # fmt: skip
        with pytest.raises(OpenAIError) as err:
            translate({**body, **extra})
        assert err.value.status == 400 and err.value.param == param, err.value.message
        assert err.value.message.startswith(param), err.value.message
        assert err.value.body()["error"]["param"] == param
