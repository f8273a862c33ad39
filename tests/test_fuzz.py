"""Fuzzing (hypothesis, bounded): the control-plane decoder and the router's HTTP input.

Whatever arrives, the decoder returns a valid message or raises ControlError, and the router
answers every request within a time limit with a JSON error of status 4xx (bad input) or 503
(nothing behind it), never 500 and never a hang. Example counts are fixed, so each run is bounded;
hypothesis prints the seed and the failing input of any failure.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.control.messages import (
    _TYPES,
    PROTOCOL_VERSION,
    ControlError,
    Message,
    decode,
    encode,
)
from tests.test_router_openai import MODEL, model_dir, router_config

SECRET = b"fuzz"
FUZZ = settings(max_examples=400, deadline=2000, suppress_health_check=list(HealthCheck))

# msgpack-representable values, the kinds a hostile peer can put anywhere in a message.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=30,
)
field_names = st.sampled_from(
    ["rid", "start", "tokens", "done", "reason", "prompt_len", "cached_len", "wan_kv_bytes",
     "first_token", "reply_to", "name", "epoch", "seq", "block", "cleared", "added", "removed"]
)  # fmt: skip
bodies = st.dictionaries(field_names, values | st.lists(st.integers(-5, 2**32), max_size=20))
envelopes = st.fixed_dictionaries(
    {
        "version": st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION - 1, "2", True]),
        "type": st.sampled_from([*_TYPES, "hello"]),
        "ts": st.floats(allow_nan=True) | st.integers(-(2**63), 2**63 - 1),
        "sender": st.text(max_size=40) | st.integers(-(2**63), 2**63 - 1),
        "n": st.integers(-3, 2**64 - 1) | st.booleans(),
        "body": bodies | values,
    }
)


def decodes_cleanly(data: bytes, secret: bytes | None) -> None:
    try:
        msg = decode(data, secret)
    except ControlError:
        return
    assert isinstance(msg, Message.__args__)  # type: ignore[attr-defined]
    assert decode(encode(msg)) == msg  # what gets through is a fully valid message


@FUZZ
@given(st.binary(max_size=3000))
def test_decoder_survives_random_bytes(data: bytes) -> None:
    decodes_cleanly(data, None)
    decodes_cleanly(data, SECRET)


@FUZZ
@given(envelopes)
def test_decoder_survives_hostile_envelopes(envelope: dict[str, Any]) -> None:
    payload = msgpack.packb(envelope, use_bin_type=True)
    decodes_cleanly(payload, None)
    # Signed by someone without the secret: always rejected.
    with pytest.raises(ControlError):
        decode(payload + b"\x00" * 32, SECRET)


# --- the router's HTTP input -------------------------------------------------------------------


class RouterClient:
    """An in-process router (nothing behind it) on a loop of its own, for synchronous tests."""

    def __init__(self) -> None:
        from aiohttp.test_utils import TestClient, TestServer

        from pdd.router.app import make_app

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = router_config(tokenizer=model_dir(), served_model_name=MODEL,
                               max_prompt_tokens=64)  # fmt: skip

        async def start() -> TestClient:
            client = TestClient(TestServer(make_app(config)))  # needs the running loop
            await client.start_server()
            return client

        self.client = self._run(start())

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, data: bytes) -> tuple[int, str]:
        async def call() -> tuple[int, str]:
            resp = await self.client.post(path, data=data,
                                          headers={"Content-Type": "application/json"})  # fmt: skip
            return resp.status, await resp.text()

        return self._run(call())  # a hang fails here, after 30 s

    def close(self) -> None:
        self._run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def router() -> Iterator[RouterClient]:
    client = RouterClient()
    yield client
    client.close()


PATHS = st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=25,
)  # fmt: skip
request_keys = st.sampled_from(
    ["input_ids", "text", "sampling_params", "stream", "rid", "pdd_path", "model", "prompt",
     "messages", "max_tokens", "temperature", "n", "logprobs", "stop", "max_completion_tokens",
     "stream_options", "tools", "seed", "top_p"]
)  # fmt: skip
requests = st.dictionaries(request_keys, json_values | st.lists(st.integers(-2, 2**40), max_size=8))


def check_answer(status: int, text: str) -> None:
    assert status != 500 and (status < 500 or status == 503), (status, text[:500])
    if status >= 400:
        body = json.loads(text)  # errors are JSON with a reason
        assert "error" in body, body


@FUZZ
@given(PATHS, requests)
def test_router_answers_hostile_json(router: RouterClient, path: str, body: dict) -> None:
    status, text = router.post(path, json.dumps(body).encode())
    check_answer(status, text)


@settings(max_examples=150, deadline=5000, suppress_health_check=list(HealthCheck))
@given(PATHS, st.binary(max_size=500))
def test_router_answers_garbage_bodies(router: RouterClient, path: str, data: bytes) -> None:
    status, text = router.post(path, data)
    check_answer(status, text)
