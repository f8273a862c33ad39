"""The router's HTTP front door (aiohttp): /generate, /health, /metrics, /status, and the
OpenAI endpoints (/v1/chat/completions, /v1/completions, /v1/models), which translate to an
SGLang-native body (openai_api.py) and reuse `serve()` with an OpenAI formatter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from pdd.control.channel import AsyncControlSocket
from pdd.policy.path import handoff_blockers
from pdd.router.body import HOLD_FIELD, BadRequest, GenerateRequest, Limits, parse_generate
from pdd.router.config import RouterConfig
from pdd.router.context import TIERS, NoInstance, RouterContext
from pdd.router.openai_api import NO_TOKENIZER, OpenAIError, OpenAIRequest, ServedModel, error_body
from pdd.router.pdd_request import PddRequest
from pdd.router.planner import plan
from pdd.router.server_loads import poll_loop
from pdd.router.sse import DONE, encode_event
from pdd.router.status import metrics_text, status_body
from pdd.router.tokenizer import (
    default_max_prompt_tokens,
    default_model_name,
    load_tokenizer,
    model_limits,
)
from pdd.router.upstream import UpstreamError

logger = logging.getLogger(__name__)

CTX = web.AppKey("ctx", RouterContext)
CONFIG = web.AppKey("config", RouterConfig)
TASKS = web.AppKey("tasks", list)
STARTED = web.AppKey("started", float)
OPENAI = web.AppKey("openai", ServedModel)  # set only with --tokenizer
TOKENIZE = web.AppKey("tokenize", ThreadPoolExecutor)
# Instances a path needs, to refuse a request the router cannot serve with a clear reason.
NEEDS = {"pdd": ("relay", "main"), "relay": ("relay",), "main": ("main",)}
RETRIES = 2  # new plans for a request whose instances refused the connection
RETRY_AFTER_S = 1  # what a 503 (over capacity, no instance up) tells clients to wait
# How long an idle pooled connection to a server is kept: below SGLang's keep-alive (uvicorn's
# timeout, SGLANG_TIMEOUT_KEEP_ALIVE, 5 s) by more than a WAN round trip, so that the router
# closes its idle connections first. aiohttp's default, 15 s, reused connections the server had
# just closed: the request met "Server disconnected" and the router took MD for down.
UPSTREAM_KEEPALIVE_S = 3.0


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class Formatter(Protocol):
    """How `serve` shapes its answers: SGLang-native (/generate) or OpenAI (/v1/...)."""

    def error(self, status: int, message: str) -> dict[str, Any]: ...

    def failure(self, chunk: dict[str, Any]) -> dict[str, Any]: ...  # 502: failed mid-output

    def whole(self, final: dict[str, Any]) -> dict[str, Any]: ...

    def stream_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...

    def stream_end(self) -> list[dict[str, Any]]: ...  # before `data: [DONE]`


class NativeFormatter:
    """SGLang's own shapes: the chunks as the servers produced them (stitched)."""

    def error(self, status: int, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "code": status}}

    def failure(self, chunk: dict[str, Any]) -> dict[str, Any]:
        finish = chunk["meta_info"]["finish_reason"]
        return {"error": {"message": finish["message"], "code": 502}, **chunk}

    def whole(self, final: dict[str, Any]) -> dict[str, Any]:
        return final

    def stream_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        finish = (chunk.get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") == "abort" and finish.get("message"):
            return [self.failure(chunk)]  # a stream that fails midway says so, as JSON does
        return [chunk]

    def stream_end(self) -> list[dict[str, Any]]:
        return []


def _error(formatter: Formatter, status: int, message: str) -> web.Response:
    response = web.json_response(formatter.error(status, message), status=status)
    if status == 503:  # every 503 says when to come back
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _Retry(Exception):
    """An instance refused the connection, or went away, before anything was sent to the
    client: the request runs again on the instances left."""


async def serve(
    request: web.Request, parsed: GenerateRequest, formatter: Formatter | None = None
) -> web.StreamResponse:
    """Run one request through its path and answer it (streamed or whole), shaped by
    `formatter` (default: SGLang-native); errors keep their status in its error shape.

    An instance that refuses the connection or dies before the client got anything (a P killed
    mid-prefill, say) is marked down and the request planned again on what is left: a dead
    server costs no request while another of its tier is up."""
    formatter = formatter or NativeFormatter()
    config = request.app[CONFIG]
    ctx = request.app[CTX]
    if ctx.metrics.active >= config.max_active:
        ctx.metrics.inc("errors_total", kind="overloaded")
        message = f"router at capacity ({config.max_active} requests in flight); retry shortly"
        return _error(formatter, 503, message)
    if parsed.hold_relay is not None and not config.test_controls:
        message = f"{HOLD_FIELD} is a test control: the router needs --test-controls for it"
        return _error(formatter, 400, message)
    if parsed.path is not None:
        missing = [tier for tier in NEEDS[parsed.path] if not getattr(config, tier)]
        if missing:
            message = f"path {parsed.path} needs {'/'.join(missing)} instances"
            return _error(formatter, 400, message)
    for attempt in range(RETRIES + 1):
        try:
            return await _serve_once(request, parsed, formatter, attempt < RETRIES)
        except _Retry as err:
            request.app[CTX].metrics.inc("errors_total", kind="retried")
            logger.warning("retrying a request on other instances: %s", err)
    raise AssertionError("unreachable: the last attempt never retries")


async def _serve_once(
    request: web.Request, parsed: GenerateRequest, formatter: Formatter, may_retry: bool
) -> web.StreamResponse:
    ctx = request.app[CTX]
    try:
        where = plan(ctx, parsed.body, parsed.path, handoff_blockers(parsed.body))
    except NoInstance as err:
        ctx.metrics.inc("errors_total", kind="no_instance")
        return _error(formatter, 503, f"no instance available: {err}")
    req = PddRequest(ctx, parsed.body, where, disconnected=lambda: _disconnected(request),
                     hold_relay=parsed.hold_relay, may_retry=may_retry)  # fmt: skip
    ctx.metrics.active += 1
    response: web.StreamResponse | None = None
    outputs = req.outputs()
    try:
        req.start()
        if not parsed.stream:
            last = None
            async for out in outputs:
                last = out
            if last is None or not last.final:  # the client went away
                return _error(formatter, 499, "client disconnected")
            if last.failed:
                return web.json_response(formatter.failure(last.chunk), status=502)
            return web.json_response(formatter.whole(last.chunk))
        async for out in outputs:
            if response is None:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            for event in formatter.stream_chunk(out.chunk):
                await response.write(encode_event(event))
        if response is None:
            return _error(formatter, 499, "client disconnected")
        for event in formatter.stream_end():
            await response.write(encode_event(event))
        await response.write(encode_event(DONE))
        await response.write_eof()
        return response
    except UpstreamError as err:
        lost = err.status == 503 or req.lost_instance
        if may_retry and lost and response is None and req.sent_outputs == 0:
            raise _Retry(err.reason) from err
        ctx.metrics.inc("errors_total", kind=f"http_{err.status}")
        return _error(formatter, err.status, err.reason)
    except OpenAIError as err:  # an answer that has no OpenAI shape (an abort)
        ctx.metrics.inc("errors_total", kind=f"http_{err.status}")
        return web.json_response(err.body(), status=err.status)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        ctx.metrics.inc("errors_total", kind="client_disconnected")
        return response or _error(formatter, 499, "client disconnected")
    except Exception as err:  # a bug must cost one request, never the router
        logger.exception("request %s: internal error", req.rid)
        ctx.metrics.inc("errors_total", kind="internal")
        if response is None:
            return _error(formatter, 500, f"internal router error: {err!r}")
        return response
    finally:
        await outputs.aclose()
        req.close()
        ctx.metrics.active -= 1


async def generate(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        ctx.metrics.inc("errors_total", kind="bad_request")
        return error_response(400, f"malformed JSON: {err}")
    try:
        served = request.app.get(OPENAI)
        parsed = parse_generate(body, Limits() if served is None else served.limits)
    except BadRequest as err:
        ctx.metrics.inc("errors_total", kind="bad_request")
        return error_response(400, str(err))
    return await serve(request, parsed)


def _openai_error(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)


async def _openai(
    request: web.Request, translate: Callable[[ServedModel, object], OpenAIRequest]
) -> web.StreamResponse:
    ctx, served = request.app[CTX], request.app.get(OPENAI)
    if served is None:
        return _openai_error(501, NO_TOKENIZER)
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        ctx.metrics.inc("errors_total", kind="bad_request")
        return _openai_error(400, f"malformed JSON: {err}")
    try:
        # Off the event loop (a long prompt takes milliseconds; handoffs must not wait), on one
        # thread: a fast tokenizer must not be used from two threads at once.
        loop = asyncio.get_running_loop()
        translated = await loop.run_in_executor(request.app[TOKENIZE], translate, served, body)
    except OpenAIError as err:
        ctx.metrics.inc("errors_total", kind="bad_request")
        return web.json_response(err.body(), status=err.status)
    return await serve(request, translated.generate, translated.formatter())


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, ServedModel.chat)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, ServedModel.completion)


