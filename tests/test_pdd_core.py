"""PDD end to end on the testbed: P and RelayDecode in datacenter A, MainDecode in B, the PDD
router in A; real SGLang servers, Mooncake over the emulated WAN, the control plane over ZMQ.

Every path must produce a colocated server's greedy tokens, streamed or not.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.eval.client import stream_generate
from pdd.eval.cpu import SCHEDULER_TITLE, CpuSampler, Watched
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from tests.conftest import serving
from tests.marks import needs_root
from tests.test_pd_same_dc import random_ids

RATE_MBIT = 100.0
DELAY_MS = 20.0  # one way: RTT 40 ms
SLOW_MBIT = 0.625
# A scheduler that only waits on the WAN: well under a tenth of a core measured; one that spins
# takes a whole one.
WAITING_CORES = 0.25
MAX_NEW = 48
# The routers pass RLD's tokens on at most one per 30 ms, so 200 tokens take RLD 6 s: MD is
# ready long before, however fast the tiny model decodes on a given machine.
LONG_NEW = 200
# For a test that needs MD to take part whatever the machine: 18 s of paced RLD (fresh-clone
# CIs saw RLD end LONG_NEW's 6 s before MD was ready); MD decodes the rest fast.
HANDOFF_NEW = 3 * LONG_NEW
RELAY_PACE = ("--relay-pace-ms", "30")

pytestmark = needs_root


@dataclass
class Setup:
    tb: Testbed
    colocated: SGLangServer
    pdd: PDDDeployment
    catchup: RouterService  # a second router on the same servers, Catch-Up in small chunks

    def reference(self, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
        return generate(self.colocated.url, body(ids, max_new))["output_ids"]


def body(ids: list[int], max_new: int = MAX_NEW, **extra: object) -> dict:
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sampling, **extra}


@pytest.fixture(scope="module")
def setup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tb = Testbed("pddcore", LinkParams(RATE_MBIT, DELAY_MS), net="10.217")
    tb.down()  # whatever a crashed earlier run left
    tb.up()
    run_dir = tmp_path_factory.mktemp("pdd_core")
    colocated = SGLangServer("colocated", tiny_model, free_port(), run_dir)
    pdd = PDDDeployment.create(
        tiny_model, run_dir, tb.placement("a"), tb.placement("b"),
        path="pdd", router_args=("--handoff-mode", "extend", *RELAY_PACE),
    )  # fmt: skip
    catchup = RouterService(
        "router-catchup", free_port(), run_dir, [pdd.prefill], [pdd.relay], [pdd.main],
        tb.placement("a"),
        # MD is fed only once RLD has streamed 40 tokens, so Catch-Up always has work; after 4
        # chunks the rest goes in the final handoff, long before RLD could finish.
        path="pdd",
        extra_args=["--handoff-mode", "catchup", "--catchup-chunk", "16",
                    "--catchup-threshold", "8", "--catchup-max-chunks", "4",
                    "--md-feed-after-tokens", "40", *RELAY_PACE],
    )  # fmt: skip
    try:
        with serving(colocated, pdd, catchup):
            yield Setup(tb, colocated, pdd, catchup)
    finally:
        tb.down()


def pdd_meta(result: dict) -> dict:
    return result["meta_info"]["pdd"]


def test_extend_handoff_equals_colocated(setup: Setup) -> None:
    for n in (200, 1500):
        ids = random_ids(n, seed=3000 + n)
        got = generate(setup.pdd.url, body(ids, max_new=LONG_NEW))
        assert got["output_ids"] == setup.reference(ids, max_new=LONG_NEW), n
        meta = pdd_meta(got)
        print(f"extend meta ({n} tokens):", meta)
        assert meta["path"] == "P->RLD->MD", meta
        assert meta["handoff_mode"] == "extend", meta
        assert 1 <= meta["relay_tokens"] < LONG_NEW, meta
        # What MD lacked crossed the WAN (fresh prompts: all of it, bar a chance first token).
        assert meta["md_cached_tokens"] <= 1, meta
        assert meta["wan_kv_bytes"] == (n - meta["md_cached_tokens"]) * 1024, meta  # float32


def test_catch_up_handoff_in_several_chunks_equals_colocated(setup: Setup) -> None:
    ids = random_ids(1200, seed=41)
    got = generate(setup.catchup.url, body(ids, max_new=LONG_NEW))
    assert got["output_ids"] == setup.reference(ids, max_new=LONG_NEW)
    meta = pdd_meta(got)
    print("catch-up meta:", meta)
    assert meta["path"] == "P->RLD->MD" and meta["handoff_mode"] == "catchup", meta
    assert meta["chunks"] >= 2, meta


def test_request_ending_on_relay_equals_colocated_and_cancels_md(setup: Setup) -> None:
    ids = random_ids(700, seed=42)
    ref = setup.reference(ids, max_new=2)
    setup.tb.set_rate(SLOW_MBIT)  # the KV takes seconds: RLD surely finishes first
    try:
        got = generate(setup.pdd.url, body(ids, max_new=2))
    finally:
        setup.tb.restore()
    assert got["output_ids"] == ref
    meta = pdd_meta(got)
    assert meta["relay_tokens"] == 2 and meta["handoff_mode"] is None, meta


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
    tb.set_rate(SLOW_MBIT)
    sampler.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(generate, router_url, {**request, "pdd_path": "main"}, 120)
            start = time.monotonic()
            time.sleep(6)
            cores = sampler.cores(start + 2, start + 6)
            got = answer.result()
    finally:
        tb.restore()
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
    ids, max_new = random_ids(900, seed=43), HANDOFF_NEW  # right after the slow-link test
    whole = generate(setup.pdd.url, body(ids, max_new=max_new))
    chunks = stream_generate(setup.pdd.url, body(ids, max_new=max_new)).chunks
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["text"] == whole["text"]
    # Cumulative chunks: each extends the previous, so every token reaches the client once.
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert pdd_meta(chunks[-1])["path"] == "P->RLD->MD", pdd_meta(chunks[-1])


@pytest.mark.parametrize("path", ["relay", "main"])
def test_single_tier_paths_equal_colocated(setup: Setup, path: str) -> None:
    ids = random_ids(400, seed=44)
    got = generate(setup.pdd.url, body(ids, pdd_path=path))
    assert got["output_ids"] == setup.reference(ids)
    assert pdd_meta(got)["path"] == {"relay": "P->RLD", "main": "P->MD"}[path]


def test_sixteen_concurrent_requests(setup: Setup) -> None:
    prompts = [random_ids(100 + 60 * i, seed=600 + i) for i in range(16)]
    refs = [setup.reference(ids) for ids in prompts]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda ids: generate(setup.pdd.url, body(ids), 300), prompts))
    for i, (g, ref) in enumerate(zip(got, refs, strict=True)):
        assert g["output_ids"] == ref, f"request {i}"
    assert {pdd_meta(g)["path"] for g in got} <= {"P->RLD->MD", "P->RLD"}


def test_no_kv_leaked_anywhere(setup: Setup) -> None:
    """Runs last: every server, once idle, passes SGLang's own (strict) leak check."""
    time.sleep(5)
    for server in setup.pdd.servers():
        log = (server.log_dir / f"{server.name}.log").read_text()
        assert "memory leak" not in log, server.name
        assert "Traceback" not in log, server.name
    ids = random_ids(64, seed=45)  # and all still serve
    assert generate(setup.pdd.url, body(ids))["output_ids"] == setup.reference(ids)
