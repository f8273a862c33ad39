"""Hostile input against a live PDD deployment (tiny model): each tier's /generate directly and
the router's, and MD's control socket. Every bad request gets a 4xx with a reason (the control
plane drops and counts), and after each one a normal request through P -> RLD -> MD succeeds
and no server has exited."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import requests
import zmq

from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port, stop_groups
from pdd.launch.router import RouterService, main_control_port
from pdd.launch.servers import SGLangServer

TIMEOUT_S = 60.0


@dataclass
class Deployment:
    dep: PDDDeployment  # its router knows the model (--tokenizer): it checks ids itself
    bare: RouterService  # one that does not: the servers' own guard is all there is
    vocab: int
    context: int


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    config = json.loads((tiny_model / "config.json").read_text())
    run_dir = tmp_path_factory.mktemp("hostile")
    dep = PDDDeployment.create(tiny_model, run_dir, router_args=("--tokenizer", str(tiny_model)))
    bare = RouterService("router-bare", free_port(), run_dir, [dep.prefill], [dep.relay],
                         [dep.main], path="pdd")  # fmt: skip
    try:
        dep.up()
        bare.start()
        bare.wait_ready()
        yield Deployment(dep, bare, config["vocab_size"], config["max_position_embeddings"])
    finally:
        stop_groups([bare.process.pgid] if bare.process is not None else [])
        dep.down()


def post(url: str, body: object) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}/generate", data=data, timeout=TIMEOUT_S,
                         headers={"Content-Type": "application/json"})  # fmt: skip


def assert_still_serving(live: Deployment) -> None:
    for part in [live.dep.router, *live.dep.servers()]:
        assert part.process is not None and not part.process.exited(), (
            f"{part.name} exited:\n{part.process.log_tail() if part.process else ''}"
        )
    sampling = {"max_new_tokens": 4, "temperature": 0}
    body = {"input_ids": [5, 6, 7, 8], "pdd_path": "pdd", "sampling_params": sampling}
    r = post(live.dep.url, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4


def hostile_bodies(
    live: Deployment, extra: dict[str, object] | None = None
) -> list[tuple[str, object]]:
    v, n, x = live.vocab, live.context, extra or {}
    return [
        ("out-of-vocabulary id", {"input_ids": [v + 5, 3], **x}),
        ("negative id", {"input_ids": [-1, 3], **x}),
        ("empty prompt", {"input_ids": [], **x}),
        ("prompt over the context window", {"input_ids": [3] * (n + 10), **x}),
        (
            "absurd max_new_tokens",
            {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 10**12}, **x},
        ),
        (
            "negative temperature",
            {"input_ids": [3, 4], "sampling_params": {"temperature": -1}, **x},
        ),
        ("malformed JSON", b'{"input_ids": [1, 2'),
    ]


def check_refused(r: requests.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    assert r.text.strip(), f"{what}: no reason given"


@pytest.mark.parametrize("tier", ["prefill", "relay", "main"])
def test_each_tier_refuses_hostile_requests_sent_to_it_directly(
    live: Deployment, tier: str
) -> None:
    server: SGLangServer = getattr(live.dep, tier)
    # What the router would add, so that nothing but the input itself is wrong.
    p = live.dep.prefill
    bootstrap = {"bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port,
                 "bootstrap_room": random.randrange(2**62)}  # fmt: skip
    for what, body in hostile_bodies(live, bootstrap):
        check_refused(post(server.url, body), f"{tier}, {what}")
        assert_still_serving(live)


def test_servers_refuse_ids_a_router_without_the_model_lets_through(live: Deployment) -> None:
    # This router cannot know the vocabulary or the context window: P, RLD and MD get these.
    v, n = live.vocab, live.context
    for what, body in [
        ("out-of-vocabulary id", {"input_ids": [v + 5, 3]}),
        ("prompt over the context window", {"input_ids": [3] * (n + 10)}),
    ]:
        r = post(live.bare.url, body)
        check_refused(r, f"router without --tokenizer, {what}")
        assert_still_serving(live)


def test_router_refuses_hostile_requests(live: Deployment) -> None:
    extra = [
        ("unknown pdd_path", {"input_ids": [3, 4], "pdd_path": "teleport"}),
        ("oversized body", b'{"text": "' + b"a" * (65 << 20) + b'"}'),
    ]
    for what, body in [*hostile_bodies(live), *extra]:
        r = post(live.dep.url, body)
        check_refused(r, f"router, {what}")
        if what == "oversized body":
            assert r.status_code == 413
        else:
            assert "error" in r.json(), r.text
        assert_still_serving(live)


def test_md_control_socket_drops_malformed_and_oversized_messages(live: Deployment) -> None:
    main = live.dep.main
    addr = f"tcp://{main.host}:{main_control_port(main)}"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(addr)
    try:
        for frame in (b"\xc1garbage", msgpack.packb({"type": "handoff", "body": [1] * 10}),
                      msgpack.packb({"version": 1, "type": "cancel"}),
                      b"\x00" * (32 << 20)):  # fmt: skip
            sock.send(frame)
    finally:
        sock.close()
        ctx.term()
    log = Path(main.log_dir) / f"{main.name}.log"
    deadline = time.monotonic() + 30
    while "dropped malformed control message (3 so far)" not in log.read_text():
        assert time.monotonic() < deadline, "MD did not count the malformed messages"
        time.sleep(0.5)
    assert_still_serving(live)
