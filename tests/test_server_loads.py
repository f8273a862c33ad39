"""The router's view of each instance's load: the server's own report (SGLang's /v1/loads) plus
what this router sent since asking, and its own count when a server does not report."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from pdd.launch.process import free_port
from pdd.router.server_loads import Load, capacity_reported, kv_reported, requests_reported
from tests.aio_apps import serving


def answer(*ranks: tuple[int, int]) -> dict[str, object]:
    return {"loads": [{"dp_rank": i, "num_running_reqs": r, "num_waiting_reqs": w}
                      for i, (r, w) in enumerate(ranks)]}  # fmt: skip


def test_reported_requests_sum_running_and_waiting_over_dp_ranks() -> None:
    assert requests_reported(answer((3, 1), (2, 0))) == 6
    with pytest.raises(ValueError):
        requests_reported({"loads": []})


def test_capacity_is_what_sglang_resolved_over_dp_ranks() -> None:
    states = [
        {"effective_max_running_requests_per_dp": 4},
        {"effective_max_running_requests_per_dp": 4},
    ]
    assert capacity_reported({"internal_states": states, "max_running_requests": None}) == 8
    assert capacity_reported({"internal_states": [], "max_running_requests": 16}) == 16
    with pytest.raises(ValueError):
        capacity_reported({"internal_states": [], "max_running_requests": None})


def test_an_md_that_is_one_dp_rank_counts_that_rank_alone() -> None:
    assert requests_reported(answer((3, 1), (2, 0)), dp_rank=1) == 2
    with pytest.raises(ValueError, match="no load of DP rank 2"):
        requests_reported(answer((3, 1), (2, 0)), dp_rank=2)
    states = [{"effective_max_running_requests_per_dp": n} for n in (4, 6)]
    assert capacity_reported({"internal_states": states}, dp_rank=1) == 6
    # A server without DP attention reports one state for all its ranks.
    assert capacity_reported({"internal_states": states[:1]}, dp_rank=1) == 4


def test_without_a_report_the_router_counts_its_own_requests() -> None:
    load = Load([0, 0])
    load.hold(1)
    load.hold(1)
    load.release(1)
    assert load.values() == [0, 1]


def test_the_servers_report_replaces_the_routers_count() -> None:
    """Another router's 5 requests show in the report; ours sent after asking are added."""
    port = free_port()
    reports = [answer((5, 2))]

    async def loads(request: web.Request) -> web.Response:
        if request.query.get("include") != "core":
            return web.json_response({"error": "expected include=core"}, status=400)
        return web.json_response(reports[0])

    async def info(request: web.Request) -> web.Response:
        states = [{"effective_max_running_requests_per_dp": 8}]
        return web.json_response({"internal_states": states})

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/server_info", info)
    url = f"http://127.0.0.1:{port}"
    load = Load([0])
    load.hold(0)  # one of ours, sent before the question: the report has it

    async def poll() -> None:
        async with aiohttp.ClientSession() as session:
            await load.poll(session, 0, url, timeout=5.0)

    with serving([(app, port)]):
        asyncio.run(poll())
        assert (load.reported, load.value(0), load.capacity) == ([7], 7, [8])
        load.hold(0)  # sent after the report: counted on top until the next one
        assert load.value(0) == 8
        reports[0] = answer((1, 0))
        asyncio.run(poll())
        assert load.value(0) == 1
    # The server is gone: back to this router's own count (2 held).
    asyncio.run(poll())
    assert (load.reported, load.value(0)) == ([None], 2)


def test_an_md_server_with_dp_attention_given_whole_is_reported() -> None:
    """`--main URL` for an MD running DP attention: the router would talk to rank 0 alone while
    SGLang places requests on any rank. Its /status names the fix; one DP rank given with
    --main-dp, or a server without DP attention, is no problem."""
    port = free_port()
    info_doc = {"internal_states": [{"effective_max_running_requests_per_dp": 4}] * 2,
                "enable_dp_attention": True, "attn_dp_size": 2, "dp_size": 1}  # fmt: skip

    async def info(request: web.Request) -> web.Response:
        return web.json_response(info_doc)

    async def loads(request: web.Request) -> web.Response:
        return web.json_response(answer((0, 0), (0, 0)))

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/server_info", info)
    url = f"http://127.0.0.1:{port}"
    whole, one_rank, other_tier = (
        Load([0], per_dp_rank=True),
        Load([0], per_dp_rank=True),
        Load([0]),
    )
    one_rank.dp_ranks = [1]

    async def poll() -> None:
        async with aiohttp.ClientSession() as session:
            for load in (whole, one_rank, other_tier):
                await load.poll(session, 0, url, timeout=5.0)

    with serving([(app, port)]):
        asyncio.run(poll())
    problem = whole.problems[0]
    assert problem is not None and f"--main-dp {url} CONTROL_PORT 2" in problem, problem
    assert whole.capacity == [8] and one_rank.capacity == [4]
    assert one_rank.problems == [None] and other_tier.problems == [None]


def test_kv_room_is_the_pool_less_committed_sent_and_reserved_tokens() -> None:
    """SGLang's decode side admits a prompt only beside its reservation per active request."""
    rank = {"num_running_reqs": 1, "num_waiting_reqs": 1, "num_total_tokens": 1000,
            "max_total_num_tokens": 4096}  # fmt: skip
    ranks = [{"dp_rank": i, **rank} for i in range(2)]
    assert kv_reported({"loads": ranks}) == (2000, 8192)
    assert kv_reported({"loads": ranks}, dp_rank=1) == (1000, 4096)
    assert kv_reported({"loads": [{**ranks[0], "max_total_num_tokens": 0}]}) is None
    load = Load([0], reported=[2], kv=[(1000, 4096)], reserve=[512])
    # 4096 - 1000 committed - 512 x (2 requests + this one)
    assert load.kv_room(0) == 1560
    load.hold(0, tokens=300)  # sent after the report: its prompt and its reservation count
    assert load.kv_room(0) == 1560 - 300 - 512
    assert Load([0]).kv_room(0) is None  # no report: the request count alone guards
    assert (load.kv_pool(0), Load([0]).kv_pool(0)) == (4096, None)
