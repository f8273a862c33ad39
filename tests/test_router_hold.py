"""The router's test control `pdd_hold_relay` (pdd.router.hold), and P -> MD answers that wait
for MD's READY. The real router runs in-process in front of fake upstreams: P answers at once,
RLD streams its tokens several to a chunk, and MD plays the control plane (READY when the test
says, ACKs for Catch-Up chunks) and, after the handoff, continues from what it was handed."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from pdd.control.channel import ControlSocket
from pdd.control.messages import Ack, Chunk, Handoff, Ready, parse_route_hint
from pdd.launch.process import free_port
from pdd.policy.handoff import HandoffPolicy
from pdd.router.app import make_app
from pdd.router.config import MainTarget, PrefillTarget, RelayTarget, RouterConfig, Timeouts
from pdd.router.hold import RelayHold, first_tokens
from pdd.router.request_types import StreamChunk, StreamEnd
from pdd.router.sse import DONE, encode_event
from tests.aio_apps import ok_routes, serving

MAX_NEW = 20
RLD = [100 + i for i in range(MAX_NEW)]  # RLD's greedy answer
PER_CHUNK = 3  # RLD's tokens per stream chunk: a hold of 5 falls inside a chunk
HOLD = 5
WAN_BYTES = 4096


def md_answer(handed: list[int]) -> list[int]:
    """MD's answer continuing `handed` (what the client had from RLD), to MAX_NEW tokens."""
    return handed + [500 + i for i in range(MAX_NEW - len(handed))]


def text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


