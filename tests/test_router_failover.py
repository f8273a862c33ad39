"""A P that dies mid-prefill, or an MD that is gone, costs no request while another of its tier is
up, and every 503 says when to come back. The real router runs in-process in front of fake
upstreams: P0 drops each connection it gets (a server killed mid-request), P1 and RLD answer."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from aiohttp import web

from pdd.launch.process import free_port
from pdd.router.app import UPSTREAM_KEEPALIVE_S, make_app
from pdd.router.config import MainTarget, PrefillTarget, RelayTarget, RouterConfig, Timeouts
from tests.aio_apps import ok_routes, serving, stream_answer

TOKENS = [10, 11, 12, 13]


def fake_prefill(dies: bool, got: list[str], done: set[str]) -> web.Application:
    """`done`: the requests whose KV this P has sent (by the router's request id)."""

    async def generate(request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        got.append(rid)
        if dies:
            assert request.transport is not None
            request.transport.close()  # the process is gone: the router sees the socket drop
            await asyncio.sleep(3600)
        done.add(rid.rsplit("-", 1)[0])
        return web.json_response({"text": "", "output_ids": [], "meta_info": {}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app)
    return app


def fake_decoder(done: set[str], got: list[str] | None = None) -> web.Application:
    """RLD or MD: decodes only once a P has sent the request's KV, as a real one; the rids it
    served go to `got`."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        while body["rid"].rsplit("-", 1)[0] not in done:
            await asyncio.sleep(0.01)
        if got is not None:
            got.append(body["rid"])
        outputs = [{"output_ids": TOKENS[:i]} for i in range(1, len(TOKENS) + 1)]
        return await stream_answer(request, body["rid"], outputs)

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app)
    return app


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_a_request_whose_p_dies_is_prefilled_again_on_another_p() -> None:
    got: dict[str, list[str]] = {"p0": [], "p1": []}
    ports = {name: free_port() for name in ("p0", "p1", "relay", "router")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    config = RouterConfig(
        prefill=(PrefillTarget(url["p0"], free_port()), PrefillTarget(url["p1"], free_port())),
        relay=(RelayTarget(url["relay"]),), path="relay", port=ports["router"],
        health_interval_s=0.2,  # P0 comes back up between requests, and dies again
    )  # fmt: skip
    done: set[str] = set()
    apps = [
        (fake_prefill(True, got["p0"], done), ports["p0"]),
        (fake_prefill(False, got["p1"], done), ports["p1"]),
        (fake_decoder(done), ports["relay"]),
        (make_app(config), ports["router"]),
    ]
    with serving(apps):
        for _ in range(6):
            status, _, answer = post(url["router"], {"input_ids": [1, 2, 3]})
            assert status == 200, answer
            assert answer["output_ids"] == TOKENS
        assert got["p0"], "P0 was never tried: the test shows nothing"
        with urllib.request.urlopen(f"{url['router']}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert f'errors_total{{kind="retried"}} {len(got["p0"])}' in metrics, metrics


def test_a_p_to_md_request_whose_md_is_gone_is_planned_again_on_another_md() -> None:
    """Not resumed on RLD: RLD, a small tier, would decode the whole answer."""
    names = ("p", "relay", "md0", "md1", "router")
    ports = {name: free_port() for name in names}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    config = RouterConfig(
        prefill=(PrefillTarget(url["p"], free_port()),), relay=(RelayTarget(url["relay"]),),
        main=(MainTarget(url["md0"], free_port()), MainTarget(url["md1"], free_port())),
        path="main", port=ports["router"], timeouts=Timeouts(ready=1.0),
    )  # fmt: skip
    done: set[str] = set()
    got: dict[str, list[str]] = {"p": [], "md1": []}
    apps = [  # nothing listens on MD0's port: a killed server
        (fake_prefill(False, got["p"], done), ports["p"]),
        (fake_decoder(done), ports["relay"]),
        (fake_decoder(done, got["md1"]), ports["md1"]),
        (make_app(config), ports["router"]),
    ]
    with serving(apps):
        for _ in range(3):  # MD0 is first in turn for the first or the second
            status, _, answer = post(url["router"], {"input_ids": [1, 2, 3]})
            assert status == 200, answer
            assert answer["output_ids"] == TOKENS
            meta = answer["meta_info"]["pdd"]
            assert (meta["path"], meta["resumed_on"]) == ("P->MD", None), meta
            assert meta["instances"]["main"] == url["md1"], meta
        with urllib.request.urlopen(f"{url['router']}/metrics", timeout=10) as r:
            metrics = r.read().decode()
    assert 'errors_total{kind="retried"} 1' in metrics, metrics
    assert len(got["md1"]) == 3


def test_every_503_carries_retry_after() -> None:
    ports = {name: free_port() for name in ("relay", "router")}
    dead_p = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = RouterConfig(
        prefill=(PrefillTarget(dead_p, free_port()),),
        relay=(RelayTarget(f"http://127.0.0.1:{ports['relay']}"),), path="relay",
        port=ports["router"],
    )  # fmt: skip
    with serving([(fake_decoder(set()), ports["relay"]), (make_app(config), ports["router"])]):
        status, headers, answer = post(f"http://127.0.0.1:{ports['router']}",
                                       {"input_ids": [1, 2, 3]})  # fmt: skip
    assert status == 503, answer
    assert headers.get("Retry-After") == "1"
    assert "prefill" in json.dumps(answer)


def test_the_router_drops_idle_upstream_connections_before_sglang_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pooled connection the server is closing as the router reuses it fails the request
    # ("Server disconnected") and marks the instance down: the router must close first, with
    # more than a WAN round trip (hundreds of ms) to spare.
    from sglang.srt.environ import envs

    monkeypatch.delenv(envs.SGLANG_TIMEOUT_KEEP_ALIVE.name, raising=False)
    assert UPSTREAM_KEEPALIVE_S + 1.0 <= envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()
