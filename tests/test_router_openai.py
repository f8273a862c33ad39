"""The router's OpenAI front door: translation both ways (pure, on the tiny model's real
tokenizer), the /v1 routes of an in-process router (no servers behind it), and a live
deployment driven by the `openai` package (tests named `live`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from pdd.eval.client import mirrored_tokens, wait_mirrored
from pdd.router.config import (
    PrefillTarget,
    RelayTarget,
    RouterConfig,
    build_parser,
    config_from_args,
)
from pdd.router.openai_api import (
    CHAT,
    COMPLETION,
    OpenAIError,
    OpenAIFormatter,
    ServedModel,
    finish_reason,
    text_delta,
)
from pdd.router.tokenizer import (
    DEFAULT_MAX_PROMPT_TOKENS,
    RouterTokenizer,
    TokenizerError,
    check_tokenizer_dir,
    default_max_prompt_tokens,
    default_model_name,
    load_tokenizer,
    to_token_ids,
)
from tests.aio_apps import ok_routes, serving, stream_answer
from tests.conftest import running

MODEL = "tiny-pdd"
MESSAGES: list[Any] = [{"role": "user", "content": "Say something about decoding."}]
# The live router honours test controls: a chat held at HOLD of RLD's tokens until MD is ready
# (pdd.router.hold) is handed off there, so its text is stitched from both decoders.
HOLD = 8
HANDED_OFF = {"pdd_path": "pdd", "pdd_hold_relay": HOLD, "ignore_eos": True}


def model_dir() -> Path:
    return Path(os.environ.get("PDD_TINY_MODEL", "models/tiny"))


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return load_tokenizer(model_dir())


@pytest.fixture(scope="module")
def served(tokenizer: RouterTokenizer) -> ServedModel:
    return ServedModel(MODEL, 64, tokenizer)


# --- the tokenizer ------------------------------------------------------------------------------


def test_chat_ids_are_the_templates_generation_prompt(tokenizer: RouterTokenizer) -> None:
    expected = tokenizer.hf.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids == list(expected) and all(type(t) is int for t in ids)


def test_to_token_ids_accepts_what_tokenizers_return() -> None:
    import numpy as np
    from transformers import BatchEncoding

    assert to_token_ids([1, 2]) == [1, 2]
    assert to_token_ids({"input_ids": [3, 4], "attention_mask": [1, 1]}) == [3, 4]
    assert to_token_ids(BatchEncoding({"input_ids": [5]})) == [5]
    assert to_token_ids([[6, 7]]) == [6, 7]
    assert to_token_ids(np.array([8, 9])) == [8, 9]
    with pytest.raises(TokenizerError, match="not token ids"):
        to_token_ids("text")


def test_tokenizer_dir_defaults_and_errors(tmp_path: Path) -> None:
    assert (
        default_max_prompt_tokens(model_dir())
        == json.loads((model_dir() / "config.json").read_text())["max_position_embeddings"]
    )
    assert default_max_prompt_tokens(tmp_path) == DEFAULT_MAX_PROMPT_TOKENS
    assert default_model_name(tmp_path / ".") == tmp_path.name
    with pytest.raises(TokenizerError, match="not a directory"):
        check_tokenizer_dir(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="no tokenizer there"):
        load_tokenizer(tmp_path)


@dataclass
class NoTemplate:
    chat_template: None = None


def test_a_chat_without_a_template_is_a_clear_400() -> None:
    served = ServedModel(MODEL, 64, RouterTokenizer(Path("base-model"), NoTemplate()))
    with pytest.raises(OpenAIError, match="no chat template") as err:
        served.chat({"messages": MESSAGES})
    assert err.value.status == 400


# --- OpenAI -> SGLang-native ------------------------------------------------------------------


def test_chat_request_translates(served: ServedModel, tokenizer: RouterTokenizer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 5,
        "stop": "\n\n",
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "pdd_path": "relay",
        "user": "ignored",
    }
    req = served.chat(body)
    assert req.kind == CHAT and req.model == MODEL and req.include_usage
    g = req.generate
    assert g.stream and g.path == "relay"
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert g.body["input_ids"] == ids and req.prompt_tokens == len(ids)
    assert g.body["sampling_params"] == {
        "max_new_tokens": 7,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 5,
        "stop": ["\n\n"],
        "sampling_seed": 3,
        "ignore_eos": True,
    }
    assert set(g.body) == {"input_ids", "sampling_params"}  # stream and pdd_path are the router's


def test_max_completion_tokens_wins_and_absent_means_unbounded(served: ServedModel) -> None:
    both = served.chat({"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 9})
    assert both.generate.body["sampling_params"]["max_new_tokens"] == 9
    # As SGLang's own OpenAI server: no limit but the context; no model given is fine too.
    plain = served.chat({"messages": MESSAGES, "frequency_penalty": 0.5})
    params = plain.generate.body["sampling_params"]
    assert params == {"max_new_tokens": None, "frequency_penalty": 0.5}
    assert not plain.generate.stream and not plain.include_usage


def test_completion_prompts(served: ServedModel, tokenizer: RouterTokenizer) -> None:
    text = "hello world"
    req = served.completion({"model": MODEL, "prompt": text, "max_tokens": 4})
    assert req.kind == COMPLETION
    # With the tokenizer's special tokens, as SGLang tokenizes a /v1/completions text prompt.
    assert req.generate.body["input_ids"] == tokenizer.hf.encode(text, add_special_tokens=True)
    assert served.completion({"prompt": [text]}).generate.body["input_ids"] == tokenizer.encode(
        text
    )
    assert served.completion({"prompt": [5, 6, 7]}).generate.body["input_ids"] == [5, 6, 7]
    assert served.completion({"prompt": [[5, 6]]}).generate.body["input_ids"] == [5, 6]


@pytest.mark.parametrize(
    "kind, body, reason",
    [
        (CHAT, {}, "messages must be a non-empty list"),
        (CHAT, {"messages": []}, "messages must be a non-empty list"),
        (
            CHAT,
            {"messages": [{"content": "x"}]},
            "messages[0] must be an object with a string role",
        ),
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "only text content",
        ),
        (CHAT, {"messages": MESSAGES, "n": 2}, "n must be 1"),
        (CHAT, {"messages": MESSAGES, "logprobs": True}, "logprobs is not supported"),
        (CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools is not supported"),
        (
            CHAT,
            {"messages": MESSAGES, "response_format": {"type": "json_object"}},
            "response_format is not supported",
        ),
        (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens must be a positive integer"),
        (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "temperature must be a number"),
        (CHAT, {"messages": MESSAGES, "stop": [""]}, "stop must be"),
        (CHAT, {"messages": MESSAGES, "stream": "yes"}, "stream must be true or false"),
        (CHAT, {"messages": MESSAGES, "pdd_path": "sideways"}, "pdd_path must be one of"),
        (CHAT, {"messages": MESSAGES, "model": 7}, "model must be a string"),
        (COMPLETION, {}, "prompt is required"),
        (COMPLETION, {"prompt": ""}, "prompt must not be empty"),
        (COMPLETION, {"prompt": []}, "prompt must not be empty"),
        (COMPLETION, {"prompt": ["a", "b"]}, "batch requests are not supported"),
        (COMPLETION, {"prompt": [[1], [2]]}, "batch requests are not supported"),
        (COMPLETION, {"prompt": [1, -2]}, "list of non-negative token ids"),
        (COMPLETION, {"prompt": "x", "echo": True}, "echo is not supported"),
        (COMPLETION, {"prompt": "x", "logprobs": 2}, "logprobs is not supported"),
        (COMPLETION, ["not", "an", "object"], "must be a JSON object"),
    ],
)
def test_bad_requests_are_clear_400s(
    served: ServedModel, kind: str, body: Any, reason: str
) -> None:
    translate = served.chat if kind == CHAT else served.completion
    with pytest.raises(OpenAIError) as err:
        translate(body)
    assert err.value.status == 400 and reason in err.value.message, err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_in_openais_shape(served: ServedModel) -> None:
    with pytest.raises(OpenAIError) as err:
        served.completion({"model": "gpt-9", "prompt": "x"})
    assert err.value.status == 404
    assert err.value.body() == {
        "error": {
            "message": f"model 'gpt-9' does not exist; this router serves '{MODEL}'",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }


def test_an_oversize_prompt_names_both_numbers(served: ServedModel) -> None:
    with pytest.raises(OpenAIError) as err:
        served.completion({"prompt": list(range(65))})
    assert err.value.status == 400
    assert "65 tokens" in err.value.message and "limit of 64" in err.value.message
    served.completion({"prompt": list(range(64))})  # exactly at the limit: served


def test_models_lists_the_served_model(served: ServedModel) -> None:
    listed = served.models()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [MODEL]


# --- SGLang-native -> OpenAI ------------------------------------------------------------------

PDD = {"path": "P->RLD->MD", "rid": "r1", "relay_tokens": 2, "main_tokens": 1}


def native(text: str, ids: list[int], finish: dict | None, **meta: Any) -> dict[str, Any]:
    info = {"id": "r1", "finish_reason": finish, "prompt_tokens": 99, "completion_tokens": 1}
    return {"text": text, "output_ids": ids, "meta_info": {**info, **meta}}


def test_finish_reasons_map() -> None:
    assert finish_reason({"type": "length", "length": 8}) == "length"
    assert finish_reason({"type": "stop", "matched": 2}) == "stop"
    assert finish_reason({"type": "abort", "message": "x"}) is None


def test_whole_chat_answer() -> None:
    f = OpenAIFormatter(CHAT, MODEL, prompt_tokens=5)
    out = f.whole(native("Hello", [1, 2, 3], {"type": "stop", "matched": 2}, pdd=PDD))
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["id"] == "chatcmpl-r1"
    assert out["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    # Usage from what the client got, not MD's own counts after a handoff.
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert out["pdd"] == PDD


def test_whole_completion_answer_and_abort() -> None:
    f = OpenAIFormatter(COMPLETION, MODEL, prompt_tokens=2)
    out = f.whole(native("ab", [1, 2], {"type": "length", "length": 2}))
    assert out["object"] == "text_completion" and out["id"] == "cmpl-r1"
    assert out["choices"][0]["text"] == "ab" and out["choices"][0]["finish_reason"] == "length"
    assert "pdd" not in out
    with pytest.raises(OpenAIError, match="MD gone") as err:
        f.whole(native("ab", [1, 2], {"type": "abort", "message": "MD gone"}))
    assert err.value.status == 502
    failed = f.failure(native("ab", [1, 2], {"type": "abort", "message": "MD gone"}, pdd=PDD))
    assert failed["error"]["message"] == "MD gone" and failed["pdd"] == PDD


def spelled_out(tokenizer: RouterTokenizer, word: str) -> list[int]:
    """`word` one character per token: what a model may emit, never what the tokenizer makes."""
    ids = [tokenizer.hf.convert_tokens_to_ids(c) for c in word]
    assert tokenizer.decode(ids) == word and tokenizer.encode_rendered(word) != ids
    return ids


def test_a_chat_turn_reuses_the_ids_the_model_generated(tokenizer: RouterTokenizer) -> None:
    """The next turn carries the previous answer as the ids the model generated (MD's cache holds
    those), not as its text tokenized again; only the text after the answer is tokenized."""
    served = ServedModel(MODEL, 4096, tokenizer)
    first = served.chat({"messages": MESSAGES, "stream": True})
    prompt = first.generate.body["input_ids"]
    answer = "decoding"
    generated = spelled_out(tokenizer, answer) + [tokenizer.hf.eos_token_id]
    formatter = first.formatter()
    formatter.stream_chunk(native(answer, generated, {"type": "stop", "matched": 2}))
    assert formatter.sent == answer
    follow_up = [*MESSAGES, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And then?"}]  # fmt: skip
    ids = served.chat({"messages": follow_up}).generate.body["input_ids"]
    fresh = tokenizer.encode_chat(follow_up)
    assert ids[: len(prompt) + len(generated)] == prompt + generated  # EOS = the template's end
    assert tokenizer.decode(ids) == tokenizer.decode(fresh) and ids != fresh
    assert served.chat_ids.stats.reused == 1
    # The turn after reuses this one's answer, spliced ids included (a whole answer, via whole()).
    second = served.chat({"messages": follow_up})
    second.formatter().whole(native("x", [tokenizer.hf.convert_tokens_to_ids("x")], None))
    third = [*follow_up, {"role": "assistant", "content": "x"}, {"role": "user", "content": "?"}]
    ids3 = served.chat({"messages": third}).generate.body["input_ids"]
    assert ids3[: len(ids)] == ids
    # An answer the client changed, or ids that do not spell it, fall back to the text's ids.
    edited = [*MESSAGES, {"role": "assistant", "content": answer + "!"}]
    assert served.chat({"messages": edited}).generate.body["input_ids"] == tokenizer.encode_chat(
        edited
    )
    other = ServedModel(MODEL, 4096, tokenizer)
    wrong = other.chat({"messages": MESSAGES}).formatter()
    wrong.whole(native(answer, spelled_out(tokenizer, "decodinG"), None))
    assert other.chat({"messages": follow_up}).generate.body["input_ids"] == fresh
    assert other.chat_ids.stats.mismatched == 1


def test_text_delta_emits_only_new_suffixes() -> None:
    assert text_delta("ab", "abcd", final=False) == "cd"
    assert text_delta("ab", "xbcd", final=False) == ""  # not an extension: nothing, no garbage
    assert text_delta("ab", "abc\ufffd", final=False) == "c"  # half a character waits
    assert text_delta("ab", "abc\ufffd", final=True) == "c\ufffd"
    assert text_delta("ab", None, final=True) == ""


def stream(f: OpenAIFormatter, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = [e for c in chunks for e in f.stream_chunk(c)]
    return events + f.stream_end()


def test_streamed_chat_deltas_join_to_the_final_text() -> None:
    f = OpenAIFormatter(CHAT, MODEL, prompt_tokens=4, include_usage=True)
    chunks = [
        native("He", [1], None),
        native("Hel\ufffd", [1, 2], None),
        native("Xel", [1, 2], None),  # a re-decoded text that does not extend: skipped
        native("Hello", [1, 2, 3], None),
        native("Hello!", [1, 2, 3, 4], {"type": "length", "length": 4}, pdd=PDD),
    ]
    events = stream(f, chunks)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == "chatcmpl-r1" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
    assert "".join(deltas) == "Hello!" and deltas[1:4] == ["He", "l", "lo"]
    last, usage = events[-2], events[-1]
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert last["pdd"] == PDD and last["usage"] is None
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_streamed_completion_and_no_usage_unless_asked() -> None:
    f = OpenAIFormatter(COMPLETION, MODEL, prompt_tokens=4)
    events = stream(
        f, [native("a", [1], None), native("ab", [1, 2], {"type": "stop", "matched": 2})]
    )
    assert [e["object"] for e in events] == ["text_completion"] * 3
    assert [e["choices"][0]["text"] for e in events] == ["a", "b", ""]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in e for e in events)


def test_a_stream_failing_midway_ends_with_an_error_event() -> None:
    f = OpenAIFormatter(CHAT, MODEL, prompt_tokens=4, include_usage=True)
    abort = {"type": "abort", "message": "RLD failed and MD failed"}
    events = stream(f, [native("a", [1], None), native("ab", [1, 2], abort)])
    assert events[-1]["error"]["message"] == "RLD failed and MD failed"
    assert events[-1]["error"]["code"] == 502
    assert events[-2]["choices"][0]["delta"] == {"content": "b"}  # what it had, then the error


# --- the router's flags -------------------------------------------------------------------------

BASE = ["--prefill", "http://10.0.0.1:30000", "8998", "--relay", "http://10.0.0.1:30001",
        "--main", "http://10.0.0.2:30002", "17000"]  # fmt: skip


def parse(*argv: str) -> RouterConfig:
    return config_from_args(build_parser(argparse.ArgumentParser()).parse_args([*BASE, *argv]))


def test_openai_flags(tmp_path: Path) -> None:
    off = parse()
    assert off.tokenizer is None and off.served_model_name is None
    on = parse(
        "--tokenizer", str(model_dir()), "--served-model-name", "m", "--max-prompt-tokens", "9"
    )
    assert on.tokenizer == model_dir() and on.served_model_name == "m"
    assert on.max_prompt_tokens == 9
    with pytest.raises(ValueError, match="need --tokenizer"):
        parse("--served-model-name", "m")
    with pytest.raises(ValueError, match="--max-prompt-tokens >= 1"):
        parse("--tokenizer", str(model_dir()), "--max-prompt-tokens", "0")
    with pytest.raises(TokenizerError, match="no tokenizer there"):
        parse("--tokenizer", str(tmp_path))


# --- the /v1 routes of an in-process router (nothing behind it) -------------------------------


def call_router(config: RouterConfig, calls: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    from aiohttp.test_utils import TestClient, TestServer

    from pdd.router.app import make_app

    async def run() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(make_app(config))) as client:
            out = []
            for method, path, body in calls:
                resp = await client.request(method, path, json=body)
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(run())


def router_config(**openai: Any) -> RouterConfig:
    nobody = "http://127.0.0.1:9"  # nothing answers there; no request here gets that far
    return RouterConfig(
        prefill=(PrefillTarget(nobody, 9),), relay=(RelayTarget(nobody),), path="relay", **openai
    )


def test_v1_routes_without_servers() -> None:
    config = router_config(tokenizer=model_dir(), served_model_name=MODEL, max_prompt_tokens=16)
    long_prompt = {"model": MODEL, "prompt": list(range(17))}
    answers = call_router(
        config,
        [
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", {"model": "other", "messages": MESSAGES}),
            ("POST", "/v1/completions", long_prompt),
            ("POST", "/v1/chat/completions", {"model": MODEL}),
        ],
    )
    (s1, models), (s2, unknown), (s3, oversize), (s4, empty) = answers
    assert s1 == 200 and models["data"][0]["id"] == MODEL
    assert s2 == 404 and unknown["error"]["code"] == "model_not_found"
    assert s3 == 400 and "limit of 16" in oversize["error"]["message"]
    assert s4 == 400 and "messages" in empty["error"]["message"]


def test_v1_routes_need_a_tokenizer() -> None:
    answers = call_router(
        router_config(),
        [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"})],
    )
    for status, body in answers:
        assert status == 501 and "start the router with --tokenizer" in body["error"]["message"]


# --- the openai package against the router, with a fake P and RLD behind it ---------------------

# RLD's cumulative texts: the second holds half a character, which the third completes.
FAKE_TEXTS = ["Hi", "Hi th\ufffd", "Hi thé", "Hi thé re", "Hi thé re!"]


def fake_sglang() -> Any:
    """P and RLD in one: a non-streamed /generate is P's prefill, a streamed one RLD's decode."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"text": "", "output_ids": [], "meta_info": {}})
        n = min(body["sampling_params"].get("max_new_tokens") or 99, len(FAKE_TEXTS))
        chunks = [{"text": FAKE_TEXTS[i - 1], "output_ids": list(range(10, 10 + i))}
                  for i in range(1, n + 1)]  # fmt: skip
        return await stream_answer(request, body["rid"], chunks)

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app)
    return app


