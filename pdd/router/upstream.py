"""HTTP calls from the router to SGLang servers, each bounded by a timeout."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pdd.router.config import Timeouts
from pdd.router.sse import DONE, SSEError, SSEParser

logger = logging.getLogger(__name__)


class UpstreamError(Exception):
    """An instance failed or could not be reached; `status` is what the client should get.
    `lost`: the instance itself went away (refused, reset or dropped the connection), rather
    than answering an error; `unreachable`: no connection could be made (nothing listens there)."""

    def __init__(
        self, status: int, reason: str, lost: bool = False, unreachable: bool = False
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.lost = lost or unreachable
        self.unreachable = unreachable


def _answer_error(role: str, url: str, status: int, text: str) -> UpstreamError:
    # A 4xx from SGLang is the client's fault (bad sampling params...): pass it through.
    client_status = status if 400 <= status < 500 else 502
    return UpstreamError(client_status, f"{role} {url} answered {status}: {text[:500]}")


def _wrap(role: str, url: str, err: BaseException) -> UpstreamError:
    if isinstance(err, UpstreamError):
        return err
    if isinstance(err, aiohttp.ClientConnectorError):
        return UpstreamError(503, f"{role} {url} unreachable: {err}", unreachable=True)
    if isinstance(err, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return UpstreamError(502, f"{role} {url} dropped the connection: {err!r}", lost=True)
    if isinstance(err, asyncio.TimeoutError):  # aiohttp's say which wait: connect, read, total
        return UpstreamError(504, f"{role} {url} timed out: {err!r}")
    return UpstreamError(502, f"{role} {url} failed: {err!r}")


async def post_generate(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeouts: Timeouts, role: str
) -> dict[str, Any]:
    """A non-streaming /generate; its JSON answer."""
    timeout = aiohttp.ClientTimeout(total=timeouts.request, sock_connect=timeouts.connect)
    try:
        async with session.post(f"{url}/generate", json=body, timeout=timeout) as resp:
            raw = await resp.read()
            text = raw.decode(errors="replace")
            if resp.status != 200:
                raise _answer_error(role, url, resp.status, text)
            value = json.loads(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamError, ValueError) as err:
        raise _wrap(role, url, err) from err
    if not isinstance(value, dict):
        raise UpstreamError(502, f"{role} {url} answered a non-object: {text[:200]}")
    return value


async def stream_generate(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeouts: Timeouts, role: str
) -> AsyncIterator[dict[str, Any]]:
    """A streaming /generate: each chunk's JSON; UpstreamError if it ends without [DONE]."""
    timeout = aiohttp.ClientTimeout(
        total=timeouts.request, sock_connect=timeouts.connect, sock_read=timeouts.stream_idle
    )
    parser = SSEParser()
    try:
        async with session.post(f"{url}/generate", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                raw = await resp.read()
                raise _answer_error(role, url, resp.status, raw.decode(errors="replace"))
            async for data in resp.content.iter_any():
                for event in parser.feed(data):
                    if event == DONE:
                        return
                    assert isinstance(event, dict)
                    yield event
    except (aiohttp.ClientError, asyncio.TimeoutError, SSEError, UpstreamError) as err:
        raise _wrap(role, url, err) from err
    raise UpstreamError(502, f"{role} {url} stream ended without [DONE]")


async def abort_request(
    session: aiohttp.ClientSession, url: str, rid: str, timeouts: Timeouts
) -> bool:
    """Best effort: ask `url` to abort `rid`; False (logged) when that fails."""
    timeout = aiohttp.ClientTimeout(total=timeouts.abort)
    try:
        async with session.post(f"{url}/abort_request", json={"rid": rid}, timeout=timeout) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        logger.info("abort of %s at %s failed: %r", rid, url, err)
        return False
