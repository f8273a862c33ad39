"""The PDD router in front of real servers: P (prefill), RLD (plain decode), MD (`--pdd-role
main`) and a colocated reference. Greedy output through every path equals the colocated
server's; the handoff (extend and Catch-Up), RLD-only completion and error answers are checked
on the real streams. Every test runs on two models: the tiny dense one (GQA) and a tiny
DeepSeek-V3 (MLA: a latent KV pool; experts), whose colocated server is itself checked against
transformers."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd.launch.pd_local import generate
from pdd.launch.process import free_port
from pdd.launch.router import RouterService
from pdd.launch.servers import DTYPE_ENV, SGLangServer
from pdd.models.kv import DTYPE_BYTES, kv_bytes_per_token
from tests.conftest import running
from tests.test_pd_same_dc import random_ids

MAX_NEW = 96
# The routers honour test controls: a request that needs MD to take part holds RLD's output at
# HOLD tokens until MD is ready (pdd_hold_relay, pdd.router.hold), so it is handed off at exactly
# HOLD tokens however fast the tiny model decodes.
TEST_CONTROLS = ["--test-controls"]
HOLD = 8
CATCHUP_HOLD = 40  # where the Catch-Up router feeds MD: MD catches up on these 40 in chunks
LENGTHS = [9, 150, 700]


def states(pdd: dict) -> list[str]:
    """The request's states in order (pdd.router.request_machine), each begun after the last."""
    times = [t for _, t in pdd["states"]]
    assert times == sorted(times), pdd["states"]
    return [name for name, _ in pdd["states"]]


HANDED_OFF = ["prefill", "relay", "ready", "handoff", "main", "done"]
# P->MD enters "transfer" when P answers before MD's first token: either order is right.
DIRECT = (["prefill", "main", "done"], ["prefill", "transfer", "main", "done"])


def sampling(max_new: int = MAX_NEW, temperature: float = 0.0) -> dict:
    return {"temperature": temperature, "max_new_tokens": max_new, "ignore_eos": True}


@dataclass
class Deployment:
    model: Path
    colocated: SGLangServer
    prefill: SGLangServer
    relay: SGLangServer
    main: SGLangServer
    router: RouterService  # Extend-Decode handoffs
    catchup: RouterService  # Catch-Up forced: MD is fed only after RLD streamed 40 tokens
    no_main: RouterService  # its MD address answers nobody
    slow_main: RouterService  # never feeds MD: its READY deadline (1 s) passes

    def servers(self) -> list[SGLangServer | RouterService]:
        """Its own servers and routers (the colocated reference is the session's)."""
        return [self.router, self.catchup, self.no_main, self.slow_main, self.prefill,
                self.relay, self.main]  # fmt: skip


@pytest.fixture(scope="module", params=["tiny", "mla"])
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Deployment]:  # fmt: skip
    model: Path = request.getfixturevalue(f"{request.param}_model")
    colocated: SGLangServer = request.getfixturevalue(
        "colocated" if request.param == "tiny" else "mla_colocated"
    )
    run_dir = tmp_path_factory.mktemp("router")
    prefill = SGLangServer("prefill", model, free_port(), run_dir, mode="prefill",
                           bootstrap_port=free_port())  # fmt: skip
    relay = SGLangServer("relay", model, free_port(), run_dir, mode="decode")
    main = SGLangServer(
        "main", model, free_port(), run_dir, mode="decode",
        extra_args=["--pdd-role", "main", "--pdd-control-port", str(free_port()),
                    "--pdd-park-timeout", "30"],
    )  # fmt: skip
    # An MD that was never started: its HTTP and control ports answer nobody.
    ghost = SGLangServer("ghost", model, free_port(), run_dir, mode="decode",
                         extra_args=["--pdd-control-port", str(free_port())])  # fmt: skip
    tiers = {"prefill": [prefill], "relay": [relay]}
    d = Deployment(
        model, colocated, prefill, relay, main,
        router=RouterService("router", free_port(), run_dir, main=[main], **tiers,
                             path="pdd", extra_args=["--handoff-mode", "extend", *TEST_CONTROLS]),
        catchup=RouterService(
            "router_catchup", free_port(), run_dir, main=[main], **tiers,
            path="pdd",
            extra_args=["--handoff-mode", "catchup", "--catchup-threshold", "8",
                        "--catchup-chunk", "16", "--md-feed-after-tokens", "40", *TEST_CONTROLS],
        ),
        no_main=RouterService("router_no_main", free_port(), run_dir, main=[ghost], **tiers,
                              path="pdd", extra_args=["--ready-timeout", "20"]),
        slow_main=RouterService("router_slow_main", free_port(), run_dir, main=[main], **tiers,
                                path="pdd",
                                extra_args=["--md-feed-after-tokens", "100000",
                                            "--ready-timeout", "1", *TEST_CONTROLS]),
    )  # fmt: skip
    with running(d.servers(), colocated):
        yield d


