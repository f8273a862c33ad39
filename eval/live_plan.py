"""What a live run sends: the trace at each rate, the warm-up, and KV pools sized to the trace.

Why: PDD's regime is agentic traffic at a ~90% prefix hit whose answers are long enough (hundreds
of tokens) that KV crosses the WAN while the answer is still being decoded, and a decode tier
whose cache holds the live sessions. On a 2-core CPU prompts scale down (prefill is ~1000x
slower than a GPU's), answers do not (a decode step of a small model here is the same order as a
large model's step on a GPU): see pdd.eval.workload. The KV pools of P and MD are sized against
the trace's working set, so that the decode cache holds what production's would.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.eval.trace import import_trace
from pdd.eval.workload import (
    PrefixTrie,
    TraceRequest,
    WorkloadConfig,
    draw_output,
    fresh_for,
    generate,
    system_prompts,
)

POOL_FACTOR = 2.0  # KV pool / peak working set, by default


@dataclass(frozen=True)
class TraceSpec:
    """How to get the trace: a file, or a generated agentic stream scaled to this machine."""

    path: Path | None = None
    requests: int = 40
    sessions: int | None = None  # None: sessions_for(rate)
    scale: float = 0.015
    seed: int = 0
    turn_gap_s: float = 20.0  # a session's next turn comes after its answer (and its tool)
    burst: int = 0  # low-hit requests added at once mid-trace (generated traces only)

    def config(self, rate: float) -> WorkloadConfig:
        sessions = self.sessions
        if sessions is None:
            sessions = sessions_for(rate, self.turn_gap_s)
        cfg = WorkloadConfig(seed=self.seed, requests=self.requests, sessions=sessions,
                             rate=rate, turn_gap_s=self.turn_gap_s, warm=True)  # fmt: skip
        return cfg.scaled(self.scale)


MIN_SESSIONS = 6
SESSION_HEADROOM = 1.5


def sessions_for(rate: float, turn_gap_s: float) -> int:
    """Sessions enough that the turn gap does not cap the arrival rate: n sessions whose turns
    are turn_gap_s apart offer at most n / turn_gap_s requests per second, so a fixed count
    would make a rate sweep add no load above it."""
    return max(MIN_SESSIONS, math.ceil(SESSION_HEADROOM * rate * turn_gap_s))


def trace_at(spec: TraceSpec, rate: float | None) -> list[TraceRequest]:
    """The requests to send at `rate` (mean requests per second, Poisson), on their own clock.

    Generated: the agentic stream at that rate (turns of a session at least turn_gap_s apart).
    From a file: its first `requests`, output lengths as they are; its clock rescaled to the
    mean rate, or Poisson arrivals (seeded) when it has no timestamps. `rate` None: as it is
    (a closed-loop run ignores the clock)."""
    if spec.path is None:
        cfg = spec.config(rate if rate is not None else 1.0)
        return low_hit_burst(cfg, generate(cfg), spec.burst)
    trace = import_trace(spec.path)[: spec.requests]
    if rate is None or not trace:
        return trace
    duration = trace[-1].arrival_s - trace[0].arrival_s
    if duration > 0 and len(trace) > 1:
        k = (len(trace) - 1) / (rate * duration)
        return [replace(r, arrival_s=(r.arrival_s - trace[0].arrival_s) * k) for r in trace]
    rng, t, out = random.Random(spec.seed), 0.0, []
    for r in trace:
        out.append(replace(r, arrival_s=t))
        t += rng.expovariate(rate)
    return out


def low_hit_burst(cfg: WorkloadConfig, trace: Sequence[TraceRequest], n: int,
                  gap_s: float = 0.5) -> list[TraceRequest]:  # fmt: skip
    """`trace` with `n` low-hit requests added at its midpoint, `gap_s` apart: each a new
    session's shared system prompt + a fresh document sized for a hit in cfg.low_hit, with an
    agentic answer. The failure the router's RLD guard exists for (DESIGN.md: low-hit traffic
    kept on a small RLD overloads it). Ids renumbered in arrival order; hits measured again."""
    if n <= 0:
        return list(trace)
    rng = random.Random(cfg.seed + 7919)  # its own stream: the trace itself is unchanged
    systems = [r.segments[0] for r in system_prompts(cfg) if r.segments]
    at = trace[len(trace) // 2].arrival_s if trace else 0.0
    first_session = 1 + max((r.session for r in trace), default=-1)
    doc_seeds = ((cfg.seed + 1) << 32) + (1 << 31)  # beyond any seed the generator draws
    added = []
    for k in range(n):
        system = rng.choice(systems)
        doc = max(cfg.min_insert_tokens, fresh_for(system[1], rng.uniform(*cfg.low_hit)))
        doc = min(doc, cfg.max_context - system[1])
        segments = (system, (doc_seeds + k, doc))
        added.append(TraceRequest(-1, first_session + k, 0, round(at + k * gap_s, 6),
                                  system[1] + doc, 0, draw_output(cfg, rng),
                                  segments=segments))  # fmt: skip
    merged = sorted([*trace, *added], key=lambda r: r.arrival_s)
    trie = PrefixTrie()
    if cfg.warm:
        for system in systems:
            trie.insert([system])
    out = []
    for i, r in enumerate(merged):
        cached = r.cached_tokens
        if r.segments is not None:
            cached = trie.match(r.segments)
            trie.insert(r.segments)
        out.append(replace(r, id=i, cached_tokens=cached))
    return out


def warmup(spec: TraceSpec) -> list[TraceRequest]:
    """Sent before each pass (1 output token each): the shared system prompts, cached in
    steady state; the generated trace counts them as cached. None for a file."""
    return [] if spec.path is not None else system_prompts(spec.config(1.0))


def working_set(trace: list[TraceRequest], max_new: int | None = None) -> int:
    """Peak over arrivals of the live sessions' context tokens (latest prompt + its answer,
    capped at `max_new`).

    A session is live from its first request to its last one in the trace; a request without
    a session of its own (singular) counts at its arrival."""
    last = {r.session: i for i, r in enumerate(trace)}
    live: dict[int, int] = {}
    peak = 0
    for i, r in enumerate(trace):
        live[r.session] = r.prompt_tokens + min(r.output_tokens, max_new or r.output_tokens)
        peak = max(peak, sum(live.values()))
        if last[r.session] == i:
            del live[r.session]
    return peak


def pool_tokens(traces: list[list[TraceRequest]], max_new: int, factor: float = POOL_FACTOR
                ) -> tuple[int, int]:  # fmt: skip
    """(KV pool tokens for P and MD, peak working set): `factor` x the largest working set of
    the traces, and at least twice the longest request (prompt + answer) so one always fits."""
    peak = max(working_set(t, max_new) for t in traces)
    longest = max(r.prompt_tokens + min(r.output_tokens, max_new) for t in traces for r in t)
    return max(round(factor * peak), 2 * longest, 1024), peak


def tier_cpus(relay_fraction: float) -> dict[str, str]:
    """CPUs per server role (`PDDDeployment.create`'s server_cpus) giving each tier chips of
    its own, as production does: P on the first half of this machine's CPUs, the decoders on
    the other half. Unpinned, MD's steps and P's prefills would take turns on every core, which
    servers in two datacenters never do. A small RLD sits with P in datacenter A (production
    gives it chips of its own, so this can only slow PDD down); a decoder as large as MD (same-DC
    PD's, `relay_fraction` 1) gets the decoders' half. Empty with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    half = len(cpus) // 2
    first, second = (",".join(str(c) for c in part) for part in (cpus[:half], cpus[half:]))
    return {"prefill": first, "relay": first if relay_fraction < 1 else second, "main": second}