async def models(request: web.Request) -> web.Response:
    served = request.app.get(OPENAI)
    if served is None:
        return _openai_error(501, NO_TOKENIZER)
    return web.json_response(served.models())


def served_model(config: RouterConfig) -> ServedModel:
    """The model the OpenAI endpoints serve. Loads the tokenizer: TokenizerError if it cannot."""
    path = config.tokenizer
    assert path is not None
    return ServedModel(
        name=config.served_model_name or default_model_name(path),
        max_prompt_tokens=config.max_prompt_tokens or default_max_prompt_tokens(path),
        tokenizer=load_tokenizer(path),
        limits=model_limits(path),
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    text = metrics_text(request.app[CTX])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def status(request: web.Request) -> web.Response:
    uptime_s = time.monotonic() - request.app[STARTED]
    return web.json_response(status_body(request.app[CTX], uptime_s))


async def _startup(app: web.Application) -> None:
    config = app[CONFIG]
    control = AsyncControlSocket(config.secret, curve=config.curve())
    bound = control.bind(f"tcp://{config.control_host}:{config.control_port or '*'}")
    port = int(bound.rsplit(":", 1)[1])
    reply_to = f"tcp://{config.advertise_host}:{port}"
    # Connection pooling across requests; per-call timeouts are set where each call is made.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    session = aiohttp.ClientSession(connector=connector)
    ctx = RouterContext(config, session, control, reply_to)
    app[CTX] = ctx
    loop = asyncio.get_running_loop()
    app[TASKS].append(loop.create_task(ctx.control_loop()))
    if config.main:
        app[TASKS].append(loop.create_task(ctx.caches.loop()))
    app[TASKS].append(loop.create_task(ctx.health.loop(session)))
    tiers = [(t, ctx.loads[t], ctx.health.urls(t)) for t in TIERS]
    polls = poll_loop(session, tiers, config.load_interval_s, ctx.health.heard)
    app[TASKS].append(loop.create_task(polls))
    logger.info("control socket %s (advertised %s, %s)", bound, reply_to,
                "CURVE-encrypted" if config.control_encrypt else "cleartext")  # fmt: skip


async def _cleanup(app: web.Application) -> None:
    if TOKENIZE in app:
        app[TOKENIZE].shutdown(wait=False, cancel_futures=True)
    for task in app[TASKS]:
        task.cancel()
    ctx = app.get(CTX)
    if ctx is None:
        return
    for task in list(ctx.background):
        task.cancel()
    await asyncio.gather(*app[TASKS], *ctx.background, return_exceptions=True)
    await ctx.session.close()
    ctx.control.close()


def make_app(config: RouterConfig) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[CONFIG] = config
    app[TASKS] = []
    app[STARTED] = time.monotonic()
    if config.tokenizer is not None:
        app[OPENAI] = served_model(config)  # now: a bad tokenizer stops the router at start
        app[TOKENIZE] = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app
