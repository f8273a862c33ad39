"""MainDecode against real servers: P (prefill) + MD (`--pdd-role main`) + a colocated reference.

The test plays the router's part on the control plane: it sends MD a parked request, waits for
READY, then hands over tokens cut from the colocated server's greedy output, the way RelayDecode
would have produced them. MD's continuation must equal the colocated output.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq

from pdd.cache.mirror import CacheMirror
from pdd.control.channel import ControlSocket
from pdd.control.messages import (
    Ack,
    CacheSync,
    Cancel,
    Chunk,
    Error,
    Handoff,
    Message,
    Ready,
    SyncRequest,
    route_hint,
)
from pdd.eval.client import flush_cache
from pdd.launch.pd_local import generate
from pdd.launch.process import free_port, stop_groups
from pdd.launch.router import main_control_port
from pdd.launch.servers import SGLangServer
from pdd.models.tiny import VOCAB_SIZE
from tests.idle_checks import after_idle_checks
from tests.log_checks import tracebacks
from tests.marks import without_gpu
from tests.test_pd_same_dc import random_ids

MAX_NEW = 40
BLOCK = 16  # MD's default --pdd-cache-block
MD_POOL = 3000  # tokens of KV on MD: small enough that the eviction test fills it
SAMPLING = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
WAIT_S = 120.0


@dataclass
class Deployment:
    prefill: SGLangServer
    main: SGLangServer
    colocated: SGLangServer
    control: ControlSocket
    reply_to: str
    inbox: list[Message] = field(default_factory=list)
    # The test's copy of MD's radix cache, as a router keeps it.
    mirror: CacheMirror = field(default_factory=CacheMirror)

    @property
    def md_addr(self) -> str:
        return f"tcp://{self.main.host}:{main_control_port(self.main)}"

    def _pump(self, wait_ms: int) -> None:
        if not self.control.socket.poll(wait_ms, zmq.POLLIN):
            return
        for msg in self.control.recv_nowait():
            if not isinstance(msg, CacheSync):
                self.inbox.append(msg)
            elif not self.mirror.apply(msg):
                self.ask_cache()

    def recv(self, rid: str, timeout: float = WAIT_S) -> Message:
        """The next control message for `rid` (others stay queued for their own callers)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, msg in enumerate(self.inbox):
                if getattr(msg, "rid", None) == rid:
                    return self.inbox.pop(i)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no control message for {rid} within {timeout:.0f}s")
            self._pump(200)

    def send(self, msg: Message) -> None:
        assert self.control.send(self.md_addr, msg) > 0

    def ask_cache(self) -> None:
        m = self.mirror
        self.send(SyncRequest(self.reply_to, self.md_addr, m.epoch or "none", m.seq))

    def predicted(self, ids: list[int], settle_s: float = 1.0) -> int:
        """The mirror's cached prefix of `ids` once MD's latest changes (sent every 20 ms at
        most) have arrived."""
        time.sleep(0.1)  # lets MD finish caching the request that just ended
        self.ask_cache()  # answered after every pending delta: a barrier
        seq = -1
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and (self.mirror.stale or seq != self.mirror.seq):
            seq = self.mirror.seq
            self._pump(300)
        assert not self.mirror.stale, "MD did not answer the cache-sync request"
        return self.mirror.cached_prefix(ids)


@contextmanager
def started(
    model: Path,
    run_dir: Path,
    colocated: SGLangServer,
    args: Sequence[str] = (),
    md_args: Sequence[str] = (),
    md_env: dict[str, str] | None = None,
) -> Iterator[Deployment]:
    """P and MD, both with `args`; MD also with `md_args` and `md_env`. `colocated` (the
    session's reference for `model`, started elsewhere) is waited for with them."""
    prefill = SGLangServer("prefill", model, free_port(), run_dir, mode="prefill",
                           bootstrap_port=free_port(), extra_args=[*args])  # fmt: skip
    main = SGLangServer(
        "main", model, free_port(), run_dir, mode="decode",
        extra_args=[*args, "--pdd-role", "main", "--pdd-control-port", str(free_port()),
                    "--pdd-park-timeout", "20", "--disaggregation-decode-enable-radix-cache",
                    "--max-total-tokens", str(MD_POOL), *md_args],
        env=md_env or {},
    )  # fmt: skip
    servers = [prefill, main]
    control = ControlSocket()
    reply_to = control.bind(f"tcp://127.0.0.1:{free_port()}")
    for server in servers:
        server.start()
    try:
        for server in [*servers, colocated]:
            server.wait_ready()
        yield Deployment(prefill, main, colocated, control, reply_to)
    finally:
        control.close()
        stop_groups([s.process.pgid for s in servers if s.process is not None])


