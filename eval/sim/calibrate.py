"""The simulator checked against a live run: fit its step costs to `pdd.eval live`'s records
(`fit`), replay every deployment's requests through the simulated testbed, and compare.

The simulated testbed is 1 P, 1 RLD and 1 MD (same-DC: 1 P + 1 D) with the fitted costs, each
decoder's slots as its server reported them (RLD's capacity is also what the router's path
policy reads, as live), the live link (line rate, RTT = 2 x one-way delay, no jitter; a
request's KV ramping as fitted) and the model's KV bytes per token. The simulated router
routes by the live router's first-token target and path policy (`testbed_config`) and starts
knowing nothing, as live. The simulator is open loop: each deployment's requests arrive when
the live run sent them (a closed-loop live run paces these by its own latencies), with the
prompt, P-side hit, output length and MD's hit that the live run had (`md_hits`). Measured and
predicted metrics come from the same code (`pdd.eval.report.Run.summary`) on per-request
records.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdd.eval.live_criteria import NO_GUARD
from pdd.eval.report import Record, Run
from pdd.eval.report import Sla as LiveSla
from pdd.eval.sim.config import ClusterConfig, Tier
from pdd.eval.sim.costs import StepCosts, prediction_error
from pdd.eval.sim.fit import PrefillFit, StepFit, WanFit, fit_prefill, fit_step, fit_wan
from pdd.eval.sim.hardware import CHIP_A, Link, Model
from pdd.eval.sim.requests import SimRequest
from pdd.eval.sim.results import RequestResult
from pdd.eval.sim.simulation import simulate
from pdd.policy.handoff import HandoffPolicy
from pdd.policy.path import PathPolicy

SAME_DC = "same-DC PD"
KINDS = {  # live deployment -> simulated kind, handoff mode (the live run's), capacity group
    SAME_DC: ("same-dc", "extend", "same-dc"),
    "naive cross-DC PD": ("naive", "extend", "same-dc"),  # on same-DC PD's servers
    "cross-DC PD + decode cache": ("cache", "extend", "pdd"),
    "PDD": ("pdd", "extend", "pdd"),
    "PDD catch-up": ("pdd", "catchup", "pdd-catchup"),
    NO_GUARD: ("pdd", "extend", "pdd"),  # its router ran with --no-relay-guard
}
PATHS = {"main": "P->MD", "relay": "P->RLD", "pdd": "P->RLD->MD"}  # simulated -> live names
LATENCY = [f"{m}_p{q}" for m in ("ttft", "tpot", "e2e") for q in (50, 90, 99)]
NEVER_BINDS = 1e30  # compute, bandwidth or RDMA rate that never limits a step
NO_SINGULAR_LIMIT = 1 << 30  # PathPolicy.singular_max_new of a router without the limit


def _rate(kv_bytes_per_token: float, s_per_token: float) -> float:
    return kv_bytes_per_token / s_per_token if s_per_token > 0 else NEVER_BINDS


@dataclass(frozen=True)
class Fit:
    """The testbed's costs (`pdd.eval.sim.fit`)."""

    prefill: PrefillFit
    step: StepFit
    wan: WanFit | None  # None: no P->MD request to fit it to

    def prefill_costs(self, model: Model) -> StepCosts:
        """A P whose forward over n new tokens after c cached ones takes overhead + n x s/token
        (compute) + (n + c) x s/token (KV read), one after the other."""
        return StepCosts(
            model,
            flops_s=model.flops(1, 0) / self.prefill.s_per_uncached,
            bytes_s=_rate(model.kv_bytes_per_token, self.prefill.s_per_prompt),
            overhead_s=self.prefill.overhead_s,
            send_bytes_s=NEVER_BINDS,
            overlap=False,
        )

    def decode_costs(self, model: Model) -> StepCosts:
        """A decoder whose step takes overhead + s/request x batch + s/token x context."""
        return StepCosts(
            model,
            flops_s=NEVER_BINDS,
            bytes_s=_rate(model.kv_bytes_per_token, self.step.per_token_s),
            overhead_s=self.step.overhead_s,
            send_bytes_s=NEVER_BINDS,
            per_request_s=self.step.per_request_s,
        )

    def describe(self) -> str:
        p, d, w = self.prefill, self.step, self.wan
        text = (
            f"same-DC TTFT = {p.overhead_s * 1e3:.1f} ms + {p.s_per_uncached * 1e3:.3f} ms x "
            f"uncached tokens + {p.s_per_prompt * 1e3:.3f} ms x prompt tokens + "
            f"{p.shared_host_s * 1e3:.1f} ms x requests decoding meanwhile ({p.requests} "
            f"requests, R^2 = {p.r2:.3f}); decode step = {d.overhead_s * 1e3:.2f} ms + "
            f"{d.per_request_s * 1e3:.2f} ms x batch + {d.per_token_s * 1e6:.2f} us x context "
            f"tokens (same-DC TPOTs of {d.requests} requests, R^2 = {d.r2:.3f})"
        )
        if w is not None:
            text += (
                f"; P->MD: MD's bootstrap {w.bootstrap_s * 1e3:.0f} ms, a request's KV ramping "
                f"as {w.flows:.1f} TCP flows from idle ({w.requests} P->MD first tokens, "
                f"R^2 = {w.r2:.3f})"
            )
        return text


