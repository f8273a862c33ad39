"""The router's automatic path choice and instance health, live on the testbed.

P and RLD in datacenter A, two MDs in B, the router in A with `--path auto`. The WAN is slow
(4 Mbit/s) so that, with the tiny model's 1 KB of KV per token (float32), a fresh 1000-token prompt
takes seconds to reach MD, missing the router's 1 s TTFT SLA, while a conversation's next turn (MD
holds all but its last few tokens) meets it: the three paths each become the right one for some
request. RLD is small (two requests at once, as its server reports), so the guard shows; a
second RLD, with a KV pool too small for a long prompt beside SGLang's decode reservation, has a
router of its own, to show the guard on RLD's KV room.
Where a test needs MD to take over, RLD holds its output at HOLD tokens until MD is ready
(pdd_hold_relay), so the handoff happens on any machine, however fast RLD decodes.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.eval.client import mirrored_tokens, wait_mirrored
from pdd.launch.pd_local import generate
from pdd.launch.process import free_port
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from tests.conftest import running
from tests.marks import needs_root
from tests.test_pd_same_dc import random_ids

HEALTH_S = 1.0
TTFT_SLA_S = 1.0
RLD_CAPACITY = 2
SMALL_RLD_POOL = 3072  # KV tokens: idle, it admits 3072 - 512 reserved = 2560 prompt tokens
BUSY_NEW = 1000
# Output tokens: RLD decoding them takes seconds (x the policy's margin 1.5, longer than any
# transfer here: 2 s for a fresh 1000-token prompt) at >= 5 ms a token, 3x this CPU's speed.
LONG = 300
HOLD = 8
BLOCK_SLACK = 64  # the router mirrors MD's cache in whole blocks

pytestmark = needs_root


@dataclass
class Setup:
    tb: Testbed
    colocated: SGLangServer
    mains: list[SGLangServer]
    router: RouterService
    conversation: list[int]  # the prompt of the conversation's next turn
    unguarded: RouterService  # the same servers, --no-relay-guard
    kv_guarded: RouterService  # P and the MDs, with an RLD of SMALL_RLD_POOL KV tokens

    def ask(self, ids: list[int], max_new: int, **extra: object) -> dict:
        sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
        body = {"input_ids": ids, "sampling_params": sampling, **extra}
        return generate(self.router.url, body, 300)

    def reference(self, ids: list[int], max_new: int) -> list[int]:
        sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
        got = generate(self.colocated.url, {"input_ids": ids, "sampling_params": sampling})
        return got["output_ids"]

    def status(self) -> dict:
        return status_at(self.router.url)


@pytest.fixture(scope="module")
def setup(
    tiny_model: Path, colocated: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    tb = Testbed("pddroute", LinkParams(4.0, 20.0), net="10.227")
    tb.down()
    tb.up()
    run_dir = tmp_path_factory.mktemp("router_policy")
    a, b = tb.placement("a"), tb.placement("b")
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
        extra_args=["--pdd-role", "relay", "--max-running-requests", str(RLD_CAPACITY)],
    )
    small_relay = SGLangServer("small_relay", tiny_model, free_port(), run_dir, a, mode="decode",
                               extra_args=["--pdd-role", "relay", "--max-total-tokens",
                                           str(SMALL_RLD_POOL)])  # fmt: skip
    mains = [
        SGLangServer(f"main{i}", tiny_model, free_port(), run_dir, b, mode="decode",
                     extra_args=["--pdd-role", "main", "--pdd-control-port", str(free_port()),
                                 "--disaggregation-decode-enable-radix-cache"])
        for i in range(2)
    ]  # fmt: skip
    router = RouterService(
        "router", free_port(), run_dir, [prefill], [relay], mains, a,
        extra_args=["--health-interval", str(HEALTH_S), "--ttft-sla", str(TTFT_SLA_S),
                    "--test-controls"],
    )  # fmt: skip
    unguarded = RouterService(
        "unguarded", free_port(), run_dir, [prefill], [relay], mains, a,
        extra_args=["--health-interval", str(HEALTH_S), "--ttft-sla", str(TTFT_SLA_S),
                    "--no-relay-guard"],
    )  # fmt: skip
    kv_guarded = RouterService(
        "kv_guarded", free_port(), run_dir, [prefill], [small_relay], mains, a,
        extra_args=["--health-interval", str(HEALTH_S), "--ttft-sla", str(TTFT_SLA_S)],
    )  # fmt: skip
    routers = [router, unguarded, kv_guarded]
    try:
        # The routers start once every server is ready.
        with running([prefill, relay, small_relay, *mains]), running(routers, colocated):
            yield Setup(tb, colocated, mains, router, [], unguarded, kv_guarded)
    finally:
        tb.down()


def check(setup: Setup, ids: list[int], max_new: int, **extra: object) -> dict:
    return check_at(setup, setup.router, ids, max_new, **extra)


def check_at(
    setup: Setup, router: RouterService, ids: list[int], max_new: int, **extra: object
) -> dict:
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": sampling, **extra}
    got = generate(router.url, body, 300)
    assert got["output_ids"] == setup.reference(ids, max_new)
    return got["meta_info"]["pdd"]


def learnt_mds(setup: Setup) -> int:
    return sum(bool(m["wan"]["mbit_per_s"]) for m in setup.status()["instances"]["main"])


def first_token_samples(setup: Setup) -> int:
    return sum(m["first_token_samples"] for m in setup.status()["instances"]["main"])


def test_fresh_prompts_with_long_answers_are_relayed_then_handed_off(setup: Setup) -> None:
    # Nothing measured yet: the safe path. Each transfer teaches the router its MD's link; the
    # router learns each MD on its own, so fresh prompts go on until both MDs have one (the
    # least loaded MD takes a fresh prompt, ties in turn). RLD holds at HOLD tokens until MD
    # is ready, so that MD takes part whichever of RLD's decode and the KV is faster.
    for seed in range(101, 107):
        meta = check(setup, random_ids(1000, seed=seed), LONG, pdd_hold_relay=HOLD)
        assert meta["path"] == "P->RLD->MD" and meta["handoff_mode"] is not None, meta
        assert meta["relay_tokens"] == HOLD and meta["main_tokens"] == LONG - HOLD, meta
        assert meta["path_reason"].startswith("low hit"), meta  # 1000 fresh tokens: ~2 s
        if learnt_mds(setup) == len(setup.mains):
            break
    assert learnt_mds(setup) == len(setup.mains), setup.status()["instances"]["main"]


def test_a_conversations_next_turn_goes_straight_to_the_md_that_holds_it(setup: Setup) -> None:
    ids = random_ids(600, seed=3)
    # A long answer, handed off: MD keeps the prompt and the answer.
    before = mirrored_tokens(setup.router.url)
    samples = first_token_samples(setup)
    first = setup.ask(ids, LONG, pdd_hold_relay=HOLD)
    first_meta = first["meta_info"]["pdd"]
    assert first_meta["path"] == "P->RLD->MD" and first_meta["main_tokens"] > 0, first_meta
    # With the link learnt, a relayed request also tells what P->MD's first token would take.
    assert first_token_samples(setup) == samples + 1, setup.status()["instances"]["main"]
    # The router learns what MD holds from MD's cache sync: wait until it mirrors the turn.
    holds = len(ids) + len(first["output_ids"]) - 1  # the last token's KV is never computed
    wait_mirrored(setup.router.url, before + holds - BLOCK_SLACK)
    turn = ids + first["output_ids"] + random_ids(20, seed=4)
    meta = check(setup, turn, 24)
    assert meta["path"] == "P->MD" and meta["path_reason"].startswith("meets the SLA"), meta
    assert meta["instances"]["main"] == first_meta["instances"]["main"], (first_meta, meta)
    assert meta["md_predicted_cached_tokens"] >= len(ids), meta
    setup.conversation[:] = turn


def test_long_fresh_input_with_a_tiny_answer_stays_on_relay(setup: Setup) -> None:
    before = int(setup.tb.wan.status()["counters"]["a_to_b"]["bytes"])
    meta = check(setup, random_ids(2000, seed=5), 4)
    assert meta["path"] == "P->RLD" and meta["path_reason"].startswith("singular"), meta
    sent = int(setup.tb.wan.status()["counters"]["a_to_b"]["bytes"]) - before
    assert sent < 0.1 * 2000 * 1024, sent  # the KV never crossed the WAN


def plan_beside_a_full_rld(setup: Setup, router: RouterService) -> dict:
    """A fresh low-hit request with a long answer, sent while RLD runs RLD_CAPACITY relay-only
    requests of BUSY_NEW tokens each (tens of seconds: they are still running when it is
    planned, which the end checks). RLD's pool (4096 tokens) holds them and the new one."""
    sampling = {"temperature": 0, "max_new_tokens": BUSY_NEW, "ignore_eos": True}
    with ThreadPoolExecutor(RLD_CAPACITY) as pool:

        def occupy(k: int) -> float:
            body = {"input_ids": random_ids(50, seed=40 + k), "sampling_params": sampling,
                    "pdd_path": "relay"}  # fmt: skip
            generate(router.url, body, 600)
            return time.monotonic()

        busy = [pool.submit(occupy, k) for k in range(RLD_CAPACITY)]
        deadline = time.monotonic() + 120
        while relay_load(setup, router) < RLD_CAPACITY:
            assert time.monotonic() < deadline, "RLD never reported the busy requests"
            time.sleep(0.2)
        sent = time.monotonic()
        meta = check_at(setup, router, random_ids(1000, seed=50), LONG)
        ends = [f.result() for f in busy]
    assert min(ends) > sent, "a busy request ended before the probe was planned"
    return meta


