"""One deployment's pass over one rate's trace in a live run (pdd.eval.live): every cache
flushed but the system prompts', then the trace replayed through the deployment's router, with
the WAN bytes and the CPU each part used over the pass."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pdd.eval.client import flush_cache, router_sees_flush, stream_generate
from pdd.eval.cpu import cpu_by_part
from pdd.eval.live_report import Outputs
from pdd.eval.replay import replay
from pdd.eval.report import Record, Run
from pdd.eval.workload import TraceRequest
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.router import RouterService
from pdd.launch.testbed import Testbed

REQUEST_TIMEOUT_S = 600.0
WARM_PATIENCE_S = 60.0  # how long a pass's warm-up waits out 503s (Retry-After)


@dataclass
class Pace:
    """One rate's requests (rate None: closed loop at concurrency)."""

    rate: float | None
    trace: list[TraceRequest]
    prompts: list[list[int]]


def request_body(ids: list[int], max_new: int, path: str | None) -> dict:
    """Greedy, exactly `max_new` tokens (EOS ignored), on `path` (None: the router's choice)."""
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    body: dict = {"input_ids": ids, "sampling_params": sampling}
    if path is not None:
        body["pdd_path"] = path
    return body


def pass_parts(pdd: PDDDeployment, router: RouterService) -> dict[str, int]:
    """The process groups whose CPU a pass reports: the servers and the pass's router."""
    tiers = {"P": pdd.prefill, "RLD": pdd.relay, "MD": pdd.main, "router": router}
    return {name: p.process.pgid for name, p in tiers.items() if p.process is not None}


def run_pass(name: str, path: str | None, router: RouterService, pdd: PDDDeployment,
             tb: Testbed, pace: Pace, warm: list[list[int]], max_new: int,
             concurrency: int | None) -> tuple[Run, Outputs]:  # fmt: skip
    """Deployment `name`'s pass over one rate's trace, through `router`, each request asking
    for `path` (None: the router's choice): records and each request's output ids."""
    url = router.url
    trace, prompts = pace.trace, pace.prompts
    outputs: Outputs = [None] * len(trace)
    index = {req.id: i for i, req in enumerate(trace)}

    def send(req: TraceRequest) -> Record:
        i = index[req.id]
        body = request_body(prompts[i], min(req.output_tokens, max_new), path)
        got = stream_generate(url, body, timeout=REQUEST_TIMEOUT_S)
        final = got.final
        meta = final["meta_info"].get("pdd") or {}
        outputs[i] = list(final["output_ids"])
        return Record(len(prompts[i]), req.cached_tokens, None, len(final["output_ids"]),
                      got.ttft_s, got.total_s, meta.get("path"), meta.get("relay_tokens") or 0,
                      meta.get("wan_kv_bytes") or 0, path_reason=meta.get("path_reason"),
                      main_tokens=meta.get("main_tokens") or 0,
                      handoff_mode=meta.get("handoff_mode"))  # fmt: skip

    for server in pdd.servers():  # each deployment's pass starts cold ...
        flush_cache(server.url)
    router_sees_flush(url)
    for ids in warm:  # ... but for the system prompts, cached in steady state
        body = request_body(ids, 1, "relay" if path == "relay" else "main")
        # A pass's outset must not end a run of many passes: an instance the router has just
        # taken for down (until its next health check) gets its Retry-After.
        stream_generate(url, body, timeout=REQUEST_TIMEOUT_S, patience_s=WARM_PATIENCE_S)
    parts = pass_parts(pdd, router)
    wan = tb.wan.status()
    before, cpu_before = int(wan["counters"]["a_to_b"]["bytes"]), cpu_by_part(parts)
    cpu_before["WAN"] = wan["cpu_s"]  # the emulator's packet forwarding, the link's cost here
    start = time.monotonic()
    loop = {"concurrency": concurrency} if pace.rate is None else {"speed": 1.0}
    label = name if pace.rate is None else f"{name} @ {pace.rate:g}/s"
    results = replay(trace, send, **loop, timeout_s=REQUEST_TIMEOUT_S, progress_every=5,
                     log=lambda line: print(f"[{label}] {line}", flush=True))  # fmt: skip
    run = Run(name, wall_s=time.monotonic() - start)
    wan = tb.wan.status()
    run.wan_link_bytes = int(wan["counters"]["a_to_b"]["bytes"]) - before
    cpu = {**cpu_by_part(parts), "WAN": wan["cpu_s"]}
    run.cores = {k: (cpu[k] - cpu_before[k]) / max(run.wall_s, 1e-9) for k in cpu}
    for res, req in zip(results, trace, strict=True):
        if res.ok:
            run.records.append(replace(res.value, start_s=res.start_s))
        else:
            run.records.append(Record(req.prompt_tokens, req.cached_tokens, res.start_s,
                                      error=res.error))  # fmt: skip
            print(f"[{label}] request {req.id} FAILED: {res.error}", flush=True)
    return run, outputs
