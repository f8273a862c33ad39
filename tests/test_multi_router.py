"""Two PDD routers over one deployment on the testbed (P and RLD in datacenter A, MD in B), and
the clients users already run: SGLang's own bench_serving through a router.

The routers share the servers but not their state: each balances on the load the servers report
(SGLang's /v1/loads), keeps its own view of MD's cache, and gets its own READYs from MD.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer
from tests.conftest import SharedPDD, running
from tests.marks import needs_root
from tests.test_pd_same_dc import random_ids

pytestmark = needs_root

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "pdd-router.json"
REQUESTS = 64
CONCURRENCY = 8
MAX_NEW = 24
LONG_NEW = 1500  # keeps RLD busy while the routers' view of its load is compared with its own
BUSY = 4  # requests held on RLD for that comparison
AGREE_TIMEOUT_S = 20.0
HOLD = 8  # RLD's tokens before the handoff (pdd_hold_relay: MD takes part on any machine)


@dataclass
class Setup:
    colocated: SGLangServer
    pdd: PDDDeployment
    second: RouterService
    tiny: Path

    @property
    def routers(self) -> list[str]:
        return [self.pdd.url, self.second.url]


@pytest.fixture(scope="module")
def setup(pdd_testbed: SharedPDD, colocated: SGLangServer, tiny_model: Path) -> Iterator[Setup]:
    pdd = pdd_testbed.pdd
    # Like the first router, it knows the model (the OpenAI endpoints) and honours test controls.
    second = RouterService(
        "router-b", free_port(), pdd.router.log_dir, [pdd.prefill], [pdd.relay], [pdd.main],
        pdd_testbed.tb.placement("a"), path="pdd",
        extra_args=["--tokenizer", str(tiny_model), "--test-controls"],
    )  # fmt: skip
    with running([second]):
        yield Setup(colocated, pdd, second, tiny_model)


def body(ids: list[int], max_new: int, **extra: object) -> dict[str, Any]:
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sampling, **extra}


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def relay_load_seen_by(router: str) -> int | None:
    [relay] = get_json(f"{router}/status")["instances"]["relay"]
    load: int = relay["load"]
    return load if relay["reported_load"] is not None else None


def relay_own_report(setup: Setup) -> int:
    loads = get_json(f"{setup.pdd.relay.url}/v1/loads?include=core")["loads"]
    return sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in loads)


def path_of(i: int) -> dict[str, object]:
    """A quarter of the requests go P -> MD, half through each router (request i goes through
    router i % 2); the rest P -> RLD -> MD, handed off after HOLD tokens."""
    return {"pdd_path": "main"} if i % 8 in (3, 6) else {"pdd_hold_relay": HOLD}


def served_requests(router: str) -> int:
    counters = get_json(f"{router}/status")["counters"]
    return sum(n for k, n in counters.items() if k.startswith('requests_total{path="P'))


def test_two_routers_split_64_requests_and_every_output_equals_colocated(setup: Setup) -> None:
    before = [served_requests(router) for router in setup.routers]  # the first served others
    prompts = [random_ids(40 + 7 * i, seed=7000 + i) for i in range(REQUESTS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        expected = list(pool.map(lambda ids: generate(setup.colocated.url, body(ids, MAX_NEW)),
                                 prompts))  # fmt: skip
        routed = list(pool.map(
            lambda i: generate(setup.routers[i % 2], body(prompts[i], MAX_NEW, **path_of(i)),
                               timeout=300),
            range(REQUESTS),
        ))  # fmt: skip
    wrong = [i for i in range(REQUESTS) if routed[i]["output_ids"] != expected[i]["output_ids"]]
    assert wrong == [], f"outputs differing from colocated: {wrong}"
    paths = Counter(r["meta_info"]["pdd"]["path"] for r in routed)
    print(f"paths: {dict(paths)}")
    # MD answers the quarter sent P -> MD; the rest are handed off, concurrently, at HOLD.
    assert paths == {"P->MD": REQUESTS // 4, "P->RLD->MD": REQUESTS * 3 // 4}, paths
    handed = [r["meta_info"]["pdd"] for r in routed if r["meta_info"]["pdd"]["path"] != "P->MD"]
    assert all(m["relay_tokens"] == HOLD and m["main_tokens"] == MAX_NEW - HOLD
               for m in handed), handed  # fmt: skip
    served = [served_requests(router) - n for router, n in zip(setup.routers, before, strict=True)]
    assert min(served) >= REQUESTS // 2, served  # each router served its half


def test_each_router_sees_rlds_load_as_rld_reports_it(setup: Setup) -> None:
    """BUSY long requests, all sent through the first router: the second, which sent none,
    sees them too, because the load comes from RLD and not from each router's own count."""
    first, second = setup.routers
    done: list[dict[str, Any]] = []
    ids = [random_ids(64, seed=7500 + i) for i in range(BUSY)]
    threads = [threading.Thread(target=lambda x=x: done.append(generate(
        first, body(x, LONG_NEW, pdd_path="relay"), timeout=600))) for x in ids]  # fmt: skip
    for t in threads:
        t.start()
    seen: list[tuple[int, int | None, int | None]] = []
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while time.monotonic() < deadline:
        own = relay_own_report(setup)
        views = relay_load_seen_by(first), relay_load_seen_by(second)
        seen.append((own, *views))
        if own == BUSY and views == (BUSY, BUSY):
            break
        time.sleep(0.2)
    for t in threads:
        t.join(600)
    assert (BUSY, BUSY, BUSY) in seen, f"(RLD's report, first router, second router): {seen}"
    assert len(done) == BUSY and all(len(r["output_ids"]) == LONG_NEW for r in done)
    # Idle again: both views follow RLD back to 0.
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while (relay_load_seen_by(first), relay_load_seen_by(second)) != (0, 0):
        assert time.monotonic() < deadline, "the routers did not see RLD go idle"
        time.sleep(0.2)