def relay_load(setup: Setup, router: RouterService) -> int:
    return int(status_at(router.url)["instances"]["relay"][0]["reported_load"] or 0)


def test_rld_reports_its_capacity_and_a_full_rld_sends_low_hit_requests_to_md(
    setup: Setup,
) -> None:
    assert setup.status()["instances"]["relay"][0]["capacity"] == RLD_CAPACITY
    meta = plan_beside_a_full_rld(setup, setup.router)
    assert meta["path"] == "P->MD" and meta["path_reason"].startswith("RLD full (2/2)"), meta


def test_without_the_guard_a_full_rld_takes_low_hit_requests_anyway(setup: Setup) -> None:
    meta = plan_beside_a_full_rld(setup, setup.unguarded)
    assert meta["path"] == "P->RLD->MD" and meta["path_reason"].startswith("low hit"), meta


def test_a_prompt_beyond_rlds_kv_room_goes_to_md(setup: Setup) -> None:
    """RLD's pool binds before its request count: the router reads its room from SGLang's own
    report (pool, committed tokens, the decode reservation) and sends a prompt that would wait
    for it P->MD; an unguarded RLD would hold it, and MD's feed with it."""
    url = setup.kv_guarded.url
    deadline = time.monotonic() + 60
    while (room := status_at(url)["instances"]["relay"][0]["kv_room"]) is None:
        assert time.monotonic() < deadline, "RLD never reported its KV"
        time.sleep(0.2)
    relay = status_at(url)["instances"]["relay"][0]
    assert room == SMALL_RLD_POOL - 512, relay
    assert (relay["kv_pool"], relay["kv_reserve"]) == (SMALL_RLD_POOL, 512), relay
    meta = check_at(setup, setup.kv_guarded, random_ids(room + 40, seed=60), LONG)
    assert meta["path"] == "P->MD", meta
    assert meta["path_reason"].startswith(f"RLD's KV full (room for {room} tokens)"), meta


