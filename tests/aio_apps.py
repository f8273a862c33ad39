"""aiohttp apps (the real router, fake upstreams) served on one event loop in a thread, so a
synchronous test can call them over real sockets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web


@contextmanager
def serving(apps: list[tuple[web.Application, int]]) -> Iterator[asyncio.AbstractEventLoop]:
    """Serves each app on 127.0.0.1:port until the block ends; yields the loop they run on."""
    loop = asyncio.new_event_loop()
    # A handler whose client went away is cancelled, as SGLang's are, so a fake that hangs
    # does not hold up the teardown.
    runners = [web.AppRunner(app, handler_cancellation=True) for app, _ in apps]

    async def up() -> None:
        for runner, (_, port) in zip(runners, apps, strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(up(), loop).result(60)
    try:
        yield loop
    finally:
        for runner in reversed(runners):
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def stream_answer(
    request: web.Request, rid: str, chunks: list[dict[str, Any]]
) -> web.StreamResponse:
    """Streams `chunks` (cumulative, as SGLang's) with SGLang's meta_info (the last one finished
    by length), then [DONE]."""
    from pdd.router.sse import DONE, encode_event

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = len(chunks)
    for i, chunk in enumerate(chunks, 1):
        finish = {"type": "length", "length": n} if i == n else None
        meta = {"id": rid, "finish_reason": finish, "completion_tokens": i}
        await resp.write(encode_event({**chunk, "meta_info": meta}))
    await resp.write(encode_event(DONE))
    return resp


def ok_routes(app: web.Application, aborted: list[Any] | None = None) -> None:
    """What the router's health checks and aborts need of an SGLang server; the rids of
    /abort_request calls go to `aborted`."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    async def abort(request: web.Request) -> web.Response:
        if aborted is not None:
            aborted.append((await request.json())["rid"])
        return web.json_response({})

    app.router.add_get("/health", ok)
    app.router.add_get("/ping", ok)  # the router's health check: without it, it marks the fake down
    app.router.add_post("/abort_request", abort)
