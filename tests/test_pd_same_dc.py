"""Same-datacenter PD as `python -m pdd.launch.pd_local up/status/down` starts it: real P and D
(mooncake_tcp) and SGLang's router. Greedy output through it equals a colocated server's, and
`down` leaves no process."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdd.eval import prompts as prompts_lib
from pdd.launch.pd_local import STATE_FILE, LocalPD, generate, load_state, wait_serving
from pdd.launch.process import free_port, group_alive
from pdd.launch.servers import PDRouter, SGLangServer
from pdd.models.tiny import VOCAB_SIZE
from tests.conftest import running

CLI = [sys.executable, "-m", "pdd.launch.pd_local"]

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


def cli(run_dir: Path, *args: str, timeout: float = 400) -> str:
    out = subprocess.run(
        [*CLI, "--run-dir", str(run_dir), *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def group_cmdlines(pgid: int) -> list[str]:
    """The command lines of the live processes in process group `pgid`."""
    lines = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                lines.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return lines


@pytest.fixture(scope="module")
def colocated_and_pd(
    tiny_model: Path, colocated: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SGLangServer, LocalPD]]:
    """The colocated reference, and P + D + router brought up by the CLI (`up` returns once the
    router serves); `down` after the module (the last test checks that it leaves nothing)."""
    run_dir = tmp_path_factory.mktemp("servers")
    print(cli(run_dir, "up", "--model", str(tiny_model)))
    try:
        colocated.wait_ready()
        yield colocated, LocalPD.from_state(run_dir)
    finally:
        cli(run_dir, "down")


def recorded_groups(pd: LocalPD) -> dict[str, int]:
    groups: dict[str, int] = load_state(pd.router.log_dir)["groups"]
    return groups


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
    log = (pd.prefill.log_dir / "prefill.log").read_text()
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
        assert group_alive(recorded_groups(pd)["router"])
        got = greedy(second.url, prompts()[1])
        assert got["output_ids"] == reference[1]["output_ids"]


def test_status_names_each_part_running_with_forked_schedulers(
    colocated_and_pd: tuple[SGLangServer, LocalPD],
) -> None:
    _, pd = colocated_and_pd
    groups = recorded_groups(pd)
    assert set(groups) == {"prefill", "decode", "router"}
    assert cli(pd.router.log_dir, "status").count("running") == 3
    # On CPU a server's scheduler and detokenizer are forked from it (pdd.srt.cpu_fork), not
    # spawned: a spawned child runs multiprocessing's spawn_main.
    for role in ("prefill", "decode"):
        lines = group_cmdlines(groups[role])
        assert len(lines) >= 3, lines
        assert not [line for line in lines if "spawn_main" in line], lines


def test_down_leaves_no_process(colocated_and_pd: tuple[SGLangServer, LocalPD]) -> None:
    """Runs last: the module's deployment goes down here (the fixture's `down` then finds
    nothing recorded)."""
    _, pd = colocated_and_pd
    run_dir = pd.router.log_dir
    groups = recorded_groups(pd)
    print(cli(run_dir, "down"))
    assert not [name for name, pgid in groups.items() if group_alive(pgid)]
    assert not (run_dir / STATE_FILE).exists()
    assert "no deployment recorded" in cli(run_dir, "status")