@pytest.fixture(scope="module")
def fake_router() -> Iterator[str]:
    """The real router app in front of fake_sglang(), both on a loop in a thread."""
    from pdd.launch.process import free_port
    from pdd.router.app import make_app

    ports = free_port(), free_port()
    fake = f"http://127.0.0.1:{ports[0]}"
    config = RouterConfig(
        prefill=(PrefillTarget(fake, 9),), relay=(RelayTarget(fake),), path="relay",
        port=ports[1], tokenizer=model_dir(), served_model_name=MODEL,
    )  # fmt: skip
    with serving([(fake_sglang(), ports[0]), (make_app(config), ports[1])]):
        yield f"http://127.0.0.1:{ports[1]}"


def test_openai_client_through_the_router(fake_router: str) -> None:
    api = openai.OpenAI(base_url=f"{fake_router}/v1", api_key="x", max_retries=0)
    whole = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    assert whole.choices[0].message.content == FAKE_TEXTS[-1]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == len(FAKE_TEXTS)
    assert (whole.model_extra or {})["pdd"]["path"] == "P->RLD"
    chunks = list(
        api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == FAKE_TEXTS[-1] and "\ufffd" not in "".join(deltas)
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > len(FAKE_TEXTS)
    text = api.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert text.choices[0].text == FAKE_TEXTS[1] and text.usage is not None
    streamed = api.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == FAKE_TEXTS[2]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.completions.create(model="other", prompt="hello")
    with pytest.raises(openai.BadRequestError, match="not supported"):
        api.completions.create(model=MODEL, prompt="hello", logprobs=2)


# --- live: real servers, driven by the openai package -------------------------------------------


@dataclass
class Live:
    router_url: str
    max_prompt_tokens: int
    kv_per_token: int
    logs: dict[str, Path]  # the router's and MD's


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from pdd.control.secret import write_secret
    from pdd.launch.pdd_deploy import DECODE_CACHE_FLAG
    from pdd.launch.process import free_port
    from pdd.launch.router import RouterService
    from pdd.launch.servers import SGLangServer

    run_dir = tmp_path_factory.mktemp("router_openai")
    # The control plane between router and MD is CURVE-encrypted here (the other live modules
    # run it in cleartext): the handoffs and the cache sync below cross it.
    secret = str(write_secret(run_dir / "control.secret"))
    prefill = SGLangServer("prefill", tiny_model, free_port(), run_dir, mode="prefill",
                           bootstrap_port=free_port())  # fmt: skip
    relay = SGLangServer("relay", tiny_model, free_port(), run_dir, mode="decode")
    # MD keeps its decode radix cache and reports it to the router (cache sync).
    main = SGLangServer(
        "main", tiny_model, free_port(), run_dir, mode="decode",
        extra_args=["--pdd-role", "main", "--pdd-control-port", str(free_port()),
                    DECODE_CACHE_FLAG, "--pdd-secret-file", secret, "--pdd-control-encrypt"],
    )  # fmt: skip
    limit = 512
    router = RouterService(
        "router", free_port(), run_dir, prefill=[prefill], relay=[relay], main=[main],
        extra_args=["--handoff-mode", "extend", "--test-controls",
                    "--tokenizer", str(tiny_model), "--served-model-name", MODEL,
                    "--max-prompt-tokens", str(limit), "--secret-file", secret,
                    "--control-encrypt"],
    )  # fmt: skip
    with running([router, prefill, relay, main]):
        from pdd.models.kv import kv_bytes_per_token

        logs = {s.name: run_dir / f"{s.name}.log" for s in (router, main)}
        yield Live(router.url, limit, kv_bytes_per_token(tiny_model, dtype_bytes=4), logs)


def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.router_url}/v1", api_key="x", max_retries=0)