def fit(live: Mapping[str, Any]) -> Fit:
    """Every cost from the live run's records (see pdd.eval.sim.fit)."""
    same = records(live, SAME_DC)
    prefill, step = fit_prefill(same), fit_step(same)
    cross = [records(live, name) for name in live["runs"] if name != SAME_DC]
    kvb = float(live["model"]["kv_bytes_per_token"])
    wan = fit_wan(cross, prefill, testbed_link(live), kvb)
    return Fit(prefill, step, wan)


def testbed_model(live: Mapping[str, Any]) -> Model:
    """The live model as the simulator needs it: only its KV per token matters (the fitted
    costs carry the compute)."""
    m = live.get("model", {})
    return Model(str(m.get("name", "live")), 1.0, 1.0, float(m["kv_bytes_per_token"]))


def testbed_link(live: Mapping[str, Any], f: Fit | None = None) -> Link:
    """The live link; a request's KV ramps as the fitted flows up to the line."""
    link = live["link"]
    flows = f.wan.flows if f is not None and f.wan is not None else None
    return Link(float(link["rate_mbit"]) / 1000, 2 * float(link["delay_ms"]), ramp_flows=flows)


def testbed_config(name: str, f: Fit, model: Model, link: Link,
                   live: Mapping[str, Any] | None = None) -> ClusterConfig:  # fmt: skip
    """The testbed for live deployment `name`: 1 P and 1 MD (same-DC: D), plus 1 RLD for PDD,
    costing what `f` says, with the live run's decode slots (each server's max running
    requests), RLD's KV pool and reservation (what RLD admits and the router's guard reads),
    handoff mode, the first-token target its router routed by, and its RLD guard on or off."""
    live = live or {}
    kind, mode, group = KINDS[name]
    cap = live.get("capacity_by_group", {}).get(group) or live.get("capacity", {})
    p = Tier(CHIP_A, 1, 1, costs=f.prefill_costs(model))
    d = Tier(CHIP_A, 1, 1, int(cap.get("main", 128)), costs=f.decode_costs(model))
    relay_costs = f.decode_costs(model)
    if cap.get("relay_kv_pool"):  # runs before RLD's pool was recorded: unbounded
        relay_costs = replace(relay_costs, kv_capacity_tokens=int(cap["relay_kv_pool"]))
    relay = Tier(CHIP_A, 1, 1, int(cap.get("relay", 128)), costs=relay_costs)
    args = live.get("args", {})
    route = float(args.get("route_ttft", live_sla(live).ttft_s))
    # A run that does not record the router's --singular-max-new predates it (4d1ec30): its
    # router kept any answer RLD would finish first on RLD alone, however long.
    singular = int(args.get("singular_max_new", NO_SINGULAR_LIMIT))
    # The live router's first-token residual shows in its estimates; runs without it had none.
    estimates = live.get("router_estimates", {}).get(name, {})
    return ClusterConfig(
        kind, p, d, relay if kind == "pdd" else None, model, link,
        path_policy=PathPolicy(ttft_sla_s=route, singular_max_new=singular,
                               guard=name != NO_GUARD),
        handoff=HandoffPolicy(mode=mode),
        rdma_latency_s=0.0, md_bootstrap_s=f.wan.bootstrap_s if f.wan is not None else 0.0,
        shared_host_s=f.prefill.shared_host_s,
        first_token_extra="first_token_extra_s" in estimates, warm_estimates=False,
        decode_reserve_tokens=int(cap.get("relay_kv_reserve") or 0),
    )  # fmt: skip


def live_sla(live: Mapping[str, Any]) -> LiveSla:
    args = live.get("args", {})
    return LiveSla(float(args.get("ttft_sla", 3.0)), float(args.get("tpot_sla", 0.5)))


def records(live: Mapping[str, Any], name: str) -> list[Record]:
    known = {f.name for f in fields(Record)}
    return [Record(**{k: v for k, v in r.items() if k in known}) for r in live["runs"][name]]


def sim_requests(recs: Sequence[Record], kv_bytes_per_token: float) -> list[SimRequest]:
    """The requests a live pass completed, arriving when it sent them, with MD's hit
    (`md_hits`)."""
    out = []
    ok = [r for r in recs if r.ok and r.start_s is not None and r.output_tokens >= 1]
    ok.sort(key=lambda r: r.start_s or 0.0)
    for r, md in zip(ok, md_hits(ok, kv_bytes_per_token), strict=True):
        cached = min(r.cached_tokens, r.prompt_tokens)
        out.append(SimRequest(r.start_s or 0.0, r.prompt_tokens, cached, r.output_tokens, md))
    return out