@pytest.fixture(scope="module")
def deployment(
    tiny_model: Path, colocated: SGLangServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    with started(tiny_model, tmp_path_factory.mktemp("main_decode"), colocated) as dep:
        yield dep


class Parked:
    """One request sent to P and parked on MD; MD's HTTP answer arrives in `result`."""

    def __init__(
        self,
        dep: Deployment,
        ids: list[int],
        sampling: dict | None = None,
        cancel_before_kv: bool = False,
    ) -> None:
        self.rid = f"t{random.randrange(1 << 40)}"
        self.result: dict | Exception | None = None
        body = {
            "input_ids": ids,
            "sampling_params": sampling or SAMPLING,
            "bootstrap_host": dep.prefill.host,
            "bootstrap_port": dep.prefill.bootstrap_port,
            "bootstrap_room": random.randrange(1 << 62),
        }
        hint = route_hint(role="main", park=True, reply_to=dep.reply_to)
        md_body = {**body, "rid": self.rid, "kv_hints": hint}
        self.thread = threading.Thread(target=self._call, args=(dep.main.url, md_body))
        self.thread.start()
        if cancel_before_kv:  # as the router does when RLD finishes before MD is ready
            dep.send(Cancel(rid=self.rid, reason="RLD finished the request first"))
        generate(dep.prefill.url, {**body, "rid": f"{self.rid}-p"})
        if cancel_before_kv:
            return
        ready = dep.recv(self.rid)
        assert isinstance(ready, Ready), ready
        self.ready = ready

    def _call(self, url: str, body: dict) -> None:
        try:
            self.result = generate(url, body, timeout=WAIT_S)
        except Exception as err:  # the test inspects it
            self.result = err

    def output(self) -> dict:
        self.thread.join(WAIT_S)
        assert isinstance(self.result, dict), self.result
        return self.result


def md_waiting(dep: Deployment, expected: int) -> int:
    """The requests waiting on MD as its /v1/loads tells the routers, once it is `expected` (the
    scheduler republishes it every few ms while busy) or after 10 s."""
    deadline = time.monotonic() + 10.0
    while True:
        with urllib.request.urlopen(f"{dep.main.url}/v1/loads?include=core", timeout=30) as r:
            loads = json.loads(r.read())["loads"]
        waiting = sum(int(load["num_waiting_reqs"]) for load in loads)
        if waiting == expected or time.monotonic() > deadline:
            return waiting
        time.sleep(0.05)


def reference(dep: Deployment, ids: list[int]) -> list[int]:
    return generate(dep.colocated.url, {"input_ids": ids, "sampling_params": SAMPLING})[
        "output_ids"
    ]


@pytest.mark.parametrize("k", [1, 2, 17, MAX_NEW - 1])
def test_extend_handoff_continues_like_colocated(deployment: Deployment, k: int) -> None:
    ids = random_ids(300, seed=k)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    assert md_waiting(deployment, 1) == 1  # parked: counted in MD's load for the routers
    assert parked.ready.prompt_len == 300
    assert parked.ready.first_token == ref[0]  # P's first token travelled with the KV
    cached = parked.ready.cached_len  # a fresh prompt: nothing, bar a chance first token
    assert cached <= 1
    assert parked.ready.wan_kv_bytes == (300 - cached) * 1024  # tiny, float32: 1 KB per token
    deployment.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:k])))
    assert parked.output()["output_ids"] == ref
    assert md_waiting(deployment, 0) == 0


@without_gpu("`auto` runs pdd's Triton kernel there, not SGLang's attention")
def test_on_a_cpu_handoff_extends_use_sglangs_attention(deployment: Deployment) -> None:
    """`--pdd-extend-kernel auto` (the default) keeps SGLang's attention where there is no GPU."""
    ids = random_ids(64, seed=3)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    deployment.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:5])))
    assert parked.output()["output_ids"] == ref
    log = (deployment.main.log_dir / "main.log").read_text()
    assert "handoff extends use SGLang's attention: the tensors are not on a CUDA device" in log
    assert "handoff extends use the Triton extend kernel" not in log


def test_catch_up_chunks_then_handoff(deployment: Deployment) -> None:
    ids = random_ids(250, seed=99)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    done = 0
    for end in (8, 20, 31):
        deployment.send(Chunk(rid=parked.rid, start=done, tokens=tuple(ref[done:end])))
        ack = deployment.recv(parked.rid)
        assert ack == Ack(rid=parked.rid, done=end)
        done = end
    deployment.send(Handoff(rid=parked.rid, start=done, tokens=tuple(ref[done:35])))
    assert parked.output()["output_ids"] == ref


