"""Greedy output through real P -> D (mooncake_tcp) + router equals a colocated server's."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdd.eval import prompts as prompts_lib
from pdd.launch.pd_local import LocalPD, generate, wait_serving
from pdd.launch.process import free_port
from pdd.launch.servers import PDRouter, SGLangServer
from pdd.models.tiny import VOCAB_SIZE
from tests.conftest import running

MAX_NEW_TOKENS = 24
# Lengths 8..1000; the last two extend the 1000-token prompt, so they hit the prefix cache.
LENGTHS = [8, 61, 181, 400, 700, 1000]


def random_ids(n: int, seed: int) -> list[int]:
    return prompts_lib.random_ids(n, seed, VOCAB_SIZE)


def prompts() -> list[list[int]]:
    base = [random_ids(n, seed=n) for n in LENGTHS]
    longest = base[-1]
    return base + [longest + random_ids(20, seed=1), longest[:900] + random_ids(50, seed=2)]


def greedy(url: str, ids: list[int]) -> dict:
    payload = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
    }
    return generate(url, payload)


@pytest.fixture(scope="module")
def reference(colocated_and_pd: tuple[SGLangServer, LocalPD]) -> dict[int, dict]:
    colocated, _ = colocated_and_pd
    return {i: greedy(colocated.url, ids) for i, ids in enumerate(prompts())}


def test_pd_equals_colocated(
    colocated_and_pd: tuple[SGLangServer, LocalPD], reference: dict[int, dict]
) -> None:
    _, pd = colocated_and_pd
    for i, ids in enumerate(prompts()):
        got = greedy(pd.url, ids)
        assert len(got["output_ids"]) == MAX_NEW_TOKENS
        assert got["output_ids"] == reference[i]["output_ids"], f"prompt {i} ({len(ids)} tokens)"


def test_repeated_prefix_hits_cache(
    colocated_and_pd: tuple[SGLangServer, LocalPD], reference: dict[int, dict]
) -> None:
    # On the colocated reference server, the prompts that extend the 1000-token one reuse it.
    assert reference[len(LENGTHS)]["meta_info"]["cached_tokens"] >= 1000
    assert reference[len(LENGTHS) + 1]["meta_info"]["cached_tokens"] >= 900
    # Through P -> D, the prefill server reuses it too (its batch log counts cached tokens).
    _, pd = colocated_and_pd
    longest = random_ids(LENGTHS[-1], seed=LENGTHS[-1])
    greedy(pd.url, longest)
    greedy(pd.url, longest + random_ids(30, seed=3))
    assert pd.prefill.process is not None
    log = pd.prefill.process.log_path.read_text()
    cached = [int(m) for m in re.findall(r"#cached-token: (\d+)", log)]
    assert max(cached) >= 1000, cached


def test_16_concurrent_requests_through_router(
    colocated_and_pd: tuple[SGLangServer, LocalPD],
) -> None:
    colocated, pd = colocated_and_pd
    batch = [random_ids(30 + 7 * k, seed=100 + k) for k in range(16)]
    expected = [greedy(colocated.url, ids)["output_ids"] for ids in batch]
    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(lambda ids: greedy(pd.url, ids)["output_ids"], batch))
    assert got == expected


def test_every_server_runs_in_float32(colocated_and_pd: tuple[SGLangServer, LocalPD]) -> None:
    """The suite's servers run in float32 (tests/conftest.py), which exact equality needs."""
    colocated, pd = colocated_and_pd
    for server in (colocated, pd.prefill, pd.decode):
        dtype = server.server_info()["dtype"]
        assert dtype == "float32", (server.name, dtype)


def test_a_second_sglang_router_on_the_machine_serves_too(
    colocated_and_pd: tuple[SGLangServer, LocalPD], reference: dict[int, dict], tmp_path: Path
) -> None:
    """SGLang's router binds a Prometheus exporter (0.0.0.0:29000 unless told): each of ours
    gets a port of its own, so a second deployment on the machine (or a parallel test worker's)
    starts instead of dying with "Address already in use"."""
    _, pd = colocated_and_pd
    second = PDRouter("router2", free_port(), tmp_path, [pd.prefill], [pd.decode])
    assert second.metrics_port != pd.router.metrics_port
    with running([second]):
        wait_serving(second.url, 60)  # it answers /health before it has registered P and D
        assert pd.router.process is not None and not pd.router.process.exited()
        got = greedy(second.url, prompts()[1])
        assert got["output_ids"] == reference[1]["output_ids"]
