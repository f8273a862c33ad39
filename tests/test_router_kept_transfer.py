"""When RLD answers alone after P started feeding MD, the router lets that transfer finish so MD
caches the prompt; a transfer a fault broke on one side must still end. Here the real router runs
in front of fake upstreams: P's second prefill and MD's stream never end, and within the ready
timeout the router aborts both (the faults benchmark shows the same on real servers)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from aiohttp import web

from pdd.launch.process import free_port
from pdd.router.app import make_app
from pdd.router.config import MainTarget, PrefillTarget, RelayTarget, RouterConfig, Timeouts
from pdd.router.sse import DONE, encode_event
from tests.aio_apps import ok_routes, serving

READY_S = 2.0


def fake_upstream(role: str, aborted: list[Any]) -> web.Application:
    """P answers its first prefill and hangs on the second; RLD streams four tokens; MD hangs."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if role == "prefill" and not body["rid"].endswith("-p2"):
            return web.json_response({"text": "", "output_ids": [], "meta_info": {}})
        if role != "relay":
            await asyncio.sleep(3600)  # a transfer the other side gave up on
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, 5):
            finish = {"type": "length", "length": 4} if i == 4 else None
            meta = {"id": body["rid"], "finish_reason": finish, "completion_tokens": i}
            await resp.write(
                encode_event({"output_ids": list(range(10, 10 + i)), "meta_info": meta})
            )
            await asyncio.sleep(0.05)
        await resp.write(encode_event(DONE))
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app, aborted)
    return app


def test_a_kept_transfer_that_never_ends_is_aborted_on_p_and_md() -> None:
    aborted: dict[str, list[Any]] = {"prefill": [], "relay": [], "main": []}
    ports = {role: free_port() for role in (*aborted, "router")}
    url = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    config = RouterConfig(
        prefill=(PrefillTarget(url["prefill"], free_port()),), relay=(RelayTarget(url["relay"]),),
        main=(MainTarget(url["main"], free_port()),), path="pdd", port=ports["router"],
        timeouts=Timeouts(ready=READY_S), md_feed_after_tokens=1,
    )  # fmt: skip
    apps = [(fake_upstream(role, aborted[role]), ports[role]) for role in aborted]
    with serving([*apps, (make_app(config), ports["router"])]):
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        req = urllib.request.Request(f"{url['router']}/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
        assert answer["output_ids"] == [10, 11, 12, 13]
        pdd = answer["meta_info"]["pdd"]
        assert pdd["path"] == "P->RLD" and "prefill_md_sent" in pdd["timings"]
        rid = pdd["rid"]
        assert aborted["prefill"] == [] and aborted["main"] == []  # the transfer runs on, first
        deadline = time.monotonic() + READY_S + 10
        while time.monotonic() < deadline and not (aborted["prefill"] and aborted["main"]):
            time.sleep(0.1)
        assert aborted["prefill"] == [f"{rid}-p2"] and aborted["main"] == [rid]
        with urllib.request.urlopen(f"{url['router']}/metrics", timeout=10) as r:
            assert 'timeouts_total{wait="kept_transfer"} 1' in r.read().decode()