def test_a_handoff_sent_before_the_chunks_ack_follows_it(deployment: Deployment) -> None:
    """The handoff waits for the chunk's extend (which may still be running, with the overlap
    scheduler) rather than being rejected or racing it."""
    ids = random_ids(180, seed=98)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    deployment.send(Chunk(rid=parked.rid, start=0, tokens=tuple(ref[:9])))
    deployment.send(Handoff(rid=parked.rid, start=9, tokens=tuple(ref[9:14])))
    assert deployment.recv(parked.rid) == Ack(rid=parked.rid, done=9)
    assert parked.output()["output_ids"] == ref


def test_md_keeps_sglangs_overlap_scheduler(deployment: Deployment) -> None:
    """Handoff extends are batches of SGLang's own loop, so MD's role does not turn the overlap
    scheduler off (SGLang runs CPU decode with it)."""
    assert deployment.main.server_info()["disable_overlap_schedule"] is False


def test_several_handoffs_share_one_extend(deployment: Deployment) -> None:
    prompts = [random_ids(n, seed=1000 + n) for n in (40, 120, 260, 333)]
    refs = [reference(deployment, ids) for ids in prompts]
    parked = [Parked(deployment, ids) for ids in prompts]
    for i, (p, ref) in enumerate(zip(parked, refs, strict=True)):
        deployment.send(Handoff(rid=p.rid, start=0, tokens=tuple(ref[: 5 + 7 * i])))
    for p, ref in zip(parked, refs, strict=True):
        assert p.output()["output_ids"] == ref


def test_bad_handoffs_are_rejected_and_the_request_survives(deployment: Deployment) -> None:
    ids = random_ids(90, seed=5)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    for bad in (
        Handoff(rid=parked.rid, start=3, tokens=tuple(ref[3:9])),  # MD holds 0 tokens
        Handoff(rid=parked.rid, start=0, tokens=(*ref[:4], VOCAB_SIZE)),  # not a token
        Handoff(rid=parked.rid, start=0, tokens=tuple(ref) + (1,)),  # over max_new_tokens
    ):
        deployment.send(bad)
        err = deployment.recv(parked.rid)
        assert isinstance(err, Error), err
    good = Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:6]))
    deployment.send(good)
    deployment.send(good)  # a duplicate is rejected or dropped, never acted on twice
    assert parked.output()["output_ids"] == ref


def test_relay_tokens_win_over_ps_first_token(deployment: Deployment) -> None:
    """With sampling, P's prefill for MD may sample another first token than RLD got: MD must
    continue from what RLD streamed."""
    ids = random_ids(150, seed=11)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    other = (ref[0] + 1) % VOCAB_SIZE
    deployment.send(Handoff(rid=parked.rid, start=0, tokens=(other,)))
    expected = reference(deployment, [*ids, other])  # the same context from the start
    assert parked.output()["output_ids"] == [other, *expected[: MAX_NEW - 1]]


def test_conversation_reuses_md_cache_and_stays_exact(deployment: Deployment) -> None:
    """Each turn extends the last prompt and answer: MD (decode radix cache) already holds them,
    so P sends only the new suffix; handed-off and cached KV give the colocated tokens."""
    ids = random_ids(300, seed=21)
    # The answer's last token has KV only if the overlap scheduler ran one more decode step.
    unfinished = 1 if deployment.main.server_info()["disable_overlap_schedule"] else 0
    previous = 0
    for k in range(3):
        ref = reference(deployment, ids)
        parked = Parked(deployment, ids)
        if k > 0:  # the previous prompt and answer (KV of the answer's last token: see above)
            assert parked.ready.cached_len == previous - unfinished, parked.ready
        deployment.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[: 4 + 5 * k])))
        assert parked.output()["output_ids"] == ref
        previous = len(ids) + len(ref)
        ids = ids + ref + random_ids(80, seed=30 + k)
    # Evicted (here: all of it, as an MD restart would), the next turn is still exact. The flush
    # waits for MD to go idle (a loaded CI machine may still be finishing the last turn there).
    flush_cache(deployment.main.url)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    assert parked.ready.cached_len <= 1
    deployment.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:3])))
    assert parked.output()["output_ids"] == ref