def test_live_chat_streamed_equals_whole(live: Live, tokenizer: RouterTokenizer) -> None:
    api = client(live)
    whole = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, extra_body=HANDED_OFF
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert 0 < whole.usage.completion_tokens <= 40
    pdd = (whole.model_extra or {})["pdd"]
    assert pdd["path"] == "P->RLD->MD" and pdd["relay_tokens"] == HOLD, pdd
    assert pdd["rid"] in whole.id

    chunks = list(
        api.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=HANDED_OFF,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [choice.finish_reason]
    assert (finals[0].model_extra or {})["pdd"]["path"] == "P->RLD->MD"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Both handoffs above crossed a CURVE-encrypted control plane (READY, then the handoff).
    assert "MainDecode: control plane on" in live.logs["main"].read_text()
    for name, log in live.logs.items():
        wires = [w for w in ("CURVE-encrypted", "cleartext") if w in log.read_text()]
        assert wires == ["CURVE-encrypted"], (name, wires)


def test_live_chat_turns_reuse_what_md_holds(live: Live, tokenizer: RouterTokenizer) -> None:
    """A chat client sends the whole conversation again each turn. MD's decode radix cache holds
    turn 1's prompt and the ids MD generated; the router renders turn 2 with those same ids for
    the answer, predicts that MD holds at least turn 1's prompt, and P sends MD only the KV of
    what follows. (Tokenizing the answer's text again would have given other ids: the random
    tiny model emits token sequences the tokenizer never makes.)"""
    api = client(live)
    system = {"role": "system", "content": "You review Python code."}
    messages: list[Any] = [system, {"role": "user", "content": "What does `for` do?"}]
    extra = {"pdd_path": "main", "ignore_eos": True}  # P->MD: MD surely keeps the answer
    before = mirrored_tokens(live.router_url)
    first = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body=extra
    )
    assert first.usage is not None and first.usage.completion_tokens == 40
    prompt1 = first.usage.prompt_tokens
    answer = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And `while`?"}]  # fmt: skip
    # MD's cache sync reaches the router: what turn 1 added to MD (the prompt MD lacked, the
    # answer but its last token), less a 16-token block at each end.
    held = (first.model_extra or {})["pdd"]["md_cached_tokens"]
    wait_mirrored(live.router_url, before + prompt1 - held + 40 - 1 - 32)
    second = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=extra
    )
    assert second.usage is not None
    meta = (second.model_extra or {})["pdd"]
    prompt2 = second.usage.prompt_tokens
    assert meta["path"] == "P->MD" and meta["md_prompt_tokens"] == prompt2, meta
    # At block granularity (16 tokens), MD holds turn 1's prompt and 40 generated ids.
    held = prompt1 + 40 - 1  # the last generated token has no KV yet
    assert meta["md_predicted_cached_tokens"] >= max(prompt1, held - held % 16), (prompt1, meta)
    assert meta["md_cached_tokens"] >= held, (prompt1, meta)
    suffix = prompt2 - meta["md_cached_tokens"]
    assert meta["wan_kv_bytes"] == suffix * live.kv_per_token, meta
    assert suffix <= prompt2 - prompt1 - 40 + 1, (prompt1, prompt2, meta)
    fresh = tokenizer.encode_chat(messages)
    print(f"turn 2: {prompt2} tokens, MD held {meta['md_cached_tokens']} (predicted "
          f"{meta['md_predicted_cached_tokens']}); the text tokenized again would have been "
          f"{len(fresh)} tokens")  # fmt: skip


