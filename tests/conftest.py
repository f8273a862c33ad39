"""Shared fixtures: the tiny model and real SGLang servers, started once per module."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from pdd.launch.forkserver import FORKSERVER_ENV
from pdd.launch.pd_local import format_seconds
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import PORT_RANGE, PORT_RANGE_ENV, ManagedProcess, free_port, stop_groups
from pdd.launch.router import RouterService
from pdd.launch.servers import DTYPE_ENV, HttpService, SGLangServer, device_env
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams

pytest_plugins = ["tests.module_times"]  # the slowest modules, printed after the slowest tests

# Every server a test starts runs in float32, so greedy outputs of different paths cannot differ
# by a bf16 near-tie (see DTYPE_ENV); tests/test_pd_same_dc.py checks that it took effect.
os.environ.setdefault(DTYPE_ENV, "float32")
# One torch thread per server: a test runs several servers on the same cores, and with a thread
# per core each (torch's default) every OpenMP barrier of one server waits on a core another
# server holds (a live run measured MD's steps 2.5-3.5x slower that way).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _worker_ports() -> None:
    """Parallel workers (`pytest -n N`) hand out ports from disjoint parts of the range, so two
    workers' servers never get one port (each checks a port free by binding it, and its server
    binds it seconds later). Set before any port is handed out, inherited by subprocesses."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if not worker:
        return
    k, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    part = len(PORT_RANGE) // count
    start = PORT_RANGE.start + k * part
    os.environ[PORT_RANGE_ENV] = f"{start}-{start + part - 1}"


_worker_ports()

# The modules that take longest (setup and calls, measured on a 2-core machine), longest unit
# (SHARED below) first. Parallel workers take units in collection order (run.sh:
# --no-loadscope-reorder), so the long ones start early rather than one running on alone at the end.
SLOW_FIRST = [
    "test_router_paths", "test_handoff_kernel", "test_dp_attention", "test_multi_router",
    "test_pdd_core", "test_decode_cache", "test_faults", "test_plugin_flags", "test_hostile_input",
    "test_router_policy", "test_tp", "test_cross_dc_pd", "test_main_decode",
    "test_extend_attention_kernel", "test_eval_live", "test_pd_same_dc", "test_router_openai",
    "test_forkserver", "test_testbed", "test_router_hold",
]  # fmt: skip
# Modules that share session-scoped servers run on one worker, so those servers start once;
# every other module is a unit of its own (run.sh: --dist loadfile).
SHARED = {
    "test_router_paths": "mla", "test_handoff_kernel": "mla", "test_dp_attention": "mla",
    "test_pdd_core": "pdd_testbed", "test_multi_router": "pdd_testbed",
}  # fmt: skip


@pytest.hookimpl(optionalhook=True)  # an xdist hook: serial runs never call it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with SHARED's modules one unit. (xdist's own `loadgroup` cannot do it
    under this pytest: it renames items through a field pytest no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServersScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED.get(Path(path).stem, path)

    return SharedServersScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: order within kept


@pytest.fixture(scope="session", autouse=True)
def forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SGLang servers of this worker are forked from one process that imported SGLang
    (pdd.launch.forkserver): ~3 instead of ~23 CPU-seconds a start, on a suite that starts
    55. PDD_TEST_FORKSERVER=0 starts each the usual way."""
    if os.environ.get("PDD_TEST_FORKSERVER", "1") == "0":
        yield
        return
    run_dir = tmp_path_factory.mktemp("forkserver")
    path = run_dir / "socket"
    argv = [sys.executable, "-m", "pdd.launch.forkserver", "--socket", str(path)]
    server = ManagedProcess("forkserver", argv, run_dir / "forkserver.log", device_env())
    server.start()
    deadline = time.monotonic() + 30.0
    while not path.exists():  # bound at once; it imports SGLang after, and spawns wait for that
        assert not server.exited(), f"the fork server exited:\n{server.log_tail()}"
        assert time.monotonic() < deadline, f"the fork server never bound:\n{server.log_tail()}"
        time.sleep(0.05)
    os.environ[FORKSERVER_ENV] = str(path)
    try:
        yield
    finally:
        del os.environ[FORKSERVER_ENV]
        stop_groups([server.pgid])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PDD_TINY_MODEL (built by the test script) or a fresh build; both are byte-identical."""
    given = os.environ.get("PDD_TINY_MODEL")
    if given:
        return Path(given)
    from pdd.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PDD_WIDE_MODEL or a fresh build: 32 KB of KV per token, so KV bytes dominate the WAN."""
    given = os.environ.get("PDD_WIDE_MODEL")
    if given:
        return Path(given)
    from pdd.models.tiny import WIDE, make_tiny

    return make_tiny(tmp_path_factory.mktemp("wide"), WIDE)


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PDD_MLA_MODEL or a fresh build: a tiny DeepSeek-V3 (MLA, experts), byte-identical."""
    given = os.environ.get("PDD_MLA_MODEL")
    if given:
        return Path(given)
    from pdd.models.mla import make_mla

    return make_mla(tmp_path_factory.mktemp("mla"))