def test_cancel_and_timeout_free_the_request(deployment: Deployment) -> None:
    cancelled = Parked(deployment, random_ids(120, seed=6))
    deployment.send(Cancel(rid=cancelled.rid, reason="finished on relay"))
    cancelled.thread.join(WAIT_S)
    assert isinstance(cancelled.result, Exception) and "503" in str(cancelled.result)
    # Never handed over: MD frees it after --pdd-park-timeout (20 s here).
    forgotten = Parked(deployment, random_ids(60, seed=7))
    forgotten.thread.join(WAIT_S)
    assert isinstance(forgotten.result, Exception) and "503" in str(forgotten.result)
    # MD still serves, and once idle after it, SGLang's idle check (strict by default) finds
    # no leaked KV slot or row.
    log_path = deployment.main.log_dir / "main.log"
    since = log_path.stat().st_size
    ids = random_ids(50, seed=8)
    ref = reference(deployment, ids)
    again = Parked(deployment, ids)
    deployment.send(Handoff(rid=again.rid, start=0, tokens=tuple(ref[:3])))
    assert again.output()["output_ids"] == ref
    after_idle_checks(lambda: {"MD": log_path.read_bytes()[since:].decode(errors="replace")})
    log = log_path.read_text()
    assert "memory leak" not in log
    assert not tracebacks(log)


def test_a_cancel_before_the_kv_lands_still_caches_the_prompt(deployment: Deployment) -> None:
    """MD's tree gets every prompt P sends it, even for requests RLD finished alone."""
    ids = random_ids(250, seed=95)
    early = Parked(deployment, ids, cancel_before_kv=True)
    early.thread.join(WAIT_S)
    assert isinstance(early.result, Exception) and "503" in str(early.result)
    assert deployment.predicted(ids) == 250 // BLOCK * BLOCK
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    assert parked.ready.cached_len >= 249  # all but what MD must recompute itself
    deployment.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:4])))
    assert parked.output()["output_ids"] == ref


def test_md_tells_the_router_what_it_holds(deployment: Deployment) -> None:
    """Before each turn is sent, the cache-sync view predicts MD's hit to within a block."""
    dep = deployment
    ids = random_ids(300, seed=51)
    for k in range(3):
        predicted = dep.predicted(ids)
        ref = reference(dep, ids)
        parked = Parked(dep, ids)
        cached = parked.ready.cached_len
        assert predicted <= cached < predicted + BLOCK, (k, predicted, parked.ready)
        assert (predicted > 0) == (k > 0), (k, predicted)
        dep.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:5])))
        assert parked.output()["output_ids"] == ref
        ids = ids + ref + random_ids(60, seed=60 + k)
    with urllib.request.urlopen(f"{dep.main.url}/flush_cache", timeout=30) as resp:
        assert resp.status == 200
    assert dep.predicted(ids) == 0 and dep.mirror.hashes == set()


def test_evictions_keep_outputs_exact_and_the_view_right(deployment: Deployment) -> None:
    """More conversations than MD's pool holds: MD evicts the oldest; every answer stays exact
    and the view never claims a block MD no longer has."""
    dep = deployment
    prompts = [random_ids(400, seed=70 + i) for i in range(9)]  # 9 x 440 tokens > MD_POOL
    refs = [reference(dep, ids) for ids in prompts]

    def run(i: int) -> int:
        predicted = dep.predicted(prompts[i])
        parked = Parked(dep, prompts[i])
        assert predicted <= parked.ready.cached_len < predicted + BLOCK, (i, predicted)
        dep.send(Handoff(rid=parked.rid, start=0, tokens=tuple(refs[i][:7])))
        assert parked.output()["output_ids"] == refs[i], i
        return predicted

    for i in range(len(prompts)):
        run(i)
    assert dep.mirror.tokens <= MD_POOL
    # The oldest conversation was evicted (at least in part), the newest one is whole.
    assert dep.predicted(prompts[0]) < 400 <= dep.predicted(prompts[-1]) + BLOCK
    for i in (0, len(prompts) - 1):
        run(i)


def test_a_restarted_md_starts_empty_and_the_view_follows(deployment: Deployment) -> None:
    """Runs last: restarts MD. Its tree starts empty, a new epoch tells the router so."""
    dep = deployment
    ids = random_ids(200, seed=90)
    ref = reference(dep, ids)
    parked = Parked(dep, ids)
    dep.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:3])))
    assert parked.output()["output_ids"] == ref
    assert dep.predicted(ids) >= 200 - BLOCK
    epoch = dep.mirror.epoch
    assert dep.main.process is not None
    dep.main.process.stop()
    dep.main.start()
    dep.main.wait_ready()
    assert dep.predicted(ids, settle_s=5.0) == 0
    assert dep.mirror.epoch != epoch and dep.mirror.resyncs >= 1
    parked = Parked(dep, ids)
    assert parked.ready.cached_len <= 1  # P sent the whole prompt again
    dep.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:3])))
    assert parked.output()["output_ids"] == ref
