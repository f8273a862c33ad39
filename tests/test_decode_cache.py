"""The decode-side radix cache: MD keeps the KV it holds, so a conversation's next turn sends only
the suffix MD lacks across the WAN. On the testbed, with the KV-heavy `wide` model (64 KB per
token in float32) so that KV bytes dominate what the WAN link counts.

Outputs across turns are compared with a colocated server in tests/test_main_decode.py (tiny
model). Here only the first turn is: the wide model's random weights have near-ties in their
logits, and in later turns MD attends over KV of mixed origin (P's prefill for the prompt, MD's
own decode steps for earlier answers), whose rounding differs from a colocated server's (in
float32 too, only less) enough to flip one.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.eval.client import mirrored_tokens, router_sees_flush, router_status, wait_mirrored
from pdd.eval.prompts import random_ids
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port, stop_groups
from pdd.launch.servers import SGLangServer
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from pdd.models.kv import kv_bytes_per_token
from pdd.router.config import RouterConfig
from pdd.router.md_caches import SILENT_INTERVALS
from tests.marks import needs_root

BLOCK = 16  # tokens per block of the router's mirror of MD's cache

VOCAB = 1024
MAX_NEW = 48
TOLERANCE = 0.05
SATURATED_MBIT = 2.0  # the link while KV saturates it: 30 s of KV is ~120 tokens' worth
SATURATE_S = 30.0
# One-way delay added while KV saturates the link. How long KV keeps the queue full varies with
# how the sender's writes and TCP's backoff line up, so a heartbeat's wait behind it alone may or
# may not pass SGLang's 3 s read timeout (repeat runs saw both). 2 s each way on top makes every
# heartbeat's round trip longer than that, so SGLang's heartbeats miss, twice in a row within
# the 30 s, in every run, while the KV keeps arriving.
FAR_MS = 2000.0

pytestmark = needs_root


@dataclass
class Setup:
    tb: Testbed
    colocated: SGLangServer
    pdd: PDDDeployment
    kv_per_token: int

    def wan_bytes(self) -> int:
        """Bytes the WAN link carried from A to B so far (the KV's direction)."""
        return int(self.tb.wan.status()["counters"]["a_to_b"]["bytes"])

    def turn(
        self, ids: list[int], compare: bool = False, path: str | None = None
    ) -> tuple[dict, int]:
        """One request through PDD; its result and the WAN bytes A -> B it caused."""
        before = self.wan_bytes()
        sampling = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        body: dict = {"input_ids": ids, "sampling_params": sampling}
        if path is not None:
            body["pdd_path"] = path
        got = generate(self.pdd.url, body, 300)
        wan = self.wan_bytes() - before
        if compare:
            ref = generate(self.colocated.url, {"input_ids": ids, "sampling_params": sampling})
            assert got["output_ids"] == ref["output_ids"]
        return got, wan


@pytest.fixture(scope="module")
def setup(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    # A deep drop-tail queue (4 s of link time), as WAN routers have: when KV fills the link,
    # what else crosses A -> B waits seconds behind it (the saturation test).
    tb = Testbed("pdddrc", LinkParams(200.0, 20.0, queue_ms=4000.0), net="10.223")
    tb.down()
    tb.up()
    run_dir = tmp_path_factory.mktemp("decode_cache")
    colocated = SGLangServer("colocated", wide_model, free_port(), run_dir)
    pdd = PDDDeployment.create(wide_model, run_dir, tb.placement("a"), tb.placement("b"),
                               path="pdd")  # fmt: skip
    colocated.start()
    try:
        print(f"start-up seconds: {pdd.up()}")
        colocated.wait_ready()
        yield Setup(tb, colocated, pdd, kv_bytes_per_token(wide_model, dtype_bytes=4))
    finally:
        stop_groups(
            [*pdd.pgids().values(), *([colocated.process.pgid] if colocated.process else [])]
        )
        tb.down()


def conversation(setup: Setup, seed: int, turns: int) -> list[tuple[dict, int, int]]:
    """Turns that each extend the previous prompt and answer; (result, WAN bytes, prompt)."""
    ids = random_ids(400, seed, VOCAB)
    out = []
    for k in range(turns):
        # P -> MD: MD surely answers, so it keeps prompt and answer. On P -> RLD -> MD, RLD can
        # finish before the prompt's KV has crossed on a fast machine (CI saw it: the router
        # cancelled MD and the next turn found only part of the context on MD).
        before = mirrored_tokens(setup.pdd.url)
        got, wan = setup.turn(ids, compare=k == 0, path="main")
        out.append((got, wan, len(ids)))
        # MD's cache sync reaches the router: the KV MD received and the answer's (not the
        # last token's, never computed), less a block at each end.
        meta = got["meta_info"]["pdd"]
        grew = len(ids) - meta["md_cached_tokens"] + len(got["output_ids"]) - 1
        wait_mirrored(setup.pdd.url, before + grew - 2 * BLOCK)
        ids = ids + got["output_ids"] + random_ids(150, seed * 100 + k, VOCAB)
    return out


def test_each_turn_sends_only_what_md_lacks(setup: Setup) -> None:
    turns = conversation(setup, seed=1, turns=3)
    previous_prompt = 0
    for k, (got, wan, prompt) in enumerate(turns):
        meta = got["meta_info"]["pdd"]
        cached = meta["md_cached_tokens"]
        assert meta["path"] == "P->MD" and meta["md_prompt_tokens"] == prompt, meta
        # MD holds at least the previous turn's prompt (its answer too, if MD produced it).
        assert cached >= previous_prompt - 1, (k, meta)
        expected = (prompt - cached) * setup.kv_per_token
        print(f"turn {k + 1}: prompt {prompt}, MD cached {cached}, KV MD lacked {expected} B, "
              f"WAN A->B {wan} B ({wan / expected - 1:+.2%})")  # fmt: skip
        assert meta["wan_kv_bytes"] == expected, meta
        # The router knew MD's hit before sending, to within one block.
        predicted = meta["md_predicted_cached_tokens"]
        assert predicted <= cached < predicted + BLOCK, (k, meta)
        assert abs(wan - expected) <= TOLERANCE * expected, (k, wan, expected)
        previous_prompt = prompt
    full = turns[-1][2] * setup.kv_per_token
    assert turns[-1][1] < full / 2, "the last turn must send far less than its whole prompt's KV"


def test_after_md_evicts_what_it_lacks_crosses_again(setup: Setup) -> None:
    first = conversation(setup, seed=2, turns=2)
    # Evict everything MD holds (as a restart would): SGLang's cache flush, MD being idle.
    req = urllib.request.Request(f"{setup.pdd.main.url}/flush_cache", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    # Seed 2's next turn finds nothing on MD: the whole prompt's KV crosses the WAN.
    ids = random_ids(400, 2, VOCAB)
    for k, (turn, _, _) in enumerate(first):
        ids = ids + turn["output_ids"] + random_ids(150, 2 * 100 + k, VOCAB)
    router_sees_flush(setup.pdd.url)
    # P -> MD: MD surely takes this turn (on P -> RLD -> MD, RLD may finish 48 tokens before the
    # whole prompt's KV has crossed, and then MD never reports its hit).
    again, wan = setup.turn(ids, path="main")
    meta = again["meta_info"]["pdd"]
    assert meta["path"] == "P->MD", meta
    assert meta["md_cached_tokens"] <= 1, meta
    assert meta["md_predicted_cached_tokens"] == 0, meta  # the flush reached the router too
    expected = (len(ids) - meta["md_cached_tokens"]) * setup.kv_per_token
    assert abs(wan - expected) <= TOLERANCE * expected, (wan, expected)


def test_a_link_full_of_kv_never_marks_md_down(setup: Setup) -> None:
    """KV saturates a long-haul WAN (2 s more each way) for ~30 s. The router's /ping to MD, and
    MD's SGLang heartbeat to P's bootstrap server, wait behind it and time out; MD's cache-sync
    answers keep MD up at the router, the KV still arriving keeps P alive at MD: MD is never
    marked down, the control plane's round trip stays bounded and MD decodes the whole answer."""
    rate = SATURATED_MBIT * 1e6 / 8
    tokens = int(rate * SATURATE_S / setup.kv_per_token)
    assert setup.pdd.main.process is not None
    md_log = setup.pdd.main.process.log_path
    log_before = md_log.stat().st_size
    md = router_status(setup.pdd.url)["instances"]["main"][0]
    downs_before, slow_before = md["downs"], md["slow_checks"]
    samples: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            samples.append(router_status(setup.pdd.url))

    setup.tb.set_rate(SATURATED_MBIT)
    setup.tb.add_delay(FAR_MS)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        got, wan = setup.turn(random_ids(tokens, 77, VOCAB), path="main")
    finally:
        setup.tb.restore()
        done.set()
        watcher.join(timeout=60)
    took = time.monotonic() - start
    meta = got["meta_info"]["pdd"]
    assert meta["path"] == "P->MD" and meta["md_failure"] is None, meta
    assert meta["main_tokens"] == len(got["output_ids"]) == MAX_NEW, meta
    mains = [s["instances"]["main"][0] for s in samples]
    p99s = [c["sync_reply_p99_s"] for s in samples for c in s["md_caches"].values()]
    reply_p99 = max(p for p in p99s if p is not None)
    slow = mains[-1]["slow_checks"] - slow_before
    print(
        f"{tokens} tokens of KV ({wan / 1e6:.1f} MB) at {SATURATED_MBIT} Mbit/s took {took:.1f}s;"
        f" md marked down {mains[-1]['downs'] - downs_before} times, {slow} /ping checks timed"
        f" out behind the KV, cache-sync reply P99 {reply_p99:.2f}s"
    )
    assert took >= 0.8 * SATURATE_S, "the KV did not fill the link for long"
    assert all(m["up"] for m in mains) and mains[-1]["downs"] == downs_before, mains[-1]
    # The link's queue did hold /ping back, long enough for two failed checks to mark MD down
    # had a timeout counted as a failure ...
    assert slow >= 2, mains[-1]
    # ... while MD's answers on the control plane kept coming within the heard window (what
    # keeps MD up; on a loaded machine they take longer, and that is the only bound that matters).
    assert reply_p99 < SILENT_INTERVALS * RouterConfig.cache_sync_interval_s, p99s
    # MD's heartbeats to P's bootstrap missed too (SGLang would have failed the transfer), and
    # were forgiven because P's KV kept arriving.
    with open(md_log, "rb") as log:
        log.seek(log_before)
        assert b"the link is busy, not the server gone" in log.read()
