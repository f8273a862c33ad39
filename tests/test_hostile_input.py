"""Hostile input against a live PDD deployment (tiny model): each tier's /generate directly and
the router's, and MD's control socket. Every bad request gets a 4xx with a reason (the control
plane drops and counts), and after each one a normal request through P -> RLD -> MD succeeds
and no server has exited.

The fuzz tests send every field of SGLang's generate request and sampling parameters with
hostile values (tests.hostile_requests): through the router, each is a 4xx naming the field;
the extremes the router lets through are served or fail alone; and sent straight to P and a
decoder as a PD pair (what the router would send, without its checks) no tier dies. Each prints
a summary line: requests, fields, tiers died."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import requests
import zmq

from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port, stop_groups
from pdd.launch.router import RouterService, main_control_port
from pdd.launch.servers import SGLangServer
from tests.hostile_requests import edges, refused

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


def post(url: str, body: object, timeout: float = TIMEOUT_S) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}/generate", data=data, timeout=timeout,
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


@pytest.mark.parametrize("tier", ["prefill", "main"])
def test_a_bootstrap_room_in_use_is_refused_and_the_first_request_is_unharmed(
    live: Deployment, tier: str
) -> None:
    # Two requests with one room on one server share its KV transfer state: P's scheduler died of
    # it (n > 1 did the same). Neither request can finish without its PD partner, so both are in
    # flight together whichever arrives first: that one keeps the room, the other is refused.
    server: SGLangServer = getattr(live.dep, tier)
    p = live.dep.prefill
    room = random.randrange(2**62)
    bodies = [{"input_ids": [5, 6, 7], "rid": f"room-{tier}-{side}", "bootstrap_host": p.host,
               "bootstrap_port": p.bootstrap_port, "bootstrap_room": room,
               "sampling_params": {"max_new_tokens": 4}} for side in "ab"]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(post, server.url, body) for body in bodies]
        done, _ = wait(futures, timeout=TIMEOUT_S, return_when=FIRST_COMPLETED)
        assert len(done) == 1, f"{tier}: {len(done)} of the two answered before either aborted"
        refused_one = done.pop().result()
        check_refused(refused_one, f"{tier}, a second request with room {room}")
        assert f"bootstrap_room {room} is already in use" in refused_one.text
        for body in bodies:
            _abort(server.url, body["rid"])
        kept = [r for r in (f.result() for f in futures) if r is not refused_one]
    assert kept[0].status_code != 200, f"{tier}: the kept request was not aborted: {kept[0].text}"
    assert_still_serving(live)


# --- the fuzz: every field, hostile values -----------------------------------------------------

SERVE_CHECK_EVERY = 25  # cases between two full serving checks (process checks: every case)
# A pair that one side refuses and the other waits on (its abort lost) ends here.
PAIR_TIMEOUT_S = 20.0


@dataclass
class Fuzz:
    """What a fuzz run sent and saw, for its summary line."""

    where: str
    requests: int = 0
    fields: set[str] = field(default_factory=set)
    statuses: Counter[int] = field(default_factory=Counter)
    served_edges: list[str] = field(default_factory=list)
    failed_edges: list[str] = field(default_factory=list)

    def saw(self, body: object, *codes: int) -> None:
        """One case sent (`codes`: each request's HTTP status): its fields are counted."""
        self.requests += len(codes)
        self.statuses.update(codes)
        if isinstance(body, dict):
            params = body.get("sampling_params")
            self.fields.update(
                k for k in body if k != "sampling_params" or not isinstance(params, dict)
            )
            if isinstance(params, dict):
                self.fields.update(f"sampling_params.{k}" for k in params)

    def line(self, died: int) -> str:
        codes = ", ".join(f"{c}: {n}" for c, n in sorted(self.statuses.items()))
        edges = ""
        if self.served_edges or self.failed_edges:
            edges = (f"; edges served {len(self.served_edges)}, failed alone "
                     f"{len(self.failed_edges)} {self.failed_edges}")  # fmt: skip
        return (f"fuzz {self.where}: {self.requests} requests, {len(self.fields)} fields, "
                f"{died} tiers died (statuses {codes}){edges}")  # fmt: skip


def tiers_alive(live: Deployment, what: str) -> None:
    for part in [live.dep.router, *live.dep.servers()]:
        assert part.process is not None and not part.process.exited(), (
            f"{part.name} died of {what}:\n{part.process.log_tail(60) if part.process else ''}"
        )


def test_fuzz_every_field_through_the_router(live: Deployment) -> None:
    fuzz = Fuzz("through the router")
    for i, (name, body) in enumerate(refused(live.vocab, live.context)):
        r = post(live.dep.url, body)
        fuzz.saw(body, r.status_code)
        check_refused(r, f"router, {name}")
        message = r.json()["error"]["message"]
        assert message.startswith(name), f"{name}: the 400 does not name it: {message}"
        tiers_alive(live, f"{name}: {json.dumps(body)[:200]}")
        if i % SERVE_CHECK_EVERY == 0:
            assert_still_serving(live)
    for i, (what, body) in enumerate(edges(live.vocab, live.context)):
        path = ("pdd", "relay", "main")[i % 3]
        r = post(live.dep.url, {**body, "pdd_path": path})
        fuzz.saw(body, r.status_code)
        (fuzz.served_edges if r.status_code == 200 else fuzz.failed_edges).append(what)
        if r.status_code != 200:
            assert r.text.strip(), f"{what}: failed without a reason"
        tiers_alive(live, f"{what} on {path}")
        assert_still_serving(live)
    print(fuzz.line(died=0))


def _abort(url: str, rid: str) -> None:
    try:
        requests.post(f"{url}/abort_request", json={"rid": rid}, timeout=10)
    except requests.RequestException:
        pass  # best effort: the tier may have finished or refused it already


def send_pair(live: Deployment, decoder: SGLangServer, body: Any, n: int) -> tuple[int, int]:
    """`body` to P and `decoder` at once, as the router pairs them (same bootstrap room), minus
    the router's checks. When one side fails the other is aborted, as the router does.
    The two HTTP statuses (0: no answer in time)."""
    p = live.dep.prefill
    room = random.randrange(2**62)
    bodies = []
    for side in ("p", "d"):
        extra = {"rid": f"fuzz-{decoder.name}-{n}-{side}", "bootstrap_host": p.host,
                 "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}  # fmt: skip
        bodies.append({**body, **extra} if isinstance(body, dict) else body)
    urls = [p.url, decoder.url]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(post, url, b, PAIR_TIMEOUT_S)
                   for url, b in zip(urls, bodies, strict=True)]  # fmt: skip
        done, _ = wait(futures, timeout=PAIR_TIMEOUT_S, return_when=FIRST_COMPLETED)
        first_failed = any(f.exception() or f.result().status_code != 200 for f in done)
        if first_failed or not done:
            for url, b in zip(urls, bodies, strict=True):
                if isinstance(b, dict):
                    _abort(url, b["rid"])
        wait(futures, timeout=PAIR_TIMEOUT_S)
        return tuple(_status(f) for f in futures)  # type: ignore[return-value]


def _status(f: Future[requests.Response]) -> int:
    if not f.done() or f.exception() is not None:
        return 0
    return f.result().status_code


def test_fuzz_through_a_router_without_the_model(live: Deployment) -> None:
    # It cannot check ids against the vocabulary or lengths against the context window: what
    # it forwards, the tiers refuse or serve, and none of them dies.
    fuzz = Fuzz("through a router without the model")
    for name, body in refused(live.vocab, live.context):
        r = post(live.bare.url, body)
        fuzz.saw(body, r.status_code)
        assert r.text.strip(), f"router without --tokenizer, {name}: an empty answer"
        tiers_alive(live, f"{name}: {json.dumps(body)[:200]}")
    assert_still_serving(live)
    print(fuzz.line(died=0))


def test_fuzz_every_field_straight_to_p_and_md(live: Deployment) -> None:
    # What slips past the router (or comes without one) must cost one request, never a tier.
    # P and MD: MD runs every decode-side hook RLD runs and its own (RLD, a plain decoder with
    # the same guard, took ~8 minutes more of the suite for the same cases).
    decoder: SGLangServer = live.dep.main
    fuzz = Fuzz("straight to P and MD")
    cases = [*refused(live.vocab, live.context), *edges(live.vocab, live.context)]
    for i, (name, body) in enumerate(cases):
        fuzz.saw(body, *send_pair(live, decoder, body, i))
        tiers_alive(live, f"{name}: {json.dumps(body)[:200]}")
        if i % SERVE_CHECK_EVERY == 0:
            assert_still_serving(live)
    assert_still_serving(live)
    print(fuzz.line(died=0))
