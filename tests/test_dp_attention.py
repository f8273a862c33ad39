"""DP attention with expert parallelism on CPU (pdd.srt.cpu_dp), the layout DeepSeek-V3-class
models are served with, on the tiny DeepSeek-V3:
- a colocated server at TP 2 = DP 2 x EP 2 makes the tokens the TP 1 colocated server makes,
  with requests on both DP ranks at once (so a rank pads its batch), each token's experts split
  over the two EP ranks;
- MainDecode at DP 2 x EP 2 behind a TP 1 P and RLD: each DP rank is an MD of its own to the
  router (`--main-dp`), requests pinned to it with SGLang's routed_dp_rank; P->MD and
  P->RLD->MD (Extend-Decode and Catch-Up) equal the colocated server, handoffs land on both
  ranks, a request cut on RLD resumes on a rank of MD (and one cut on MD's rank resumes on
  RLD), and a session's next turn goes to the rank whose radix cache holds its prefix (cache
  sync per rank).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.eval.client import router_status
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import DECODE_CACHE_FLAG
from pdd.launch.process import DP_ATTENTION_PORTS, free_port
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer
from pdd.router.server_loads import dp_attention_size
from tests.conftest import running
from tests.test_pd_same_dc import random_ids
from tests.test_router_paths import (
    CATCHUP_HOLD,
    DIRECT,
    HANDED_OFF,
    HOLD,
    MAX_NEW,
    TEST_CONTROLS,
    abort_mid_answer,
    check_resumed,
    sampling,
    states,
    through,
)

DP_EP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]
PROMPTS = [random_ids(n, seed=2000 + n) for n in (9, 40, 150, 300)]


@dataclass
class Deployment:
    colocated_dp: SGLangServer  # colocated at DP 2 x EP 2
    prefill: SGLangServer
    relay: SGLangServer
    main: SGLangServer  # MD at DP 2 x EP 2
    router: RouterService  # Extend-Decode handoffs
    catchup: RouterService  # Catch-Up: MD is fed only after RLD streamed 40 tokens

    def servers(self) -> list[SGLangServer | RouterService]:
        return [self.colocated_dp, self.prefill, self.relay, self.main, self.router,
                self.catchup]  # fmt: skip


@pytest.fixture(scope="module")
def d(mla_model: Path, mla_colocated: SGLangServer,
      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:  # fmt: skip
    run = tmp_path_factory.mktemp("dp")
    prefill = SGLangServer("prefill", mla_model, free_port(), run, mode="prefill",
                           bootstrap_port=free_port())  # fmt: skip
    relay = SGLangServer("relay", mla_model, free_port(), run, mode="decode")
    main = SGLangServer("main", mla_model, free_port(DP_ATTENTION_PORTS), run, mode="decode",
                        extra_args=[*DP_EP, "--pdd-role", "main", "--pdd-control-port",
                                    str(free_port()), DECODE_CACHE_FLAG])  # fmt: skip
    d = Deployment(
        colocated_dp=SGLangServer("colocated_dp", mla_model, free_port(DP_ATTENTION_PORTS), run,
                                  extra_args=DP_EP),
        prefill=prefill, relay=relay, main=main,
        router=RouterService("router", free_port(), run, [prefill], [relay], [main], path="pdd",
                             extra_args=["--handoff-mode", "extend", *TEST_CONTROLS]),
        catchup=RouterService(
            "router_catchup", free_port(), run, [prefill], [relay], [main], path="pdd",
            extra_args=["--handoff-mode", "catchup", "--catchup-threshold", "8",
                        "--catchup-chunk", "16", "--md-feed-after-tokens", "40", *TEST_CONTROLS],
        ),
    )  # fmt: skip
    with running(d.servers(), mla_colocated):
        yield d


@pytest.fixture(scope="module")
def reference(mla_colocated: SGLangServer, d: Deployment) -> list[list[int]]:
    return [generate(mla_colocated.url, {"input_ids": ids, "sampling_params": sampling()})
            ["output_ids"] for ids in PROMPTS]  # fmt: skip


def at_once(fn: Callable[[list[int]], dict]) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(fn, PROMPTS))


def log_ranks(server: SGLangServer, what: str) -> set[str]:
    """The DP ranks whose log lines say `what`."""
    assert server.process is not None
    return set(re.findall(rf" (DP\d+) TP\d+[^\]]*\] {what}", server.process.log_path.read_text()))


def test_colocated_dp2_ep2_equals_tp1_on_both_dp_ranks(
    d: Deployment, reference: list[list[int]]
) -> None:
    body = {"sampling_params": sampling()}
    got = at_once(lambda ids: generate(d.colocated_dp.url, {"input_ids": ids, **body}))
    for i, g in enumerate(got):
        assert g["output_ids"] == reference[i], f"prompt {i} ({len(PROMPTS[i])} tokens)"
    assert log_ranks(d.colocated_dp, "Prefill batch") == {"DP0", "DP1"}


def test_p_to_md_at_dp2_ep2_equals_colocated_on_both_ranks(
    d: Deployment, reference: list[list[int]]
) -> None:
    got = at_once(lambda ids: through(d.router, ids, "main"))
    ranks = set()
    for i, g in enumerate(got):
        pdd = g["meta_info"]["pdd"]
        assert g["output_ids"] == reference[i], f"prompt {i}: {pdd}"
        assert pdd["path"] == "P->MD" and states(pdd) in DIRECT, pdd
        ranks.add(pdd["instances"]["main_dp_rank"])
    assert ranks == {"0", "1"}, "the router spreads concurrent requests over MD's DP ranks"
    assert log_ranks(d.main, "Decode batch") == {"DP0", "DP1"}


def test_extend_handoff_at_dp2_ep2_equals_colocated_on_both_ranks(
    d: Deployment, reference: list[list[int]]
) -> None:
    got = at_once(lambda ids: through(d.router, ids, "pdd", hold=HOLD))
    ranks = set()
    for i, g in enumerate(got):
        pdd = g["meta_info"]["pdd"]
        assert g["output_ids"] == reference[i], f"prompt {i}: {pdd}"
        assert pdd["path"] == "P->RLD->MD" and pdd["handoff_mode"] == "extend", pdd
        assert states(pdd) == HANDED_OFF, pdd
        assert pdd["relay_tokens"] == HOLD and pdd["main_tokens"] == MAX_NEW - HOLD, pdd
        ranks.add(pdd["instances"]["main_dp_rank"])
    assert ranks == {"0", "1"}, "handoffs on both DP ranks"


def test_catchup_handoff_at_dp2_ep2_equals_colocated_on_both_ranks(
    d: Deployment, reference: list[list[int]]
) -> None:
    # Held at the 40 tokens the client has when MD is fed: each rank catches up on them in two
    # 16-token chunks, between its other requests' DP-synced batches, then takes the rest.
    got = at_once(lambda ids: through(d.catchup, ids, None, hold=CATCHUP_HOLD))
    ranks = set()
    for i, g in enumerate(got):
        pdd = g["meta_info"]["pdd"]
        assert g["output_ids"] == reference[i], f"prompt {i}: {pdd}"
        assert pdd["path"] == "P->RLD->MD" and pdd["handoff_mode"] == "catchup", pdd
        assert pdd["chunks"] == 2 and pdd["relay_tokens"] == CATCHUP_HOLD, pdd
        assert states(pdd) == HANDED_OFF, pdd
        ranks.add(pdd["instances"]["main_dp_rank"])
    assert ranks == {"0", "1"}, "Catch-Up handoffs on both DP ranks"


@pytest.mark.parametrize("path, suffix", [("relay", "-r"), ("main", "")])
def test_a_request_cut_on_one_side_resumes_on_the_other_with_a_dp_rank_of_md(
    d: Deployment, mla_colocated: SGLangServer, path: str, suffix: str
) -> None:
    # Cut on RLD: MD's rank takes it from the client's tokens. Cut on MD: the abort goes to
    # MD's server, which passes it to the rank holding the request, and RLD takes it.
    server = d.relay if path == "relay" else d.main
    chunk, aborted_at = abort_mid_answer(d.router, server, mla_colocated, path, suffix)
    pdd = chunk["meta_info"]["pdd"]
    check_resumed(pdd, path, aborted_at)
    assert pdd["instances"]["main_dp_rank"] in ("0", "1"), pdd


def test_md_server_info_tells_the_router_its_dp_ranks(d: Deployment) -> None:
    """What the router reads to catch a DP MD given with --main instead of --main-dp."""
    with urllib.request.urlopen(f"{d.main.url}/server_info", timeout=30) as resp:
        assert dp_attention_size(json.loads(resp.read())) == 2
    main = router_status(d.router.url)["instances"]["main"]
    assert [m["problem"] for m in main] == [None, None], main


def test_next_turn_goes_to_the_dp_rank_holding_its_prefix(d: Deployment) -> None:
    ids = PROMPTS[3]
    first = through(d.router, ids, "main")
    rank = first["meta_info"]["pdd"]["instances"]["main_dp_rank"]
    # Each DP rank reports its own radix cache on its own control socket: wait until the
    # router's mirror of that rank holds the first turn (observed, not slept on).
    addr = next(m["control_addr"] for m in router_status(d.router.url)["instances"]["main"]
                if str(m["dp_rank"]) == rank)  # fmt: skip
    deadline = time.monotonic() + 60
    while router_status(d.router.url)["md_caches"][addr]["tokens"] < len(ids) - 16:
        assert time.monotonic() < deadline, router_status(d.router.url)["md_caches"]
        time.sleep(0.2)
    turn = ids + first["output_ids"] + random_ids(20, seed=7)
    got = through(d.router, turn, "main")
    pdd = got["meta_info"]["pdd"]
    assert pdd["instances"]["main_dp_rank"] == rank, pdd
    assert pdd["md_predicted_cached_tokens"] >= len(ids) - 16, pdd
    assert pdd["md_cached_tokens"] >= len(ids) - 16, pdd
    assert (
        got["output_ids"]
        == generate(d.colocated_dp.url, {"input_ids": turn, "sampling_params": sampling()})[
            "output_ids"
        ]
    )