def md_hits(recs: Sequence[Record], kv_bytes_per_token: float) -> list[int | None]:
    """MD's prefix hit for each of one pass's requests (in order of sending). Where KV crossed,
    what MD was not sent. Where RLD answered alone, MD was sent nothing, so it holds only what
    it held of the turn this one continues (the latest earlier request whose prompt is this
    one's P-side hit), not P's hit: a session kept on RLD is not on MD. None (the simulator's
    model): neither is known."""
    held: list[tuple[int, int]] = []  # (prompt tokens, of which MD holds) per earlier request
    out: list[int | None] = []
    for r in recs:
        md: int | None = None
        if r.wan_kv_bytes > 0:
            md = max(0, r.prompt_tokens - round(r.wan_kv_bytes / kv_bytes_per_token))
        elif r.path == PATHS["relay"]:
            prev = [h for p, h in held if p == r.cached_tokens]
            md = min(prev[-1], r.cached_tokens) if prev else None
        out.append(md)
        fed = r.wan_kv_bytes > 0 or r.path != PATHS["relay"]  # MD got the whole prompt
        held.append((r.prompt_tokens, r.prompt_tokens if fed else md or 0))
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

    def path_mix_points(self, name: str) -> float:
        """The largest difference, in percentage points, between a path's measured and
        predicted shares of deployment `name`'s requests."""
        p = self.paths[name]
        shares = [{k: v / max(sum(c.values()), 1) for k, v in c.items()}
                  for c in (p["measured"], p["predicted"])]  # fmt: skip
        keys = set(shares[0]) | set(shares[1])
        return max((abs(shares[0].get(k, 0) - shares[1].get(k, 0)) * 100 for k in keys),
                   default=0.0)  # fmt: skip

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
            + (f" (within {self.path_mix_points(name):.0f} points)" if name != SAME_DC else "")
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
            "path_mix_points": {n: self.path_mix_points(n) for n in self.paths if n != SAME_DC},
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
    """Fit to a live.json document, simulate every pass, compare."""
    runs = live.get("runs", {})
    if SAME_DC not in runs:
        raise ValueError(f"the live run has no {SAME_DC!r} pass to fit the step costs to")
    f = fit(live)
    model, link, sla = testbed_model(live), testbed_link(live, f), live_sla(live)
    args = live.get("args", {})
    pace = (
        f"open loop at {args['rate']} req/s"
        if args.get("rate") not in (None, "None")
        else f"closed loop at concurrency {args.get('concurrency', '?')}"
    )
    notes = [
        f"testbed: 1 P, 1 RLD, 1 MD; WAN {link.gbit_s * 1000:g} Mbit/s, RTT {link.rtt_ms:g} ms, "
        f"a request's KV ramping as {link.ramp_flows or 0:.1f} TCP flows after idle (their "
        f"first windows, a segment more each round trip); {model.name}: "
        f"{model.kv_bytes_per_token:.0f} KV bytes/token",
        f"the live run was {pace}; the simulator replays each pass's send times as arrivals "
        "(open loop)",
        "P's fitted overhead is paid once per prefill forward (batched requests share it); the "
        "decode step grows with the batch and its context; a P->MD request waits for MD's "
        "bootstrap before P takes it (on P->RLD->MD, the second request to P that feeds MD "
        "waits for it); a first token comes later by the fitted cost per request decoding at "
        "the time (one CPU for every server)",
        "MD's prefix hit = what MD was not sent live where KV crossed; on a turn RLD answered "
        "alone, what MD held of the turn it continues; else the trace's cached tokens (decode "
        "cache) or 0 (naive); PDD routes by the live router's first-token target "
        f"({args.get('route_ttft', args.get('ttft_sla', '3.0'))} s) and RLD-alone limit "
        f"({args.get('singular_max_new', 'none: the run predates it')}) with the live handoff "
        f"mode, seeing cached prefixes in {ClusterConfig.cache_block}-token blocks as the router "
        "does; it adds P->MD's first-token residual only where the live run's estimates show "
        "one (first_token_extra_s)",
        "WAN MB/request: measured by the link's A -> B byte counter (KV plus control messages), "
        "predicted as the KV the simulator sends",
    ]
    rows: list[Row] = []
    paths: dict[str, dict[str, dict[str, int]]] = {}
    for name, (kind, _, _) in KINDS.items():
        if name not in runs:
            continue
        recs = records(live, name)
        reqs = sim_requests(recs, model.kv_bytes_per_token)
        if not reqs:
            notes.append(f"{name}: no completed request to replay")
            continue
        if len(reqs) < len(recs):
            notes.append(f"{name}: {len(recs) - len(reqs)} failed requests not replayed")
        res = simulate(reqs, testbed_config(name, f, model, link, live))
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
