"""The benchmarks' client waits out a 503 that says when to come back, for as long as it is
told to, and no longer; other errors are not retried. A real HTTP server on loopback answers."""

from __future__ import annotations

import time
import urllib.error
from itertools import pairwise

import pytest
from aiohttp import web

from eval.client import stream_generate
from pdd.launch.process import free_port
from tests.aio_apps import serving, stream_answer


def busy_then_serving(busy: int, got: list[float], retry_after: str | None) -> web.Application:
    """Answers its first `busy` requests with 503 (and Retry-After, if given), then streams."""

    async def generate(request: web.Request) -> web.StreamResponse:
        got.append(time.monotonic())
        if len(got) <= busy:
            headers = {} if retry_after is None else {"Retry-After": retry_after}
            return web.json_response({"error": "busy"}, status=503, headers=headers)
        return await stream_answer(request, "r", [{"output_ids": [7]}, {"output_ids": [7, 8]}])

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


def test_a_503_with_retry_after_is_retried_after_it_within_the_patience() -> None:
    port, got = free_port(), []
    with serving([(busy_then_serving(2, got, "1"), port)]):
        out = stream_generate(f"http://127.0.0.1:{port}", {"input_ids": [1]}, patience_s=10)
    assert out.final["output_ids"] == [7, 8]
    assert len(got) == 3
    assert all(b - a >= 0.95 for a, b in pairwise(got)), "retried before Retry-After"


@pytest.mark.parametrize(("patience_s", "retry_after"), [(0.0, "1"), (1.5, "1"), (10.0, None)])
def test_a_503_past_the_patience_or_without_retry_after_is_raised(
    patience_s: float, retry_after: str | None
) -> None:
    port, got = free_port(), []
    with serving([(busy_then_serving(5, got, retry_after), port)]):
        with pytest.raises(urllib.error.HTTPError) as err:
            stream_generate(f"http://127.0.0.1:{port}", {"input_ids": [1]}, patience_s=patience_s)
    assert err.value.code == 503
    assert len(got) == (2 if patience_s == 1.5 else 1)
