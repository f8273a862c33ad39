"""The simulator checked against a live run: fit its step costs to `pdd.eval live`'s same-DC
pass, replay every deployment's requests through the simulated testbed, and compare.

Why fit rather than use chip specs: the testbed runs P, RLD and MD on one 2-core CPU, far from
any roofline, so its costs can only come from measurement. The fit, from the same-DC records:
- prefill: TTFT = overhead + seconds/token x uncached tokens (prompt - cached), least squares.
  The overhead is everything a same-DC request pays besides prefill compute (HTTP, scheduling,
  the local KV transfer, the first token); the simulated P pays it once per prefill forward,
  and the simulated local transfer costs nothing (it is inside the fit);
- decode: one step = the median same-DC TPOT, whatever the batch and context.
The simulated testbed is 1 P, 1 RLD and 1 MD (same-DC: 1 P + 1 D) with those costs, the live
link (line rate, RTT = 2 x one-way delay, no jitter, one flow can fill the line) and the model's
KV bytes per token. The simulator is open loop: each deployment's requests arrive when the live
run sent them (a closed-loop live run paces these by its own latencies). Measured and predicted
metrics come from the same code (`pdd.eval.report.Run.summary`) on per-request records.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pdd.eval.report import Record, Run
from pdd.eval.report import Sla as LiveSla
from pdd.eval.sim.config import ClusterConfig, Tier
from pdd.eval.sim.costs import StepCosts, prediction_error
from pdd.eval.sim.hardware import CHIP_A, Link, Model
from pdd.eval.sim.requests import SimRequest
from pdd.eval.sim.results import RequestResult
from pdd.eval.sim.simulation import simulate
from pdd.policy.path import PathPolicy

SAME_DC = "same-DC PD"
KINDS = {  # live deployment -> simulated kind
    SAME_DC: "same-dc",
    "naive cross-DC PD": "naive",
    "cross-DC PD + decode cache": "cache",
    "PDD": "pdd",
}
PATHS = {"main": "P->MD", "relay": "P->RLD", "pdd": "P->RLD->MD"}  # simulated -> live names
LATENCY = [f"{m}_p{q}" for m in ("ttft", "tpot", "e2e") for q in (50, 90, 99)]
NEVER_BINDS = 1e30  # compute, bandwidth or RDMA rate that never limits a step


@dataclass(frozen=True)
class Fit:
    """Step costs fitted to the same-DC pass."""

    overhead_s: float  # TTFT intercept
    prefill_s_per_token: float  # TTFT slope per uncached token
    r2: float
    requests: int  # same-DC records the prefill line was fitted to
    decode_step_s: float  # median same-DC TPOT
    decode_requests: int  # records with >= 2 output tokens

    def prefill_costs(self, model: Model) -> StepCosts:
        """A P whose forward over n new tokens takes overhead + n x seconds/token."""
        return StepCosts(
            model,
            flops_s=model.flops(1, 0) / self.prefill_s_per_token,
            bytes_s=NEVER_BINDS,
            overhead_s=self.overhead_s,
            send_bytes_s=NEVER_BINDS,
        )

    def decode_costs(self, model: Model) -> StepCosts:
        """A decode instance whose every step takes decode_step_s."""
        return StepCosts(
            model,
            flops_s=NEVER_BINDS,
            bytes_s=NEVER_BINDS,
            overhead_s=self.decode_step_s,
            send_bytes_s=NEVER_BINDS,
        )

    def describe(self) -> str:
        return (
            f"TTFT = {self.overhead_s * 1e3:.1f} ms + {self.prefill_s_per_token * 1e3:.3f} ms x "
            f"uncached tokens (least squares over {self.requests} same-DC requests, "
            f"R^2 = {self.r2:.3f}); decode step = median same-DC TPOT = "
            f"{self.decode_step_s * 1e3:.1f} ms ({self.decode_requests} requests)"
        )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, R^2)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need at least two points to fit a line")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("every request has the same uncached length: the slope is unknown")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    syy = sum((y - my) ** 2 for y in ys)
    resid = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1.0 - resid / syy if syy > 0 else 1.0


def fit(records: Sequence[Record]) -> Fit:
    """Prefill and decode costs from same-DC records (see the module docstring)."""
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    xs = [float(r.prompt_tokens - r.cached_tokens) for r in ok]
    a, b, r2 = fit_line(xs, [r.ttft_s for r in ok if r.ttft_s is not None])
    if b <= 0:
        raise ValueError(f"TTFT does not grow with uncached tokens (slope {b:.3g} s/token)")
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    if not tpots:
        raise ValueError("no same-DC request with two or more output tokens: no decode step")
    return Fit(max(a, 0.0), b, r2, len(ok), statistics.median(tpots), len(tpots))


def testbed_model(live: Mapping[str, Any]) -> Model:
    """The live model as the simulator needs it: only its KV per token matters (the fitted
    costs carry the compute)."""
    m = live.get("model", {})
    return Model(str(m.get("name", "live")), 1.0, 1.0, float(m["kv_bytes_per_token"]))


def testbed_link(live: Mapping[str, Any]) -> Link:
    link = live["link"]
    return Link(gbit_s=float(link["rate_mbit"]) / 1000, rtt_ms=2 * float(link["delay_ms"]))


def testbed_config(kind: str, f: Fit, model: Model, link: Link,
                   live: Mapping[str, Any] | None = None) -> ClusterConfig:  # fmt: skip
    """The testbed: 1 P and 1 MD (same-DC: D), plus 1 RLD for PDD, costing what `f` says, with
    the live run's decode slots (each server's max running requests) and TTFT SLA."""
    cap = (live or {}).get("capacity", {})
    p = Tier(CHIP_A, 1, 1, costs=f.prefill_costs(model))
    d = Tier(CHIP_A, 1, 1, int(cap.get("main", 128)), costs=f.decode_costs(model))
    relay = Tier(CHIP_A, 1, 1, int(cap.get("relay", 128)), costs=f.decode_costs(model))
    policy = PathPolicy(ttft_sla_s=live_sla(live or {}).ttft_s)
    return ClusterConfig(kind, p, d, relay if kind == "pdd" else None, model, link,
                         path_policy=policy, rdma_latency_s=0.0)  # fmt: skip


def live_sla(live: Mapping[str, Any]) -> LiveSla:
    args = live.get("args", {})
    return LiveSla(float(args.get("ttft_sla", 3.0)), float(args.get("tpot_sla", 0.5)))


def records(live: Mapping[str, Any], name: str) -> list[Record]:
    known = {f.name for f in fields(Record)}
    return [Record(**{k: v for k, v in r.items() if k in known}) for r in live["runs"][name]]


def sim_requests(recs: Sequence[Record]) -> list[SimRequest]:
    """The requests a live pass completed, arriving when it sent them."""
    out = []
    for r in recs:
        if r.ok and r.start_s is not None and r.output_tokens >= 1:
            cached = min(r.cached_tokens, r.prompt_tokens)
            out.append(SimRequest(r.start_s, r.prompt_tokens, cached, r.output_tokens))
    return out


def as_record(r: RequestResult, kind: str) -> Record:
    """A simulated request as the live harness records one. Relay tokens count token 0 when RLD
    streamed it, as the router does (the simulator credits token 0 to P)."""
    relay = r.tokens.get("RLD", 0)
    relay += 1 if r.path == "relay" or relay > 0 else 0
    path = "P->D" if kind == "same-dc" else PATHS[r.path]
    return Record(
        r.prompt_tokens, r.cached_tokens, r.arrival_s, r.output_tokens, r.ttft_s, r.e2e_s,
        path, relay, int(r.wan_bytes),
    )  # fmt: skip


def compared(kind: str) -> list[str]:
    """Metrics compared for a kind: latency everywhere, WAN bytes for cross-DC kinds, RLD's
    share of the output for PDD (same-DC's decoder is RLD live, D simulated). WAN bytes live are
    the link's own A -> B counter (KV and control messages): the router reports a request's KV
    bytes only on P->RLD->MD (from MD's READY), so its per-request figure would miss P->MD."""
    extra = [] if kind == "same-dc" else ["wan_mb_per_request"]
    return LATENCY + extra + (["rld_share"] if kind == "pdd" else [])


@dataclass
class Row:
    deployment: str
    metric: str
    measured: float
    predicted: float
    error: float  # (predicted - measured) / measured


@dataclass
class Calibration:
    fit: Fit
    rows: list[Row]
    paths: dict[str, dict[str, dict[str, int]]]  # deployment -> measured/predicted -> counts
    notes: list[str] = field(default_factory=list)

    @property
    def median_abs_error(self) -> float:
        errs = [abs(r.error) for r in self.rows if math.isfinite(r.error)]
        return statistics.median(errs) if errs else math.nan

    def table(self) -> str:
        lines = [
            "| deployment | metric | measured | predicted | rel. error |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            err = f"{r.error:+.1%}" if math.isfinite(r.error) else "n/a"
            lines.append(
                f"| {r.deployment} | {r.metric} | {r.measured:.4g} | {r.predicted:.4g} | {err} |"
            )
        return "\n".join(lines)

    def markdown(self) -> str:
        paths = [
            f"- {name}: measured {_counts(p['measured'])}; predicted {_counts(p['predicted'])}"
            for name, p in self.paths.items()
        ]
        return "\n".join([
            "# Simulator vs live run", "",
            "## Fit", "", self.fit.describe() + ".", "", *[f"- {n}" for n in self.notes], "",
            "## Predicted vs measured", "", self.table(), "",
            f"Median absolute relative error: {self.median_abs_error:.1%} "
            f"over {sum(math.isfinite(r.error) for r in self.rows)} metrics.", "",
            "Paths:", *paths, "",
        ])  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "fit": asdict(self.fit),
            "fit_text": self.fit.describe(),
            "notes": self.notes,
            "rows": [asdict(r) for r in self.rows],
            "median_abs_error": self.median_abs_error,
            "paths": self.paths,
        }


def _counts(c: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"


def _paths(recs: Sequence[Record]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r.ok and r.path:
            out[r.path] = out.get(r.path, 0) + 1
    return out


def calibrate(live: Mapping[str, Any]) -> Calibration:
    """Fit on the same-DC pass of a live.json document, simulate every pass, compare."""
    runs = live.get("runs", {})
    if SAME_DC not in runs:
        raise ValueError(f"the live run has no {SAME_DC!r} pass to fit the step costs to")
    f = fit(records(live, SAME_DC))
    model, link, sla = testbed_model(live), testbed_link(live), live_sla(live)
    args = live.get("args", {})
    pace = (
        f"open loop at {args['rate']} req/s"
        if args.get("rate") not in (None, "None")
        else f"closed loop at concurrency {args.get('concurrency', '?')}"
    )
    notes = [
        f"testbed: 1 P, 1 RLD, 1 MD; WAN {link.gbit_s * 1000:g} Mbit/s, RTT {link.rtt_ms:g} ms; "
        f"{model.name}: {model.kv_bytes_per_token:.0f} KV bytes/token",
        f"the live run was {pace}; the simulator replays each pass's send times as arrivals "
        "(open loop)",
        "P's fitted overhead is paid once per prefill forward (batched requests share it); the "
        "local KV transfer is inside the fit; the decode step does not grow with batch or context",
        "MD's prefix hit = the trace's cached tokens (decode cache) or 0 (naive); PDD uses the "
        "default path and handoff policies",
        "WAN MB/request: measured by the link's A -> B byte counter (KV plus control messages), "
        "predicted as the KV the simulator sends",
    ]
    rows: list[Row] = []
    paths: dict[str, dict[str, dict[str, int]]] = {}
    for name, kind in KINDS.items():
        if name not in runs:
            continue
        recs = records(live, name)
        reqs = sim_requests(recs)
        if not reqs:
            notes.append(f"{name}: no completed request to replay")
            continue
        if len(reqs) < len(recs):
            notes.append(f"{name}: {len(recs) - len(reqs)} failed requests not replayed")
        res = simulate(reqs, testbed_config(kind, f, model, link, live))
        sim_recs = [as_record(r, kind) for r in res.results]
        wan = int(sum(r.wan_bytes for r in res.results))
        predicted = Run(name, sim_recs, res.summary.duration_s, wan).summary(sla)
        measured = {**Run(name, recs).summary(sla), **live.get("summaries", {}).get(name, {})}
        metrics = compared(kind)
        errors = prediction_error(
            {m: predicted[m] for m in metrics}, {m: measured[m] for m in metrics}
        )
        rows += [Row(name, m, measured[m], predicted[m], errors[m]) for m in metrics]
        paths[name] = {"measured": _paths(recs), "predicted": _paths(sim_recs)}
    return Calibration(f, rows, paths, notes)


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc
