"""Faults under load on the testbed: nothing is lost, nothing is wrong.

    python -m pdd.eval faults [--requests 300] [--concurrency 16] [--scenarios none,cut,...]
                              [--rate-mbit 8] [--delay-ms 20] [--dtype float32]
                              [--prefills 1] [--out runs/faults]

Needs root. Brings up its own testbed (name `pddfault`), one PDD deployment on it (P and RLD in
A, MD in B, the router in A, the router's automatic path policy) and a colocated reference
server. Each scenario replays the same requests (fresh prompts and conversation turns, greedy)
through the router at a fixed concurrency and injects its fault once a third of them are done:
- none: no fault (the baseline);
- cut: the WAN drops everything both ways for `--fault-s` seconds;
- collapse: the WAN falls to 1% of its rate for 2 x `--fault-s` seconds;
- md-kill / rld-kill / p-kill: that server crashes (SIGKILL to all its processes: SIGTERM would
  let SGLang finish its running requests first), and starts again `--fault-s` seconds later;
  with `--prefills 2` p-kill crashes one of two P servers, and the router prefills again on the
  other what the dead one had not finished;
- overload: no fault, but 4 x `--concurrency` clients against a router that admits 2 x (its
  `--max-active`): the rest get 503 with Retry-After and retry after it, with jitter, for up to
  600 s (counted as refused).
Every request ends in one of: completed (its tokens are compared with the colocated server's;
a wrong one is printed with where it first differs), failed with a clear error (an HTTP error or
an error event that says why), or lost (no answer within the client's timeout, a broken
connection, or a stream that stopped without a reason). All servers run in float32 by default:
in bf16 a greedy near-tie can flip with the batch a request shares, which the colocated
reference (one request at a time) does not see.
After each scenario a request must complete again (recovered) and every server must go idle,
all its KV freed, within 120 s (released: the router's timeouts end what the fault stranded).
Prints a table (sent, completed, failed, lost, wrong outputs, 503s, throughput, TTFT P99 from
a request's first attempt, recovered, released, the commonest error) and writes JSON, markdown
and a plot (each request's TTFT against when it was sent, the fault's window shaded) to --out.
Exits 1 if any request was lost or wrong, or the deployment did not recover or release.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import urllib.error
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdd.eval.client import flush_cache, stream_generate
from pdd.eval.faults_plot import plot_faults
from pdd.eval.prompts import random_ids
from pdd.eval.replay import replay
from pdd.eval.report import percentile
from pdd.eval.workload import TraceRequest
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import exit_on_sigterm, free_port, stop_groups
from pdd.launch.servers import SGLangServer
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams

SCENARIOS = ("none", "cut", "collapse", "md-kill", "rld-kill", "p-kill", "overload")
OVERLOAD_X = 4  # the overload scenario's concurrency, in multiples of --concurrency
MAX_ACTIVE_X = 2  # the router's --max-active, in multiples of --concurrency
CLIENT_TIMEOUT_S = 180.0
RETRY_BUDGET_S = 600.0  # how long a refused client keeps retrying
RELEASE_WAIT_S = 120.0  # > the router's ready timeout (60 s), which ends stranded transfers


@dataclass
class Outcome:
    kind: str  # "completed", "failed" or "lost"
    ttft_s: float | None = None
    output: list[int] | None = None
    reason: str = ""
    path: str | None = None
    index: int = -1  # the request's position in the replay
    diverged_at: int | None = None  # a completed output's first token unlike colocated's
    refused: int = 0  # 503s (admission control) before the answer
    started_s: float = 0.0  # when the client sent it, from the scenario's start


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where two outputs differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


@dataclass
class Result:
    scenario: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    fault_at_s: float | None = None
    fault_end_s: float | None = None
    recovered: bool = True  # a request after the fault completed
    released: bool = True  # every server went idle (all KV freed) within RELEASE_WAIT_S after

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    @property
    def wrong(self) -> int:
        return sum(o.diverged_at is not None for o in self.outcomes)

    def row(self) -> dict[str, object]:
        done = [o for o in self.outcomes if o.kind == "completed"]
        reasons = Counter(o.reason for o in self.outcomes if o.kind != "completed")
        ttft = [o.ttft_s for o in done if o.ttft_s is not None]
        return {
            "scenario": self.scenario,
            "sent": len(self.outcomes),
            "completed": len(done),
            "failed": self.count("failed"),
            "lost": self.count("lost"),
            "wrong": self.wrong,
            "refused": sum(o.refused for o in self.outcomes),
            "rps": len(done) / max(self.wall_s, 1e-9),
            "ttft_p99": percentile(ttft, 99),
            "recovered": self.recovered,
            "released": self.released,
            "top_error": reasons.most_common(1)[0][0][:120] if reasons else "",
            "paths": dict(Counter(o.path or "-" for o in done).most_common()),
        }


def requests_for(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (fresh ones of 200-1200 tokens and conversation turns over a few shared
    contexts) and output lengths (mostly 16-64, some 1-4: relay-only traffic)."""
    rng = random.Random(seed)
    contexts = [random_ids(rng.randint(300, 900), rng.randrange(1 << 30), vocab) for _ in range(4)]
    prompts, outputs = [], []
    for i in range(n):
        if rng.random() < 0.5:
            ctx = rng.randrange(len(contexts))
            contexts[ctx] = contexts[ctx] + random_ids(rng.randint(10, 60), seed * 1000 + i, vocab)
            prompts.append(list(contexts[ctx]))
        else:
            prompts.append(random_ids(rng.randint(200, 1200), rng.randrange(1 << 30), vocab))
        outputs.append(rng.randint(1, 4) if rng.random() < 0.1 else rng.randint(16, 64))
    return prompts, outputs


def call(url: str, ids: list[int], max_new: int) -> Outcome:
    """One request, as a well-behaved client sends it: a 503 with Retry-After (the router's
    admission control) is retried after that long plus jitter, for up to RETRY_BUDGET_S; once
    admitted, the answer has CLIENT_TIMEOUT_S."""
    start = time.monotonic()
    refused = 0
    while True:
        attempt = time.monotonic()
        outcome, retry_after = call_once(url, ids, max_new)
        if retry_after is None:
            break
        refused += 1
        wait = retry_after * random.uniform(1.0, 2.0)  # no thundering herd
        if time.monotonic() - start + wait >= RETRY_BUDGET_S:
            break
        time.sleep(wait)
    if outcome.ttft_s is not None:  # from the first attempt, as the client sees it
        outcome.ttft_s += attempt - start
    outcome.refused = refused
    return outcome


def call_once(url: str, ids: list[int], max_new: int) -> tuple[Outcome, float | None]:
    """One attempt, and the Retry-After of a 503 that asks to retry."""
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    try:
        got = stream_generate(url, {"input_ids": ids, "sampling_params": sampling},
                              timeout=CLIENT_TIMEOUT_S)  # fmt: skip
    except urllib.error.HTTPError as err:
        body = err.read().decode(errors="replace")
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return Outcome("lost", reason=f"HTTP {err.code} without a reason: {body[:200]}"), None
        retry_after = err.headers.get("Retry-After") if err.code == 503 else None
        failed = Outcome("failed", reason=f"HTTP {err.code}: {message}")
        return failed, None if retry_after is None else float(retry_after)
    except (OSError, RuntimeError, ValueError) as err:  # timeout, reset, no chunk
        return Outcome("lost", reason=f"{type(err).__name__}: {err}"), None
    return finished(got.final, got.ttft_s), None


def finished(final: dict, ttft_s: float | None) -> Outcome:
    """What a stream's last chunk says of the request."""
    if "error" in final:
        return Outcome("failed", ttft_s, reason=f"stream error: {final['error'].get('message')}")
    finish = (final.get("meta_info") or {}).get("finish_reason") or {}
    if finish.get("type") == "abort" and finish.get("message"):
        return Outcome("failed", ttft_s, reason=f"stream aborted: {finish['message']}")
    if finish.get("type") not in ("length", "stop"):
        return Outcome("lost", ttft_s, reason=f"stream ended without a finish: {finish}")
    pdd = (final.get("meta_info") or {}).get("pdd") or {}
    path = pdd.get("path")
    if pdd.get("resumed_on"):  # the side feeding it failed and the other finished it
        path = f"{path} resumed on {pdd['resumed_on']}"
    return Outcome("completed", ttft_s, list(final["output_ids"]), path=path)


def inject(scenario: str, tb: Testbed, pdd: PDDDeployment, fault_s: float) -> float:
    """Applies the scenario's fault; a killed server is started again after fault_s. Returns
    how long the fault lasts after this returns."""
    if scenario == "cut":
        tb.wan.cut(seconds=fault_s)
        return fault_s
    if scenario == "collapse":
        tb.wan.rate(max(tb.link.rate_mbit / 100, 0.05), seconds=2 * fault_s)
        return 2 * fault_s
    if scenario.endswith("-kill"):
        server = {"md": pdd.main, "rld": pdd.relay, "p": pdd.prefill}[scenario[: -len("-kill")]]
        assert server.process is not None
        server.process.crash()
        time.sleep(fault_s)
        server.start()
        server.wait_ready()
    return 0.0


