"""PDD end to end on the testbed: P and RelayDecode in datacenter A, MainDecode in B, the PDD
router in A; real SGLang servers, Mooncake over the emulated WAN, the control plane over ZMQ.

Every path must produce a colocated server's greedy tokens, streamed or not.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from pdd.eval.client import stream_generate
from pdd.eval.cpu import SCHEDULER_TITLE, CpuSampler, Watched
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer
from pdd.launch.testbed import Testbed
from tests.conftest import SharedPDD, running
from tests.idle_checks import after_idle_checks
from tests.log_checks import tracebacks
from tests.marks import needs_root
from tests.test_pd_same_dc import random_ids

SLOW_MBIT = 0.625
# A scheduler that only waits on the WAN: well under a tenth of a core measured; one that spins
# takes a whole one.
WAITING_CORES = 0.25
MAX_NEW = 48
# The routers honour test controls: a request that needs MD to take part holds RLD's output at
# HOLD tokens until MD is ready (pdd_hold_relay, pdd.router.hold), so it is handed off at exactly
# HOLD tokens however fast RLD decodes on a given machine.
TEST_CONTROLS = ("--test-controls",)
HOLD = 8
# The Catch-Up routers feed MD once the client has 40 tokens; held there, MD catches up on them
# in 16-token chunks (two, then the final handoff of the last 8).
CATCHUP_HOLD = 40
CATCHUP_NEW = 96

pytestmark = needs_root


@dataclass
class Setup:
    tb: Testbed
    colocated: SGLangServer
    pdd: PDDDeployment
    catchup: RouterService  # a second router on the same servers, Catch-Up in small chunks
    shared: SharedPDD
    logs_from: dict[str, int]  # where each server's log stood when this module began

    def reference(self, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
        return generate(self.colocated.url, body(ids, max_new))["output_ids"]


def body(ids: list[int], max_new: int = MAX_NEW, **extra: object) -> dict:
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sampling, **extra}


@pytest.fixture(scope="module")
def setup(pdd_testbed: SharedPDD, colocated: SGLangServer) -> Iterator[Setup]:
    pdd = pdd_testbed.pdd
    catchup = RouterService(
        "router-catchup", free_port(), pdd.router.log_dir, [pdd.prefill], [pdd.relay], [pdd.main],
        pdd_testbed.tb.placement("a"),
        # MD is fed only once RLD has streamed 40 tokens, so Catch-Up always has work; after 4
        # chunks the rest goes in the final handoff.
        path="pdd",
        extra_args=["--handoff-mode", "catchup", "--catchup-chunk", "16",
                    "--catchup-threshold", "8", "--catchup-max-chunks", "4",
                    "--md-feed-after-tokens", "40", *TEST_CONTROLS],
    )  # fmt: skip
    logs_from = pdd_testbed.log_sizes()
    with running([catchup]):
        yield Setup(pdd_testbed.tb, colocated, pdd, catchup, pdd_testbed, logs_from)


def pdd_meta(result: dict) -> dict:
    return result["meta_info"]["pdd"]


def test_extend_handoff_equals_colocated(setup: Setup) -> None:
    for n in (200, 1500):
        ids = random_ids(n, seed=3000 + n)
        got = generate(setup.pdd.url, body(ids, pdd_hold_relay=HOLD))
        assert got["output_ids"] == setup.reference(ids), n
        meta = pdd_meta(got)
        print(f"extend meta ({n} tokens):", meta)
        assert meta["path"] == "P->RLD->MD", meta
        assert meta["handoff_mode"] == "extend", meta
        assert meta["relay_tokens"] == HOLD and meta["main_tokens"] == MAX_NEW - HOLD, meta
        # What MD lacked crossed the WAN (fresh prompts: all of it, bar a chance first token).
        assert meta["md_cached_tokens"] <= 1, meta
        assert meta["wan_kv_bytes"] == (n - meta["md_cached_tokens"]) * 1024, meta  # float32


def test_catch_up_handoff_in_several_chunks_equals_colocated(setup: Setup) -> None:
    ids = random_ids(1200, seed=41)
    got = generate(setup.catchup.url, body(ids, CATCHUP_NEW, pdd_hold_relay=CATCHUP_HOLD))
    assert got["output_ids"] == setup.reference(ids, CATCHUP_NEW)
    meta = pdd_meta(got)
    print("catch-up meta:", meta)
    assert meta["path"] == "P->RLD->MD" and meta["handoff_mode"] == "catchup", meta
    assert meta["chunks"] == 2 and meta["relay_tokens"] == CATCHUP_HOLD, meta


def test_request_ending_on_relay_equals_colocated_and_cancels_md(setup: Setup) -> None:
    ids = random_ids(700, seed=42)
    ref = setup.reference(ids, max_new=2)
    with slow_link(setup.tb, setup.pdd.url):  # the KV takes seconds: RLD surely finishes first
        got = generate(setup.pdd.url, body(ids, max_new=2))
    assert got["output_ids"] == ref
    meta = pdd_meta(got)
    assert meta["relay_tokens"] == 2 and meta["handoff_mode"] is None, meta


def wait_until_md_up(router_url: str, timeout_s: float = 60.0) -> None:
    """The router's health checks of MD cross the WAN too: while a transfer saturated a slow
    link MD may have looked down, and a request planned then would leave it out."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{router_url}/status", timeout=10) as resp:
            mains = json.loads(resp.read())["instances"]["main"]
        if all(m["up"] for m in mains):
            return
        assert time.monotonic() < deadline, f"MD still down on the router: {mains}"
        time.sleep(0.5)


