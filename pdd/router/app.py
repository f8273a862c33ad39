"""The router's HTTP front door (aiohttp): /generate, /health, /metrics, /status.

Further endpoints (the OpenAI ones) translate to an SGLang-native body and reuse `serve()`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web

from pdd.control.channel import AsyncControlSocket
from pdd.policy.path import choose_path, handoff_blockers
from pdd.router.body import BadRequest, GenerateRequest, parse_generate
from pdd.router.config import RouterConfig
from pdd.router.context import RouterContext
from pdd.router.pdd_request import PddRequest
from pdd.router.sse import DONE, encode_event
from pdd.router.upstream import UpstreamError

logger = logging.getLogger(__name__)

CTX = web.AppKey("ctx", RouterContext)
CONFIG = web.AppKey("config", RouterConfig)
TASKS = web.AppKey("tasks", list)
STARTED = web.AppKey("started", float)
# Instances a path needs, to refuse a request the router cannot serve with a clear reason.
NEEDS = {"pdd": ("relay", "main"), "relay": ("relay",), "main": ("main",)}


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _disconnected(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def serve(request: web.Request, parsed: GenerateRequest) -> web.StreamResponse:
    """Run one request through its path and answer it (streamed or whole)."""
    ctx, config = request.app[CTX], request.app[CONFIG]
    choice = choose_path(parsed.path, config.path, handoff_blockers(parsed.body))
    missing = [tier for tier in NEEDS[choice.path] if not getattr(config, tier)]
    if missing:
        return error_response(400, f"path {choice.path} needs {'/'.join(missing)} instances")
    req = PddRequest(ctx, parsed.body, choice, disconnected=lambda: _disconnected(request))
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
                return error_response(499, "client disconnected")
            if last.failed:
                finish = last.chunk["meta_info"]["finish_reason"]
                body = {"error": {"message": finish["message"], "code": 502}, **last.chunk}
                return web.json_response(body, status=502)
            return web.json_response(last.chunk)
        async for out in outputs:
            if response is None:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            await response.write(encode_event(out.chunk))
        if response is None:
            return error_response(499, "client disconnected")
        await response.write(encode_event(DONE))
        await response.write_eof()
        return response
    except UpstreamError as err:
        ctx.metrics.inc("errors_total", kind=f"http_{err.status}")
        return error_response(err.status, err.reason)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        ctx.metrics.inc("errors_total", kind="client_disconnected")
        return response or error_response(499, "client disconnected")
    except Exception as err:  # a bug must cost one request, never the router
        logger.exception("request %s: internal error", req.rid)
        ctx.metrics.inc("errors_total", kind="internal")
        if response is None:
            return error_response(500, f"internal router error: {err!r}")
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
        parsed = parse_generate(body)
    except BadRequest as err:
        ctx.metrics.inc("errors_total", kind="bad_request")
        return error_response(400, str(err))
    return await serve(request, parsed)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    text = ctx.metrics.render(malformed=ctx.control.stats.malformed)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def status(request: web.Request) -> web.Response:
    ctx, config = request.app[CTX], request.app[CONFIG]
    instances: dict[str, Any] = {}
    tiers: dict[str, tuple[Any, ...]] = {
        "prefill": config.prefill,
        "relay": config.relay,
        "main": config.main,
    }
    for tier, targets in tiers.items():
        active = ctx.loads[tier].active
        instances[tier] = [{**asdict(t), "active": active[i]} for i, t in enumerate(targets)]
    return web.json_response(
        {
            "uptime_s": round(time.monotonic() - request.app[STARTED], 3),
            "default_path": config.path,
            "handoff": asdict(config.handoff),
            "timeouts": asdict(config.timeouts),
            "control": {
                "reply_to": ctx.reply_to,
                "signed": config.secret is not None,
                **asdict(ctx.control.stats),
                "unknown_rids": ctx.unknown_rids,
            },
            "md_caches": ctx.caches.status(),
            "active_requests": ctx.metrics.active,
            "instances": instances,
            "counters": ctx.metrics.snapshot(),
        }
    )


async def _startup(app: web.Application) -> None:
    config = app[CONFIG]
    control = AsyncControlSocket(config.secret)
    bound = control.bind(f"tcp://{config.control_host}:{config.control_port or '*'}")
    port = int(bound.rsplit(":", 1)[1])
    reply_to = f"tcp://{config.advertise_host}:{port}"
    # Connection pooling across requests; per-call timeouts are set where each call is made.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    ctx = RouterContext(config, session, control, reply_to)
    app[CTX] = ctx
    loop = asyncio.get_running_loop()
    app[TASKS].append(loop.create_task(ctx.control_loop()))
    if config.main:
        app[TASKS].append(loop.create_task(ctx.caches.loop()))
    logger.info("control socket %s (advertised %s)", bound, reply_to)


async def _cleanup(app: web.Application) -> None:
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
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    return app