def run_scenario(
    scenario: str,
    tb: Testbed,
    pdd: PDDDeployment,
    prompts: list[list[int]],
    outputs: list[int],
    refs: list[list[int]],
    args: argparse.Namespace,
) -> Result:
    result = Result(scenario)
    pairs = enumerate(zip(prompts, outputs, strict=True))
    trace = [TraceRequest(i, 0, 0, 0.0, len(p), 0, o) for i, (p, o) in pairs]
    done = threading.Event()
    finished = [0]
    lock = threading.Lock()
    start = time.monotonic()

    def send(req: TraceRequest) -> Outcome:
        started = time.monotonic() - start
        outcome = call(pdd.url, prompts[req.id], outputs[req.id])
        outcome.started_s = started
        with lock:
            finished[0] += 1
            if finished[0] >= len(prompts) // 3:
                done.set()
        return outcome

    def fault() -> None:
        if scenario in ("none", "overload") or not done.wait(CLIENT_TIMEOUT_S * 4):
            return
        result.fault_at_s = time.monotonic() - start
        print(f"[{scenario}] injecting the fault at {result.fault_at_s:.1f}s", flush=True)
        lasts = inject(scenario, tb, pdd, args.fault_s)
        result.fault_end_s = time.monotonic() - start + lasts
        print(f"[{scenario}] fault over at {result.fault_end_s:.1f}s", flush=True)

    injector = threading.Thread(target=fault, daemon=True)
    injector.start()
    concurrency = args.concurrency * (OVERLOAD_X if scenario == "overload" else 1)
    limit = RETRY_BUDGET_S + CLIENT_TIMEOUT_S + 30  # a send ends before, by itself
    results = replay(trace, send, concurrency=concurrency, timeout_s=limit,
                     progress_every=max(1, len(trace) // 10),
                     log=lambda line: print(f"[{scenario}] {line}", flush=True))  # fmt: skip
    injector.join(CLIENT_TIMEOUT_S * 4)
    result.wall_s = time.monotonic() - start
    for res in results:
        outcome = res.value if res.ok else Outcome("lost", reason=res.error or "no result")
        outcome.index = res.index
        result.outcomes.append(outcome)
        if outcome.kind == "completed" and outcome.output is not None:
            outcome.diverged_at = first_difference(outcome.output, refs[res.index])
        if outcome.diverged_at is not None:
            print(f"[{scenario}] request {res.index} ({outcome.path}) differs from the colocated "
                  f"output from token {outcome.diverged_at} of {len(refs[res.index])}")  # fmt: skip
    # After the fault: the deployment serves again (the router avoids or re-admits instances).
    after = call(pdd.url, prompts[0], outputs[0])
    result.recovered = after.kind == "completed" and after.output == refs[0]
    # Nothing is left behind: every server goes idle (its timeouts release what the fault
    # stranded), which a flush proves; the next scenario then starts with cold caches.
    for server in pdd.servers():
        try:
            flush_cache(server.url, RELEASE_WAIT_S)
        except (RuntimeError, OSError) as err:
            result.released = False
            print(f"[{scenario}] {server.name} still busy {RELEASE_WAIT_S:g}s later: {err}")
    return result


def table(rows: list[dict[str, object]]) -> str:
    cols = ["scenario", "sent", "completed", "failed", "lost", "wrong", "refused", "rps",
            "ttft_p99", "recovered", "released", "top_error"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "| --- " * len(cols) + "|"]
    for r in rows:
        cells = [f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("pdd.eval faults", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/tiny"))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rate-mbit", type=float, default=8.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    parser.add_argument("--fault-s", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="every server's (see above)")
    parser.add_argument("--prefills", type=int, default=1, choices=range(1, 5),
                        help="P servers behind the router; p-kill crashes the first")  # fmt: skip
    parser.add_argument("--net", default="10.231", help="the testbed's first two octets")
    parser.add_argument("--out", type=Path, default=Path("runs/faults"))
    args = parser.parse_args(argv)
    scenarios = args.scenarios.split(",")
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    exit_on_sigterm()

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts, outputs = requests_for(args.requests, vocab, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tb = Testbed("pddfault", LinkParams(args.rate_mbit, args.delay_ms), net=args.net)
    tb.down()
    tb.up()
    dtype = ("--dtype", args.dtype)
    reference = SGLangServer("colocated", args.model, free_port(), args.out, tb.placement("a"),
                             extra_args=list(dtype))  # fmt: skip
    max_active = ("--max-active", str(MAX_ACTIVE_X * args.concurrency))
    pdd = PDDDeployment.create(args.model, args.out, tb.placement("a"), tb.placement("b"),
                               server_args=dtype, router_args=max_active,
                               prefills=args.prefills)  # fmt: skip
    results: list[Result] = []
    try:
        reference.start()
        pdd.up()
        reference.wait_ready()
        print(f"reference outputs for {len(prompts)} requests (colocated server)", flush=True)
        refs = [generate(reference.url, {"input_ids": p, "sampling_params": {
            "temperature": 0, "max_new_tokens": o, "ignore_eos": True}})["output_ids"]
            for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip
        for scenario in scenarios:
            results.append(run_scenario(scenario, tb, pdd, prompts, outputs, refs, args))
            row = results[-1].row()
            print(f"{table([row])}\npaths of the completed: {row['paths']}", flush=True)
    finally:
        pdd.down()
        if reference.process is not None:
            stop_groups([reference.process.pgid])
        tb.down()

    rows = [r.row() for r in results]
    title = (f"{len(prompts)} requests at concurrency {args.concurrency}, {args.model.name} "
             f"({args.dtype}), "
             f"WAN {args.rate_mbit:g} Mbit/s, RTT {2 * args.delay_ms:g} ms, faults "
             f"{args.fault_s:g}s")  # fmt: skip
    print(f"\n{title}\n{table(rows)}")
    (args.out / "faults.md").write_text(f"# Faults under load\n\n{title}\n\n{table(rows)}\n")
    data = {"title": title, "rows": rows,
            "outcomes": {r.scenario: [asdict(o) | {"output": None} for o in r.outcomes]
                         for r in results}}  # fmt: skip
    (args.out / "faults.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_faults(results, args.out / "faults.png", title)
    print(f"wrote {args.out}/faults.md, faults.json and faults.png")
    bad = [r for r in rows if r["lost"] or r["wrong"] or not r["recovered"] or not r["released"]]
    return 1 if bad else 0