def bench_serving(setup: Setup, backend: str, out: Path, *dataset: str) -> dict[str, Any]:
    """SGLang's bench_serving, unchanged, against the first router; its JSON result line."""
    cmd = [
        sys.executable, "-m", "sglang.bench_serving",
        "--backend", backend,
        "--base-url", setup.pdd.url,
        "--model", str(setup.tiny),
        "--served-model-name", setup.tiny.name,
        "--tokenizer", str(setup.tiny),
        "--max-concurrency", "4",
        "--disable-tqdm",
        "--output-file", str(out),
        *dataset,
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
    ttft = result["median_ttft_ms"]
    print(f"{backend} {dataset[1]}: completed {result['completed']}, output tokens "
          f"{result['total_output_tokens']}, TTFT median {ttft:.0f} ms")  # fmt: skip
    return result


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving_random_ids_through_the_router(
    setup: Setup, backend: str, tmp_path: Path
) -> None:
    result = bench_serving(
        setup, backend, tmp_path / "bench.jsonl",
        "--dataset-name", "random-ids",
        "--num-prompts", "16",
        "--random-input-len", "128",
        "--random-output-len", "16",
        "--random-range-ratio", "0.5",
        "--warmup-requests", "1",
    )  # fmt: skip
    assert result["completed"] == 16
    assert result["total_output_tokens"] >= 16 * 8  # range ratio 0.5: 8-16 tokens each


def test_sglang_bench_serving_replays_a_mooncake_trace_through_the_router(
    setup: Setup, tmp_path: Path
) -> None:
    """A trace in Mooncake's format (arrival times, shared prefix blocks), two rounds per
    session: the second round resends the first as history."""
    trace = tmp_path / "trace.jsonl"
    records = [{"timestamp": 100 * i, "input_length": 300, "output_length": 12,
                "hash_ids": [i % 3, 10 + i]} for i in range(6)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = bench_serving(
        setup, "sglang", tmp_path / "bench.jsonl",
        "--dataset-name", "mooncake",
        "--dataset-path", str(trace),
        "--num-prompts", "6",
        "--mooncake-num-rounds", "2",
    )  # fmt: skip
    assert result["completed"] == 12


def test_grafana_dashboard_queries_metrics_the_router_serves(setup: Setup) -> None:
    """Every metric a dashboard panel queries is on a live router's /metrics after traffic,
    and every label it groups by is on that metric's series where any are labelled."""
    with urllib.request.urlopen(f"{setup.pdd.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if m := re.match(r"(pdd_router_\w+)(?:\{(.*)\})? ", line):
            keys = {kv.split("=")[0] for kv in (m.group(2) or "").split(",") if kv}
            labels.setdefault(m.group(1), set()).update(keys)
    dashboard = json.loads(DASHBOARD.read_text())
    assert len(dashboard["panels"]) >= 10
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            names = re.findall(r"pdd_router_\w+", expr)
            assert names, expr
            for name in names:
                assert name in labels, f"{panel['title']}: {name} is not served"
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (g.strip() for g in group.split(",")):
                    have = set().union(*(labels[n] for n in names))
                    assert label == "le" or not have or label in have or label == "instance", (
                        f"{panel['title']}: {label} not on {names}"
                    )
    assert labels["pdd_router_ttft_seconds_bucket"] >= {"path", "le"}
    assert labels["pdd_router_instance_load"] == {"tier", "url"}