async def stream(request: web.Request, rid: str, ids: list[int], step: int) -> web.StreamResponse:
    """SGLang's cumulative stream of `ids`, `step` tokens a chunk, the last finished by length."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    ends = [*range(step, len(ids), step), len(ids)]
    for end in ends:
        finish = {"type": "length", "length": len(ids)} if end == len(ids) else None
        meta = {"id": rid, "finish_reason": finish, "completion_tokens": end}
        chunk = {"output_ids": ids[:end], "text": text(ids[:end]), "meta_info": meta}
        await resp.write(encode_event(chunk))
        await asyncio.sleep(0.01)
    await resp.write(encode_event(DONE))
    return resp


@dataclass
class Fakes:
    ready: str  # when MD sends READY: "early" (at once), "late" (after RLD's end), "never"
    relay_done: asyncio.Event | None = None
    got: list[Chunk | Handoff] = field(default_factory=list)  # what MD was handed, in order
    aborted: dict[str, list[Any]] = field(default_factory=lambda: {"relay": [], "main": []})


def fake_prefill() -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        return web.json_response({"text": "", "output_ids": [], "meta_info": {}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app)
    return app


def fake_relay(fakes: Fakes) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fakes.relay_done = fakes.relay_done or asyncio.Event()
        if fakes.ready == "early":
            await asyncio.sleep(0.3)  # MD's READY comes before the client has any token
        resp = await stream(request, body["rid"], RLD, PER_CHUNK)
        fakes.relay_done.set()
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app, fakes.aborted["relay"])
    return app


def fake_main(fakes: Fakes, control_port: int) -> web.Application:
    """MD: READY per `fakes.ready` (P -> MD: after its answer), ACKs for Catch-Up chunks, and
    after the HANDOFF the rest of the answer."""
    control = ControlSocket()
    control.bind(f"tcp://127.0.0.1:{control_port}")
    reply_to = ""  # the router's control socket, from the request's route hint

    async def handed(rid: str) -> list[int]:
        tokens: list[int] = []
        while True:
            for msg in control.recv_nowait():  # the router's cache-sync requests too
                if isinstance(msg, Chunk | Handoff) and msg.rid == rid:
                    fakes.got.append(msg)
                    assert msg.start == len(tokens), msg
                    tokens += msg.tokens
                    if isinstance(msg, Handoff):
                        return tokens
                    control.send(reply_to, Ack(rid, len(tokens)))
            await asyncio.sleep(0.01)

    async def generate(request: web.Request) -> web.StreamResponse:
        nonlocal reply_to
        body = await request.json()
        rid, hint = body["rid"], parse_route_hint(body["kv_hints"])
        assert hint is not None
        reply_to = hint.reply_to
        ready = Ready(rid, prompt_len=4, cached_len=0, wan_kv_bytes=WAN_BYTES, first_token=RLD[0])
        if not hint.park:  # P -> MD: its READY comes after its answer, as on a congested link
            resp = await stream(request, rid, RLD, PER_CHUNK)
            # Not in this handler: the router's hanging up once it has [DONE] cancels it.
            asyncio.get_running_loop().call_later(0.3, control.send, reply_to, ready)
            return resp
        if fakes.ready == "late":
            while fakes.relay_done is None or not fakes.relay_done.is_set():
                await asyncio.sleep(0.01)
        if fakes.ready != "never":
            control.send(reply_to, ready)
        return await stream(request, rid, md_answer(await handed(rid)), MAX_NEW)

    async def close(_: web.Application) -> None:
        control.close()

    app = web.Application()
    app.router.add_post("/generate", generate)
    ok_routes(app, fakes.aborted["main"])
    app.on_cleanup.append(close)
    return app


@contextmanager
def router(fakes: Fakes, **config: Any) -> Iterator[str]:
    """The router in front of the fakes; its URL."""
    ports = {role: free_port() for role in ("prefill", "relay", "main", "router")}
    url = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    control = free_port()
    cfg = RouterConfig(
        prefill=(PrefillTarget(url["prefill"], free_port()),), relay=(RelayTarget(url["relay"]),),
        main=(MainTarget(url["main"], control),), path="pdd", port=ports["router"], **config,
    )  # fmt: skip
    apps = [(fake_prefill(), ports["prefill"]), (fake_relay(fakes), ports["relay"]),
            (fake_main(fakes, control), ports["main"]),
            (make_app(cfg), ports["router"])]  # fmt: skip
    with serving(apps):
        yield url["router"]


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read().decode()
            if not body.get("stream"):
                return resp.status, json.loads(raw)
            events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return resp.status, [json.loads(e) for e in events[:-1]]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def request(hold: int | None = HOLD, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": MAX_NEW}, **extra}
    return body if hold is None else {**body, "pdd_hold_relay": hold}


# --- pure -----------------------------------------------------------------------------------


def chunk(ids: list[int], finish: bool = False) -> StreamChunk:
    meta = {"finish_reason": {"type": "length"} if finish else None}
    return StreamChunk("relay", {"output_ids": ids, "text": text(ids), "meta_info": meta}, "r")


def test_a_hold_passes_the_first_k_tokens_and_holds_the_rest() -> None:
    hold = RelayHold(5)
    early = chunk(RLD[:3])
    assert hold.admit(early, "") is early and not hold.engaged
    crossing = chunk(RLD[:6])
    cut = hold.admit(crossing, text(RLD[:3]))
    assert isinstance(cut, StreamChunk) and hold.engaged
    assert cut.chunk["output_ids"] == RLD[:5] and cut.chunk["text"] == text(RLD[:3])
    assert cut.chunk["meta_info"] == {"finish_reason": None, "completion_tokens": 5}
    later, end = chunk(RLD[:9], finish=True), StreamEnd("relay", None, "r")
    assert hold.admit(later, "") is None and hold.admit(end, "") is None
    assert hold.release() == [crossing, later, end] and hold.release() == []


def test_a_chunk_of_exactly_k_passes_whole_unless_it_finishes() -> None:
    exact = chunk(RLD[:5])
    assert RelayHold(5).admit(exact, "") is exact
    final = chunk(RLD[:5], finish=True)
    hold = RelayHold(5)
    cut = hold.admit(final, "")
    assert isinstance(cut, StreamChunk) and cut.chunk["text"] == text(RLD[:5])
    assert cut.chunk["meta_info"]["finish_reason"] is None and hold.held == [final]
    assert first_tokens(final.chunk, 5, "")["output_ids"] == RLD[:5]


# --- the router in front of fakes ---------------------------------------------------------------


@pytest.mark.parametrize("ready", ["early", "late"])
@pytest.mark.parametrize("streamed", [False, True])
def test_the_handoff_comes_at_exactly_k_tokens_whenever_md_is_ready(
    ready: str, streamed: bool
) -> None:
    """READY before the client has k tokens waits for them; READY after RLD ended finds RLD's
    later chunks and end held. Either way MD gets exactly the client's k tokens."""
    fakes = Fakes(ready)
    with router(fakes, test_controls=True, handoff=HandoffPolicy(mode="extend")) as url:
        status, got = post(url, request(stream=streamed))
    assert status == 200, got
    expected = md_answer(RLD[:HOLD])
    if streamed:  # cumulative: no chunk holds an RLD token past the k
        assert all(c["output_ids"] == expected[: len(c["output_ids"])] for c in got), got
        got = got[-1]
    assert got["output_ids"] == expected and got["text"] == text(expected)
    pdd = got["meta_info"]["pdd"]
    assert pdd["path"] == "P->RLD->MD" and pdd["handoff_mode"] == "extend", pdd
    assert pdd["relay_tokens"] == HOLD and pdd["main_tokens"] == MAX_NEW - HOLD, pdd
    assert "relay_held" in pdd["timings"] and pdd["wan_kv_bytes"] == WAN_BYTES, pdd
    assert fakes.got == [Handoff(pdd["rid"], 0, tuple(RLD[:HOLD]))]