def status_at(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/status", timeout=10) as resp:
        return json.loads(resp.read())


def test_a_killed_md_is_avoided_and_no_request_is_lost(setup: Setup) -> None:
    # P->MD by request: with 8 tokens to make the router may let RLD answer alone (whether RLD
    # beats the KV is a race), and the MD holding the conversation must be named here.
    turn = setup.ask(setup.conversation, 8, pdd_path="main")
    holder = turn["meta_info"]["pdd"]["instances"]["main"]
    dead = next(m for m in setup.mains if m.url == holder)
    alive = next(m for m in setup.mains if m.url != holder)
    assert dead.process is not None
    dead.process.stop()
    # At once (before a health check saw it): the router may still pick the dead MD (its cache
    # is there). Its refused connection marks it down, so one request at most tries it, and that
    # one is not lost: on P->MD it is planned again (the other MD decodes it), on P->RLD->MD RLD
    # finishes it; either way its meta names MD's failure.
    tried = []
    for k in range(3):
        ids = setup.conversation + random_ids(10, seed=10 + k)
        meta = check(setup, ids, 16)
        if meta["instances"].get("main") == dead.url:
            assert meta["md_failure"], meta
            tried.append(k)
        else:
            assert meta["instances"].get("main") in (None, alive.url), meta
    assert len(tried) <= 1, tried
    time.sleep(3 * HEALTH_S)
    status = setup.status()["instances"]["main"]
    assert [m["up"] for m in status] == [m.url != dead.url for m in setup.mains], status
    for k in range(3):
        meta = check(setup, random_ids(300, seed=20 + k), 16)
        assert meta["instances"].get("main") in (None, alive.url), meta