def kv_per_token(d: Deployment) -> int:
    return kv_bytes_per_token(d.model, DTYPE_BYTES[os.environ[DTYPE_ENV]])


def prompts() -> list[list[int]]:
    return [random_ids(n, seed=1000 + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(deployment: Deployment) -> list[list[int]]:
    url = deployment.colocated.url
    return [generate(url, {"input_ids": ids, "sampling_params": sampling()})["output_ids"]
            for ids in prompts()]  # fmt: skip


def through(router: RouterService, ids: list[int], path: str | None, hold: int | None = None,
            **params: object) -> dict:  # fmt: skip
    body: dict = {"input_ids": ids, "sampling_params": sampling(**params)}  # type: ignore[arg-type]
    if path is not None:
        body["pdd_path"] = path
    if hold is not None:
        body["pdd_hold_relay"] = hold
    return generate(router.url, body, timeout=300)


def stream(router: RouterService, ids: list[int], path: str | None,
           hold: int | None = None) -> list[dict]:  # fmt: skip
    body: dict = {"input_ids": ids, "sampling_params": sampling(), "stream": True}
    if path is not None:
        body["pdd_path"] = path
    if hold is not None:
        body["pdd_hold_relay"] = hold
    req = urllib.request.Request(
        f"{router.url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def http_error(url: str, data: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_sglang_serves_the_mla_model_as_transformers_computes_it(
    mla_model: Path, mla_colocated: SGLangServer
) -> None:
    """SGLang's DeepSeek-V3 class on CPU (latent attention through pdd.srt.mla_cpu) makes the
    tokens transformers makes, on a fresh prompt and again with the prompt cached."""
    import torch
    from transformers import AutoModelForCausalLM

    ids, n = prompts()[1], 24
    model = AutoModelForCausalLM.from_pretrained(mla_model, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    mla_colocated.wait_ready()
    body = {"input_ids": ids, "sampling_params": sampling(max_new=n)}
    first, again = generate(mla_colocated.url, body), generate(mla_colocated.url, body)
    assert first["output_ids"] == expected and again["output_ids"] == expected
    assert again["meta_info"]["cached_tokens"] >= len(ids) - 1, again["meta_info"]


@pytest.mark.parametrize("path, label", [("relay", "P->RLD"), ("main", "P->MD")])
def test_single_decoder_paths_equal_colocated(
    deployment: Deployment, reference: list[list[int]], path: str, label: str
) -> None:
    for i, ids in enumerate(prompts()):
        got = through(deployment.router, ids, path)
        assert got["output_ids"] == reference[i], f"{path}: prompt {i} ({len(ids)} tokens)"
        pdd = got["meta_info"]["pdd"]
        assert pdd["path"] == label and pdd["handoff_mode"] is None
        assert states(pdd) in (DIRECT if path == "main" else [["prefill", "relay", "done"]])
        assert got["meta_info"]["id"] == pdd["rid"]
        if path == "main":  # MD's READY reports what crossed the WAN on P -> MD too
            assert pdd["md_prompt_tokens"] == len(ids), pdd
            expected = (len(ids) - pdd["md_cached_tokens"]) * kv_per_token(deployment)
            assert pdd["wan_kv_bytes"] == expected, pdd
        else:
            assert pdd["wan_kv_bytes"] is None, pdd
    if path == "main":  # ... and the router learnt the WAN from it
        with urllib.request.urlopen(f"{deployment.router.url}/status", timeout=30) as resp:
            wan = json.loads(resp.read())["instances"]["main"][0]["wan"]
        assert wan["kv_bytes_per_token"] == kv_per_token(deployment), wan


def test_extend_handoff_equals_colocated(
    deployment: Deployment, reference: list[list[int]]
) -> None:
    for i, ids in enumerate(prompts()):
        got = through(deployment.router, ids, "pdd", hold=HOLD)
        assert got["output_ids"] == reference[i], f"prompt {i} ({len(ids)} tokens)"
        pdd = got["meta_info"]["pdd"]
        assert pdd["path"] == "P->RLD->MD", pdd
        assert pdd["handoff_mode"] == "extend" and pdd["chunks"] == 0
        assert states(pdd) == HANDED_OFF, pdd
        assert pdd["relay_tokens"] == HOLD and pdd["main_tokens"] == MAX_NEW - HOLD, pdd
        assert pdd["main_tokens"] > 0 and pdd["handoff_latency_s"] is not None
        assert pdd["md_prompt_tokens"] == len(ids) and pdd["wan_kv_bytes"] > 0
        assert 0 < pdd["control_bytes"] < 2000  # token ids, not KV


def test_catchup_handoff_equals_colocated(
    deployment: Deployment, reference: list[list[int]]
) -> None:
    # Held at the 40 tokens the client has when MD is fed: MD catches up on them in 16-token
    # chunks (two), then takes the last 8 in the final handoff.
    got = through(deployment.catchup, prompts()[1], None, hold=CATCHUP_HOLD)
    assert got["output_ids"] == reference[1]
    pdd = got["meta_info"]["pdd"]
    assert pdd["path"] == "P->RLD->MD", json.dumps(pdd)
    assert pdd["handoff_mode"] == "catchup" and pdd["chunks"] == 2, pdd
    assert pdd["relay_tokens"] == CATCHUP_HOLD, pdd
    assert states(pdd) == HANDED_OFF, pdd  # READY while the chunks went, then the handoff


@pytest.mark.parametrize("path", ["relay", "pdd", "main"])
def test_streamed_equals_non_streamed(
    deployment: Deployment, reference: list[list[int]], path: str
) -> None:
    hold = HOLD if path == "pdd" else None  # a handoff by construction
    chunks = stream(deployment.router, prompts()[0], path, hold)
    seen: list[int] = []
    for c in chunks:
        # Cumulative, each chunk extends what the client has: every token once, in order.
        assert c["output_ids"][: len(seen)] == seen and len(c["output_ids"]) > len(seen)
        seen = c["output_ids"]
    assert seen == reference[0]
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "length"
    assert all("pdd" not in c["meta_info"] for c in chunks[:-1]) and "pdd" in final
    label = {"relay": "P->RLD", "pdd": "P->RLD->MD", "main": "P->MD"}[path]
    assert final["pdd"]["path"] == label, final["pdd"]
    non_streamed = through(deployment.router, prompts()[0], path, hold)
    assert non_streamed["text"] == chunks[-1]["text"]


def test_relay_finishing_first_is_the_answer(deployment: Deployment) -> None:
    ids = prompts()[2]
    expected = generate(deployment.colocated.url, {"input_ids": ids,
                        "sampling_params": sampling(max_new=2)})  # fmt: skip
    # The catch-up router feeds MD after 40 tokens: RLD surely finishes first.
    got = through(deployment.catchup, ids, "pdd", max_new=2)
    assert got["output_ids"] == expected["output_ids"]
    pdd = got["meta_info"]["pdd"]
    assert pdd["path"] == "P->RLD" and pdd["relay_tokens"] == 2
    assert pdd["md_failure"] == "RLD finished the request first"
    assert states(pdd) == ["prefill", "relay", "done"], pdd
    # MD let go of the request: the next handoff works as before.
    again = through(deployment.router, prompts()[0], "pdd", hold=HOLD)
    assert again["meta_info"]["pdd"]["path"] == "P->RLD->MD"


def test_unreachable_md_leaves_the_request_to_relay(
    deployment: Deployment, reference: list[list[int]]
) -> None:
    got = through(deployment.no_main, prompts()[0], "pdd")
    assert got["output_ids"] == reference[0]
    pdd = got["meta_info"]["pdd"]
    # Health checks found the MD down (then RLD alone is planned), or the request did.
    assert pdd["path"] == "P->RLD", pdd
    assert pdd["path_reason"] == "every MD is down" or "unreachable" in pdd["md_failure"], pdd
    status, body = http_error(
        f"{deployment.no_main.url}/generate",
        json.dumps({"input_ids": prompts()[0], "pdd_path": "main"}).encode(),
    )
    message = body["error"]["message"]
    assert status == 503 and ("down" in message or "unreachable" in message), body


def test_md_not_ready_in_time_leaves_the_request_to_relay(
    deployment: Deployment, reference: list[list[int]]
) -> None:
    # The hold keeps what RLD makes after HOLD tokens (its end too) from the client until the 1 s
    # READY deadline passes, however fast RLD decodes; then RLD's answer goes on.
    got = through(deployment.slow_main, prompts()[1], "pdd", hold=HOLD)
    assert got["output_ids"] == reference[1]
    pdd = got["meta_info"]["pdd"]
    assert pdd["path"] == "P->RLD" and pdd["md_failure"] == "MD not ready within 1s"
    assert "prefill_md_sent" not in pdd["timings"]  # P never had to feed MD
    assert states(pdd) == ["prefill", "relay", "done"], pdd
    metrics = urllib.request.urlopen(f"{deployment.slow_main.url}/metrics").read().decode()
    assert 'pdd_router_timeouts_total{wait="ready"} 1' in metrics  # the wait that ran out
    # MD dropped the request it was waiting for: handoffs through MD still work.
    again = through(deployment.router, prompts()[0], "pdd", hold=HOLD)
    assert again["output_ids"] == reference[0]
    assert again["meta_info"]["pdd"]["path"] == "P->RLD->MD"


def abort_mid_answer(router: RouterService, server: SGLangServer, colocated: SGLangServer,
                     path: str, suffix: str, max_new: int = 300) -> tuple[dict, int]:  # fmt: skip
    """Streams prompts()[1] on `path` and, after 5 tokens, aborts the request on `server` (as
    a crash would end it). Checks that the client got every token once, in order, and that the
    whole answer equals `colocated`'s; returns the last chunk and the tokens seen at the abort."""
    ids = prompts()[1]
    body = {"input_ids": ids, "sampling_params": sampling(max_new=max_new)}
    expected = generate(colocated.url, body)["output_ids"]
    req = urllib.request.Request(
        f"{router.url}/generate",
        json.dumps({**body, "stream": True, "pdd_path": path}).encode(),
        {"Content-Type": "application/json"},
    )
    seen: list[int] = []
    aborted_at = None
    chunk: dict = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            assert chunk["output_ids"][: len(seen)] == seen  # every token once, in order
            seen = chunk["output_ids"]
            if aborted_at is None and len(seen) >= 5:
                aborted_at = len(seen)
                rid = chunk["meta_info"]["id"] + suffix  # the router's rid, and RLD's suffix
                abort = json.dumps({"rid": rid}).encode()
                urllib.request.urlopen(urllib.request.Request(
                    f"{server.url}/abort_request", abort,
                    {"Content-Type": "application/json"}), timeout=30).read()  # fmt: skip
    assert aborted_at is not None and seen == expected
    assert chunk["meta_info"]["finish_reason"]["type"] == "length"
    return chunk, aborted_at


def check_resumed(pdd: dict, path: str, aborted_at: int, max_new: int = 300) -> None:
    """`pdd` (the meta of a request aborted on `path` after `aborted_at` tokens) says the other
    decode tier resumed it, with every token counted once."""
    label, resumed_on = ("P->MD", "RLD") if path == "main" else ("P->RLD", "MD")
    assert pdd["path"] == label and pdd["resumed_on"] == resumed_on, pdd
    first, then = ("main", "relay") if path == "main" else ("relay", "main")
    expected = ["prefill", first, "resume", then, "done"]
    assert [s for s in states(pdd) if s != "transfer"] == expected, pdd
    resumed = pdd["resumed_at"]
    assert resumed >= aborted_at and pdd["relay_tokens"] + pdd["main_tokens"] == max_new, pdd


@pytest.mark.parametrize("path, suffix, metric", [("main", "", "relay"), ("relay", "-r", "main")])
def test_a_side_failing_mid_answer_is_resumed_on_the_other(
    deployment: Deployment, path: str, suffix: str, metric: str
) -> None:
    """The server streaming to the client aborts the request (as a crash would end it): the
    other decode tier finishes it from the tokens the client has, and the whole answer equals
    the colocated server's."""
    server = getattr(deployment, path)  # the tier serving that path alone
    chunk, aborted_at = abort_mid_answer(deployment.router, server, deployment.colocated,
                                         path, suffix)  # fmt: skip
    check_resumed(chunk["meta_info"]["pdd"], path, aborted_at)
    metrics = urllib.request.urlopen(f"{deployment.router.url}/metrics").read().decode()
    assert f'pdd_router_resumes_total{{on="{metric}"}} 1' in metrics


def test_bad_requests_get_clear_4xx(deployment: Deployment) -> None:
    url = f"{deployment.router.url}/generate"
    cases = [
        (b"{not json", "malformed JSON"),
        (b'{"sampling_params": {}}', "give exactly one of them"),
        (b'{"text": "hi", "pdd_path": "sideways"}', "pdd_path"),
        (b'{"text": ["a", "b"]}', "batch"),
        (b'{"text": "hi", "bootstrap_room": 3}', "set by the router"),
    ]
    for data, reason in cases:
        status, body = http_error(url, data)
        assert status == 400 and reason in body["error"]["message"], (data, body)
    # SGLang's own 4xx (here: a bad sampling parameter) reaches the client as a 4xx.
    bad = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": -1}, "pdd_path": "relay"}
    status, body = http_error(url, json.dumps(bad).encode())
    assert 400 <= status < 500, body


def test_client_disconnect_frees_everything(deployment: Deployment) -> None:
    body = {"input_ids": prompts()[1], "sampling_params": sampling(max_new=2000), "stream": True}
    req = urllib.request.Request(
        f"{deployment.router.url}/generate", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.readline().startswith(b"data: ")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = json.loads(urllib.request.urlopen(f"{deployment.router.url}/status").read())
        if status["active_requests"] == 0:
            break
        time.sleep(0.5)
    assert status["active_requests"] == 0
    assert all(i["active"] == 0 for tier in status["instances"].values() for i in tier)


def test_metrics_and_health(deployment: Deployment) -> None:
    assert http_error(f"{deployment.router.url}/health")[0] == 200
    text = urllib.request.urlopen(f"{deployment.router.url}/metrics").read().decode()
    assert 'pdd_router_requests_total{path="P->RLD->MD"}' in text
    assert 'pdd_router_handoffs_total{mode="extend"}' in text
    assert 'pdd_router_control_bytes_total{direction="in"}' in text
    assert 'pdd_router_errors_total{kind="bad_request"}' in text
    # No request of this module (every path, handoffs, resumes, failures) made a state
    # transition the request's state machine does not allow.
    assert 'pdd_router_errors_total{kind="state"}' not in text


def test_sampled_requests_hand_off(deployment: Deployment) -> None:
    """With temperature > 0, P's two prefills (for RLD and for MD) may sample different first
    tokens; MD continues from what the client got from RLD."""
    for seed in range(3):
        ids = random_ids(200, seed=seed)
        got = through(deployment.router, ids, "pdd", hold=HOLD, temperature=1.0)
        assert len(got["output_ids"]) == MAX_NEW
        pdd = got["meta_info"]["pdd"]
        assert pdd["path"] == "P->RLD->MD" and pdd["md_failure"] is None, pdd