def test_live_completion_takes_the_requested_path(live: Live) -> None:
    from pdd.launch.pd_local import generate

    api = client(live)
    prompt = "The router tokenizes prompts itself"
    extra = {"pdd_path": "relay", "ignore_eos": True}
    got = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
    )
    assert got.object == "text_completion" and got.choices[0].finish_reason == "length"
    assert got.usage is not None and got.usage.completion_tokens == 16
    assert (got.model_extra or {})["pdd"]["path"] == "P->RLD"
    # The servers' own tokenization of the same text gives the same answer.
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    native = generate(live.router_url, {"text": prompt, "sampling_params": params,
                                        "pdd_path": "relay"})  # fmt: skip
    assert got.choices[0].text == native["text"]
    assert [m.id for m in api.models.list().data] == [MODEL]


def test_live_errors_reach_the_client_as_openai_errors(live: Live) -> None:
    api = client(live)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.chat.completions.create(model="gpt-nope", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"limit of {live.max_prompt_tokens}"):
        api.completions.create(
            model=MODEL, prompt=list(range(live.max_prompt_tokens + 1)), max_tokens=2
        )


def test_requests_beyond_max_active_get_503_with_retry_after() -> None:
    """Admission control: with every slot taken, a request is refused at once, with a reason."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from pdd.router.app import make_app

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)  # P never finishes: the first request keeps its slot
        return web.json_response({})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    async def run() -> tuple[int, str | None, dict, float]:
        slow = web.Application()
        slow.router.add_post("/generate", hang)
        slow.router.add_get("/ping", ok)
        slow.router.add_post("/abort_request", ok)
        async with TestServer(slow) as backend:
            url = str(backend.make_url("")).rstrip("/")
            config = RouterConfig(prefill=(PrefillTarget(url, 9),), relay=(RelayTarget(url),),
                                  path="relay", max_active=1)  # fmt: skip
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
            async with TestClient(TestServer(make_app(config))) as client:
                first = asyncio.create_task(client.post("/generate", json=body))
                await asyncio.sleep(0.5)
                start = asyncio.get_running_loop().time()
                resp = await client.post("/generate", json=body)
                took = asyncio.get_running_loop().time() - start
                answer = (resp.status, resp.headers.get("Retry-After"), await resp.json(), took)
                first.cancel()
                return answer

    status, retry_after, body, took = asyncio.run(run())
    assert status == 503 and retry_after == "1", (status, body)
    assert "router at capacity (1 requests in flight)" in body["error"]["message"]
    assert took < 2.0
