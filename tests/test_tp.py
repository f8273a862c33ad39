"""Every tier at tensor-parallel size 2, on the testbed: P and RelayDecode (TP 2) in datacenter
A, MainDecode (TP 2) in B, plus an MD at TP 1 for a mixed pairing (P at TP 2 feeding an MD at
TP 1). Servers run in float32; each path's greedy tokens must equal a colocated TP-1 server's.
On a CPU the two ranks of each server share this machine's cores (gloo all-reduce).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.control.channel import ControlSocket
from pdd.control.messages import Handoff
from pdd.control.secret import read_secret
from pdd.eval.client import flush_cache, stream_generate
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import free_port, stop_groups
from pdd.launch.router import RouterService
from pdd.launch.servers import SGLangServer, control_secret_file
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from tests import test_main_decode as md_harness
from tests.log_checks import tracebacks
from tests.marks import needs_root
from tests.test_pd_same_dc import random_ids
from tests.test_pdd_core import (
    CATCHUP_HOLD,
    CATCHUP_NEW,
    HOLD,
    MAX_NEW,
    TEST_CONTROLS,
    WAITING_CORES,
    body,
    cores_while_kv_crosses,
    pdd_meta,
)

TP2 = ("--tp-size", "2")
# MD holds handoffs for this long after the first, so those arriving together share a forward.
BATCH_MS = 400
TOGETHER = 8

pytestmark = needs_root


@dataclass
class Setup:
    tb: Testbed
    colocated: SGLangServer
    pdd: PDDDeployment  # every tier at TP 2; its router hands off by Extend-Decode
    catchup: RouterService  # the same servers, Catch-Up handoff
    main_tp1: SGLangServer
    mixed: RouterService  # P and RLD at TP 2, MD at TP 1

    def reference(self, ids: list[int], max_new: int) -> list[int]:
        return generate(self.colocated.url, body(ids, max_new))["output_ids"]

    def servers(self) -> list[SGLangServer]:
        return [*self.pdd.servers(), self.main_tp1]


@pytest.fixture(scope="module")
def setup(
    tiny_model: Path, colocated: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Setup]:
    tb = Testbed("pddtp", LinkParams(100.0, 20.0), net="10.237")
    tb.down()
    tb.up()
    run_dir = tmp_path_factory.mktemp("tp")
    a, b = tb.placement("a"), tb.placement("b")
    # Nothing TP-specific beyond --tp-size: the plugin sets what a CPU needs.
    pdd = PDDDeployment.create(
        tiny_model, run_dir, a, b, server_args=TP2, path="pdd",
        main_args=("--pdd-handoff-batch-ms", str(BATCH_MS)),
        router_args=("--handoff-mode", "extend", *TEST_CONTROLS),
    )  # fmt: skip
    catchup = RouterService(
        "router-catchup", free_port(), run_dir, [pdd.prefill], [pdd.relay], [pdd.main], a,
        path="pdd",
        extra_args=["--handoff-mode", "catchup", "--catchup-chunk", "16",
                    "--catchup-threshold", "8", "--catchup-max-chunks", "4",
                    "--md-feed-after-tokens", "40", *TEST_CONTROLS],
    )  # fmt: skip
    main_tp1 = SGLangServer(
        "main-tp1", tiny_model, free_port(), run_dir, b, mode="decode",
        extra_args=["--pdd-role", "main", "--pdd-control-port", str(free_port()),
                    "--disaggregation-decode-enable-radix-cache"],
    )  # fmt: skip
    mixed = RouterService("router-mixed", free_port(), run_dir, [pdd.prefill], [pdd.relay],
                          [main_tp1], a, path="pdd",
                          extra_args=["--handoff-mode", "extend", *TEST_CONTROLS])  # fmt: skip
    routers = [catchup, mixed]
    main_tp1.start()
    try:
        times = pdd.up()
        for part in (main_tp1, *routers):
            if isinstance(part, RouterService):
                part.start()
            times[part.name] = part.wait_ready()
        times["colocated"] = colocated.wait_ready()
        print(f"start-up seconds: {times}")
        yield Setup(tb, colocated, pdd, catchup, main_tp1, mixed)
    finally:
        parts = [main_tp1, *routers]
        groups = [*pdd.pgids().values(), *(p.process.pgid for p in parts if p.process)]
        stop_groups(groups)
        tb.down()


@pytest.mark.parametrize("path", ["relay", "main", "extend", "catchup"])
def test_every_path_at_tp2_equals_colocated(setup: Setup, path: str) -> None:
    ids = random_ids(900, seed=7000 + len(path))
    router = setup.catchup if path == "catchup" else setup.pdd.router
    # A handoff path holds RLD's output until MD is ready, so MD takes part on any machine.
    hold = {"extend": HOLD, "catchup": CATCHUP_HOLD}.get(path)
    max_new = CATCHUP_NEW if path == "catchup" else MAX_NEW
    extra = {"pdd_path": path} if hold is None else {"pdd_hold_relay": hold}
    got = generate(router.url, body(ids, max_new, **extra))
    assert got["output_ids"] == setup.reference(ids, max_new), path
    meta = pdd_meta(got)
    expected = {"relay": "P->RLD", "main": "P->MD"}.get(path, "P->RLD->MD")
    assert meta["path"] == expected, meta
    if expected == "P->RLD->MD":
        assert meta["handoff_mode"] == path, meta
        assert meta["relay_tokens"] == hold and meta["main_tokens"] > 0, meta


def test_streamed_equals_not_streamed_at_tp2(setup: Setup) -> None:
    ids = random_ids(700, seed=7100)
    whole = generate(setup.pdd.url, body(ids, MAX_NEW, pdd_hold_relay=HOLD))
    chunks = stream_generate(setup.pdd.url, body(ids, MAX_NEW, pdd_hold_relay=HOLD)).chunks
    assert chunks[-1]["output_ids"] == whole["output_ids"] == setup.reference(ids, MAX_NEW)
    assert chunks[-1]["text"] == whole["text"]
    for meta in (pdd_meta(whole), pdd_meta(chunks[-1])):
        assert meta["path"] == "P->RLD->MD" and meta["relay_tokens"] == HOLD, meta


@pytest.mark.parametrize("path", ["main", "pdd"])
def test_p_at_tp2_feeds_an_md_at_tp1(setup: Setup, path: str) -> None:
    # Short: with unequal TP, SGLang's Mooncake connector moves each token's head slice of each
    # layer as its own transfer (send_kvcache_slice); an 800-token prompt, 3200 writes across
    # the 40 ms-RTT WAN, once exceeded Mooncake's 30 s transfer timeout on a loaded 2-core CI.
    ids = random_ids(120, seed=7200 + len(path))
    hold = {"pdd_hold_relay": HOLD} if path == "pdd" else {}  # MD takes part on any machine
    got = generate(setup.mixed.url, body(ids, MAX_NEW, pdd_path=path, **hold))
    assert got["output_ids"] == setup.reference(ids, MAX_NEW)
    meta = pdd_meta(got)
    assert meta["path"] == {"main": "P->MD", "pdd": "P->RLD->MD"}[path], meta
    assert meta["main_tokens"] == MAX_NEW - (HOLD if path == "pdd" else 0), meta


def extend_forwards(log: str) -> dict[str, list[int]]:
    """Per TP rank, the request count of each handoff extend forward MD logged."""
    found: dict[str, list[int]] = {}
    pattern = r"(TP\d+)\] PDD MainDecode: handoff extend forward \d+: (\d+) requests"
    for rank, n in re.findall(pattern, log):
        found.setdefault(rank, []).append(int(n))
    return found


def test_eight_handoffs_ready_together_run_as_one_extend_forward_on_every_rank(
    setup: Setup,
) -> None:
    """The test plays the router on MD's control plane (as tests/test_main_decode.py does):
    eight requests park on MD, then their HANDOFFs arrive together."""
    main = setup.pdd.main
    control = ControlSocket(read_secret(control_secret_file(main)))
    reply_to = control.bind(f"tcp://{setup.tb.host_ip('b')}:{free_port()}")
    dep = md_harness.Deployment(setup.pdd.prefill, main, setup.colocated, control, reply_to)
    try:
        prompts = [random_ids(60 + 30 * i, seed=7300 + i) for i in range(TOGETHER)]
        refs = [md_harness.reference(dep, ids) for ids in prompts]
        parked = [md_harness.Parked(dep, ids) for ids in prompts]  # each waits for READY
        log_path = main.log_dir / f"{main.name}.log"
        before = extend_forwards(log_path.read_text())
        for i, (p, ref) in enumerate(zip(parked, refs, strict=True)):
            dep.send(Handoff(rid=p.rid, start=0, tokens=tuple(ref[: 3 + i])))
        for p, ref in zip(parked, refs, strict=True):
            assert p.output()["output_ids"] == ref
        after = extend_forwards(log_path.read_text())
    finally:
        control.close()
    assert sorted(after) == ["TP0", "TP1"], after
    for rank, sizes in after.items():
        new = sizes[len(before.get(rank, [])) :]
        assert new == [TOGETHER], (rank, new)


def test_head_slices_from_p_at_tp2_cross_without_spinning(setup: Setup) -> None:
    """P at TP 2 -> MD at TP 1 over a slow link: each P rank writes its heads of each token and
    layer as separate entries from one thread per layer, and neither side spins meanwhile."""
    ids = random_ids(600, seed=7400)  # 600 KB of the tiny model's KV: ~7.7 s at 0.625 Mbit/s
    got, cores = cores_while_kv_crosses(setup.tb, setup.pdd.prefill, setup.main_tp1,
                                        setup.mixed.url, body(ids))  # fmt: skip
    assert got["output_ids"] == setup.reference(ids, MAX_NEW)
    print(f"scheduler cores while head slices cross: {cores}")
    # P's two ranks together, MD's one: each rank well under a quarter of a core.
    assert cores["P"] < 2 * WAITING_CORES and cores["MD"] < WAITING_CORES, cores


def test_no_kv_slot_leaked_on_any_rank(setup: Setup) -> None:
    """Runs last: each server goes idle with all its KV freed, and no rank logged a leak."""
    for server in setup.servers():
        flush_cache(server.url, 60)
        log = (server.log_dir / f"{server.name}.log").read_text()
        assert "memory leak" not in log, server.name
        assert not tracebacks(log), server.name
