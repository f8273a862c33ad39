"""The router's automatic path choice and instance health, live on the testbed.

P and RLD in datacenter A, two MDs in B, the router in A with `--path auto`. The WAN is slow
(4 Mbit/s) so that, with the tiny model's 1 KB of KV per token (float32), a fresh 1000-token prompt
takes seconds to reach MD while a conversation's next turn (MD holds all but its last few
tokens) takes a fraction of one: the three paths each become the right one for some request.
RLD's tokens are paced at 30 ms each, so its speed is the same on every machine.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.launch.pd_local import generate
from pdd.launch.process import free_port, stop_groups
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from tests.marks import needs_root
from tests.test_pd_same_dc import random_ids

HEALTH_S = 1.0
LONG = 300  # output tokens: 9 s of RLD at 30 ms each, far longer than any transfer here

pytestmark = needs_root


@dataclass
class Setup:
    tb: Testbed
    colocated: SGLangServer
    mains: list[SGLangServer]
    router: RouterService
    conversation: list[int]  # the prompt of the conversation's next turn

    def ask(self, ids: list[int], max_new: int) -> dict:
        sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
        return generate(self.router.url, {"input_ids": ids, "sampling_params": sampling}, 300)

    def reference(self, ids: list[int], max_new: int) -> list[int]:
        sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
        got = generate(self.colocated.url, {"input_ids": ids, "sampling_params": sampling})
        return got["output_ids"]

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.router.url}/status", timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module")
def setup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tb = Testbed("pddroute", LinkParams(4.0, 20.0), net="10.227")
    tb.down()
    tb.up()
    run_dir = tmp_path_factory.mktemp("router_policy")
    a, b = tb.placement("a"), tb.placement("b")
    colocated = SGLangServer("colocated", tiny_model, free_port(), run_dir)
    prefill = SGLangServer(
        "prefill",
        tiny_model,
        free_port(),
        run_dir,
        a,
        mode="prefill",
        bootstrap_port=free_port(),
        extra_args=["--pdd-role", "prefill"],
    )
    relay = SGLangServer(
        "relay",
        tiny_model,
        free_port(),
        run_dir,
        a,
        mode="decode",
        extra_args=["--pdd-role", "relay"],
    )
    mains = [
        SGLangServer(f"main{i}", tiny_model, free_port(), run_dir, b, mode="decode",
                     extra_args=["--pdd-role", "main", "--pdd-control-port", str(free_port()),
                                 "--disaggregation-decode-enable-radix-cache"])
        for i in range(2)
    ]  # fmt: skip
    router = RouterService(
        "router", free_port(), run_dir, [prefill], [relay], mains, a,
        extra_args=["--health-interval", str(HEALTH_S), "--relay-pace-ms", "30",
                    "--direct-max-ms", "500"],
    )  # fmt: skip
    servers = [colocated, prefill, relay, *mains]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        router.start()
        router.wait_ready()
        yield Setup(tb, colocated, mains, router, [])
    finally:
        groups = [s.process.pgid for s in [*servers, router] if s.process is not None]
        stop_groups(groups)
        tb.down()


def check(setup: Setup, ids: list[int], max_new: int) -> dict:
    got = setup.ask(ids, max_new)
    assert got["output_ids"] == setup.reference(ids, max_new)
    return got["meta_info"]["pdd"]


def test_fresh_prompts_with_long_answers_are_relayed_then_handed_off(setup: Setup) -> None:
    # Nothing measured yet: the safe path. The first transfer teaches the router the WAN.
    ids = random_ids(1000, seed=1)
    meta = check(setup, ids, LONG)
    assert meta["path"] == "P->RLD->MD" and meta["handoff_mode"] is not None, meta
    # Measured now: a fresh 1000-token prompt needs ~2 s on this WAN, RLD 9 s for its answer.
    meta = check(setup, random_ids(1000, seed=2), LONG)
    assert meta["path"] == "P->RLD->MD" and meta["path_reason"].startswith("low hit"), meta
    wan = setup.status()["instances"]["main"]
    assert any(m["wan"]["mbit_per_s"] for m in wan), wan


def test_a_conversations_next_turn_goes_straight_to_the_md_that_holds_it(setup: Setup) -> None:
    ids = random_ids(600, seed=3)
    first = setup.ask(ids, LONG)  # a long answer: handed off, so MD keeps prompt and answer
    first_meta = first["meta_info"]["pdd"]
    assert first_meta["path"] == "P->RLD->MD", first_meta
    time.sleep(0.5)  # MD's cache sync reaches the router
    turn = ids + first["output_ids"] + random_ids(20, seed=4)
    meta = check(setup, turn, 24)
    assert meta["path"] == "P->MD" and meta["path_reason"].startswith("high hit"), meta
    assert meta["instances"]["main"] == first_meta["instances"]["main"], (first_meta, meta)
    assert meta["md_predicted_cached_tokens"] >= len(ids), meta
    setup.conversation[:] = turn


def test_long_fresh_input_with_a_tiny_answer_stays_on_relay(setup: Setup) -> None:
    before = int(setup.tb.wan.status()["counters"]["a_to_b"]["bytes"])
    meta = check(setup, random_ids(2000, seed=5), 4)
    assert meta["path"] == "P->RLD" and meta["path_reason"].startswith("singular"), meta
    sent = int(setup.tb.wan.status()["counters"]["a_to_b"]["bytes"]) - before
    assert sent < 0.1 * 2000 * 1024, sent  # the KV never crossed the WAN


def test_a_killed_md_is_avoided_and_no_request_is_lost(setup: Setup) -> None:
    holder = setup.ask(setup.conversation, 8)["meta_info"]["pdd"]["instances"]["main"]
    dead = next(m for m in setup.mains if m.url == holder)
    alive = next(m for m in setup.mains if m.url != holder)
    assert dead.process is not None
    dead.process.stop()
    # At once: the router may still pick the dead MD (its cache is there); the request is not
    # lost: a refused connection marks it down and the request is planned again.
    for k in range(3):
        ids = setup.conversation + random_ids(10, seed=10 + k)
        meta = check(setup, ids, 16)
        assert meta["instances"].get("main") in (None, alive.url), meta
    time.sleep(3 * HEALTH_S)
    status = setup.status()["instances"]["main"]
    assert [m["up"] for m in status] == [m.url != dead.url for m in setup.mains], status
    for k in range(3):
        meta = check(setup, random_ids(300, seed=20 + k), 16)
        assert meta["instances"].get("main") in (None, alive.url), meta