class Deployment(Protocol):
    def up(self) -> dict[str, float]: ...
    def pgids(self) -> dict[str, int]: ...


@pytest.fixture(scope="session")
def colocated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """One colocated tiny-model server for the whole session: the reference whose greedy tokens
    every path must reproduce (it holds no state a test depends on). Started when first asked
    for, not waited for here: a module waits for it after starting its own servers, so the
    start-ups overlap."""
    yield from _colocated("colocated", tiny_model, tmp_path_factory)


@pytest.fixture(scope="session")
def mla_colocated(
    mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    """A colocated server of the MLA model for the session (started when first asked for, not
    waited for here); the modules that use it share a worker (SHARED above)."""
    yield from _colocated("colocated_mla", mla_model, tmp_path_factory)


def _colocated(
    name: str, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    server = SGLangServer(name, model, free_port(), tmp_path_factory.mktemp("ref"))
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            stop_groups([server.process.pgid])


@contextmanager
def serving(colocated: SGLangServer, pd: Deployment, *routers: RouterService) -> Iterator[None]:
    """Starts a deployment, then any more routers over its servers, and waits for the session's
    colocated reference too; stops the deployment and the routers after."""
    try:
        times = pd.up()
        for router in routers:
            router.start()
            times[router.name] = router.wait_ready()
        times["colocated"] = colocated.wait_ready()
        print(f"start-up seconds: {format_seconds(times)}")
        yield
    finally:
        groups = list(pd.pgids().values())
        groups += [p.process.pgid for p in routers if p.process is not None]
        stop_groups(groups)


@contextmanager
def running(services: Sequence[HttpService], *references: SGLangServer) -> Iterator[None]:
    """Starts the services all at once (their start-ups overlap), waits for them and for the
    reference servers started elsewhere; stops the services after."""
    try:
        for s in services:
            s.start()
        for s in [*services, *references]:
            s.wait_ready()
        yield
    finally:
        stop_groups([s.process.pgid for s in services if s.process is not None])


@dataclass
class SharedPDD:
    """The session's PDD deployment on the testbed, for the modules of SHARED's "pdd_testbed"
    unit: each starts further routers of its own over these servers, and none stops a server
    or leaves the link changed."""

    tb: Testbed
    pdd: PDDDeployment

    def log_sizes(self) -> dict[str, int]:
        """Where each server's log ends now: a module reads only what it caused."""
        return {s.name: self._log(s).stat().st_size for s in self.pdd.servers()}

    def logs_since(self, sizes: dict[str, int]) -> dict[str, str]:
        """Each server's log from where `log_sizes` found it."""
        logs = {}
        for s in self.pdd.servers():
            with open(self._log(s), "rb") as f:
                f.seek(sizes[s.name])
                logs[s.name] = f.read().decode(errors="replace")
        return logs

    @staticmethod
    def _log(server: SGLangServer) -> Path:
        assert server.process is not None, f"{server.name} was never started"
        return server.process.log_path


@pytest.fixture(scope="session")
def pdd_testbed(
    tiny_model: Path, colocated: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedPDD]:
    """P and RLD in datacenter A, MD in B, over a 100 Mbit/s link of 20 ms one way (RTT 40 ms);
    the router in A runs Extend-Decode handoffs, serves the OpenAI endpoints and honours test
    controls. RLD is as large as MD here: the modules hold RLD's answers at a given token
    (pdd_hold_relay) or keep long answers on it, and test paths rather than RLD's size."""
    tb = Testbed("pddshared", LinkParams(100.0, 20.0), net="10.217")
    tb.down()  # whatever a crashed earlier run left
    tb.up()
    pdd = PDDDeployment.create(
        tiny_model, tmp_path_factory.mktemp("pdd_testbed"), tb.placement("a"), tb.placement("b"),
        path="pdd", relay_fraction=1.0,
        router_args=("--handoff-mode", "extend", "--tokenizer", str(tiny_model),
                     "--test-controls"),
    )  # fmt: skip
    try:
        with serving(colocated, pdd):
            yield SharedPDD(tb, pdd)
    finally:
        tb.down()