@contextmanager
def slow_link(tb: Testbed, router_url: str) -> Iterator[None]:
    """The link at SLOW_MBIT for the block; after it, the link restored and MD up again on the
    router, so the next request is planned as on a quiet link."""
    tb.set_rate(SLOW_MBIT)
    try:
        yield
    finally:
        tb.restore()
        wait_until_md_up(router_url)


def cores_while_kv_crosses(
    tb: Testbed, p: SGLangServer, md: SGLangServer, router_url: str, request: dict
) -> tuple[dict, dict[str, float]]:
    """Sends `request` P -> MD with the link at SLOW_MBIT; returns the answer and the cores P's
    and MD's scheduler processes used from 2 to 6 s after it was sent (P has prefilled well
    before and is sending). Checks that the KV was still crossing at the window's end."""
    schedulers = {name: Watched(server.process.pgid, SCHEDULER_TITLE)
                  for name, server in (("P", p), ("MD", md))
                  if server.process is not None}  # fmt: skip
    sampler = CpuSampler(schedulers)
    sampler.start()
    try:
        with slow_link(tb, router_url), ThreadPoolExecutor(1) as pool:
            answer = pool.submit(generate, router_url, {**request, "pdd_path": "main"}, 120)
            start = time.monotonic()
            time.sleep(6)
            cores = sampler.cores(start + 2, start + 6)
            got = answer.result()
    finally:
        sampler.stop.set()
        sampler.join()
    meta = pdd_meta(got)
    assert meta["path"] == "P->MD", meta
    wan_s = meta["wan_kv_bytes"] * 8 / (SLOW_MBIT * 1e6)
    assert wan_s > 6, f"the KV crossed in {wan_s:.1f} s: the window did not see it in flight"
    assert len(cores) == 2, cores
    return got, cores


def test_schedulers_wait_without_spinning_while_kv_crosses(setup: Setup) -> None:
    """P -> MD over a slow link: P's scheduler sends the KV, MD's waits for it, and neither has
    anything else to do meanwhile."""
    ids = random_ids(700, seed=47)  # 700 KB of the tiny model's KV: ~9 s at 0.625 Mbit/s
    got, cores = cores_while_kv_crosses(setup.tb, setup.pdd.prefill, setup.pdd.main,
                                        setup.pdd.url, body(ids))  # fmt: skip
    assert got["output_ids"] == setup.reference(ids)
    print(f"scheduler cores while KV crosses: {cores}")
    assert all(c < WAITING_CORES for c in cores.values()), cores


def test_streamed_equals_non_streamed(setup: Setup) -> None:
    ids = random_ids(900, seed=43)
    whole = generate(setup.pdd.url, body(ids, pdd_hold_relay=HOLD))
    chunks = stream_generate(setup.pdd.url, body(ids, pdd_hold_relay=HOLD)).chunks
    assert chunks[-1]["output_ids"] == whole["output_ids"] == setup.reference(ids)
    assert chunks[-1]["text"] == whole["text"]
    # Cumulative chunks: each extends the previous, so every token reaches the client once.
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    for meta in (pdd_meta(whole), pdd_meta(chunks[-1])):
        assert meta["path"] == "P->RLD->MD" and meta["relay_tokens"] == HOLD, meta


@pytest.mark.parametrize("path", ["relay", "main"])
def test_single_tier_paths_equal_colocated(setup: Setup, path: str) -> None:
    ids = random_ids(400, seed=44)
    got = generate(setup.pdd.url, body(ids, pdd_path=path))
    assert got["output_ids"] == setup.reference(ids)
    assert pdd_meta(got)["path"] == {"relay": "P->RLD", "main": "P->MD"}[path]


def test_sixteen_concurrent_handoffs_equal_colocated(setup: Setup) -> None:
    prompts = [random_ids(100 + 60 * i, seed=600 + i) for i in range(16)]
    refs = [setup.reference(ids) for ids in prompts]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(
            lambda ids: generate(setup.pdd.url, body(ids, pdd_hold_relay=HOLD), 300), prompts
        ))  # fmt: skip
    for i, (g, ref) in enumerate(zip(got, refs, strict=True)):
        assert g["output_ids"] == ref, f"request {i}"
        meta = pdd_meta(g)
        assert meta["path"] == "P->RLD->MD" and meta["relay_tokens"] == HOLD, (i, meta)
        assert meta["main_tokens"] == MAX_NEW - HOLD, (i, meta)


def test_no_kv_leaked_anywhere(setup: Setup) -> None:
    """Runs last: every server, once idle after this module's requests, ran SGLang's own
    (strict) leak check and found nothing; and all still serve."""
    since = setup.shared.log_sizes()
    ids = random_ids(64, seed=45)  # through P, RLD and MD: each works after every earlier test
    got = generate(setup.pdd.url, body(ids, pdd_hold_relay=HOLD))
    assert got["output_ids"] == setup.reference(ids)
    assert pdd_meta(got)["path"] == "P->RLD->MD"
    after_idle_checks(lambda: setup.shared.logs_since(since))
    for name, log in setup.shared.logs_since(setup.logs_from).items():  # this module's part
        assert "memory leak" not in log, name
        assert not tracebacks(log), name