def test_catch_up_under_a_hold_hands_over_exactly_k_tokens_in_chunks() -> None:
    fakes = Fakes("early")
    policy = HandoffPolicy(mode="catchup", chunk=2, threshold=2)
    with router(fakes, test_controls=True, handoff=policy) as url:
        status, got = post(url, request())
    assert status == 200 and got["output_ids"] == md_answer(RLD[:HOLD]), got
    pdd = got["meta_info"]["pdd"]
    assert pdd["handoff_mode"] == "catchup" and pdd["chunks"] == 2, pdd
    assert pdd["relay_tokens"] == HOLD, pdd
    rid = pdd["rid"]
    assert fakes.got == [Chunk(rid, 0, tuple(RLD[:2])), Chunk(rid, 2, tuple(RLD[2:4])),
                         Handoff(rid, 4, tuple(RLD[4:5]))]  # fmt: skip


def test_without_a_ready_the_hold_ends_at_the_ready_deadline_and_rld_finishes() -> None:
    fakes = Fakes("never")
    with router(fakes, test_controls=True, timeouts=Timeouts(ready=1.0)) as url:
        status, got = post(url, request())
    assert status == 200 and got["output_ids"] == RLD, got
    pdd = got["meta_info"]["pdd"]
    assert pdd["path"] == "P->RLD" and pdd["md_failure"] == "MD not ready within 1s", pdd
    assert pdd["relay_tokens"] == MAX_NEW and pdd["timings"]["end"] >= 1.0, pdd


def test_the_hold_needs_a_router_started_with_test_controls() -> None:
    with router(Fakes("early")) as url:
        status, got = post(url, request())
        assert status == 400 and "pdd_hold_relay" in got["error"]["message"], got
        assert post(url, request(hold=None))[0] == 200  # the same request without the field
    with router(Fakes("early"), test_controls=True) as url:
        for bad in (0, -1, "3", True, 2.5):
            status, got = post(url, request(hold=bad))  # type: ignore[arg-type]
            assert status == 400 and "pdd_hold_relay" in got["error"]["message"], (bad, got)


def test_a_p_to_md_answer_waits_for_mds_late_ready() -> None:
    """MD's READY (what crossed the WAN) can come after its answer's end: the answer waits."""
    with router(Fakes("late")) as url:
        status, got = post(url, request(hold=None, pdd_path="main"))
    assert status == 200 and got["output_ids"] == RLD, got
    pdd = got["meta_info"]["pdd"]
    assert pdd["path"] == "P->MD" and pdd["wan_kv_bytes"] == WAN_BYTES, pdd
    assert pdd["timings"]["end"] < pdd["timings"]["ready"], pdd  # "end": MD's answer's end
