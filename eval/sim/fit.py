"""The testbed's costs, fitted to a live run's per-request records (`pdd.eval live`'s live.json).

Why fit rather than use chip specs: the testbed runs P, RLD and MD on one small CPU, far from any
roofline, so its costs can only come from measurement. Three fits, each least squares with
non-negative coefficients:
- P, from same-DC first tokens: TTFT = overhead + s/token x uncached tokens + s/token x prompt
  tokens + s/request x requests decoding meanwhile (time-averaged over the wait, from the other
  records' first-token and end times). The simulated P pays the overhead once per forward, the
  first term as compute and the second as KV read, one after the other (a CPU); the last delays
  a first token per request decoding on any server when it is sent (they share the CPU);
- the decode step, from same-DC TPOTs: step = overhead + s/request x batch + s/token x context,
  the form of `costs.StepCosts` with compute never binding. A request's TPOT is the mean step
  over its decode, so it is fitted against the batch and context its steps saw: the requests
  decoding beside it (from every record's first-token and end times), their context growing a
  token a step, averaged over its steps (refitted twice, each time weighing an instant by the
  steps the last fit makes there);
- MD's bootstrap and how a request's KV crosses, from P->MD first tokens of cross-DC passes:
  TTFT - P's fitted part - two one-way delays (the KV's last byte, the first token's way
  back) = bootstrap + the KV's time alone on the link, which ramps like TCP after idle
  (`hardware.Link.ramp_flows`: the flows' first windows, a segment more per flow each round
  trip, up to the line). Live, a request's rate grows with its size (a few MB: 25-45 Mbit/s,
  tens of MB: 60-100 Mbit/s of the 100), which one fixed rate cannot follow. The flows are
  searched, the bootstrap is the weighted mean rest; weighted by 1 / TTFT^2, so that it
  minimises relative errors, as the comparison counts them (a few large transfers would
  otherwise decide it alone).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdd.eval.report import Record
from pdd.eval.sim.hardware import Link

FLOWS = (0.25, 64.0)  # the range searched for a request's TCP flows


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float],
                  weights: Sequence[float] | None = None) -> tuple[list[float], float]:  # fmt: skip
    """Weighted least squares y ~ row . coef with every coefficient >= 0 (the best of all
    subsets of free coefficients, the others 0: exact for a few unknowns): (coef, R^2)."""
    if not rows or len(rows) != len(ys):
        raise ValueError("need as many rows as values, and at least one")
    k = len(rows[0])
    w = list(weights) if weights is not None else [1.0] * len(ys)
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for free in itertools.combinations(range(k), size):
            coef = _solve(rows, ys, w, free)
            if coef is None or min(coef) < 0:
                continue
            full = [0.0] * k
            for i, c in zip(free, coef, strict=True):
                full[i] = c
            sse = _sse(rows, ys, w, full)
            if best is None or sse < best[0] - 1e-18:
                best = (sse, full)
    if best is None:
        return [0.0] * k, 0.0
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sum(w)
    syy = sum(wi * (y - my) ** 2 for wi, y in zip(w, ys, strict=True))
    return best[1], 1.0 - best[0] / syy if syy > 0 else 1.0


def _sse(rows: Sequence[Sequence[float]], ys: Sequence[float], w: Sequence[float],
         coef: Sequence[float]) -> float:  # fmt: skip
    return sum(wi * (y - sum(c * x for c, x in zip(coef, r, strict=True))) ** 2
               for r, y, wi in zip(rows, ys, w, strict=True))  # fmt: skip


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float], w: Sequence[float],
           free: Sequence[int]) -> list[float] | None:  # fmt: skip
    """The normal equations over the `free` columns, by Gauss-Jordan; None when singular."""
    n = len(free)
    a = [[0.0] * (n + 1) for _ in range(n)]
    for r, y, wi in zip(rows, ys, w, strict=True):
        x = [r[j] for j in free]
        for i in range(n):
            for j in range(n):
                a[i][j] += wi * x[i] * x[j]
            a[i][n] += wi * x[i] * y
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        scale = max(abs(a[i][col]) for i in range(n)) or 1.0
        if abs(a[piv][col]) <= 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


@dataclass(frozen=True)
class PrefillFit:
    overhead_s: float
    s_per_uncached: float  # P's compute per uncached token
    s_per_prompt: float  # per prompt token (P reads its KV; on same-DC it also goes to D)
    shared_host_s: float  # per request decoding beside it
    r2: float
    requests: int

    def first_token_s(self, r: Record, busy: float) -> float:
        new = max(1, r.prompt_tokens - r.cached_tokens)
        return (self.overhead_s + self.s_per_uncached * new + self.s_per_prompt * r.prompt_tokens
                + self.shared_host_s * busy)  # fmt: skip


def busy_during(records: Sequence[Record], r: Record) -> float:
    """Requests of `records` (one pass) decoding on average while `r` waited for its first
    token."""
    if r.start_s is None or r.ttft_s is None or r.ttft_s <= 0:
        return 0.0
    t0, t1 = r.start_s, r.start_s + r.ttft_s
    spans = [(a, b) for a, b, q in decode_spans(records) if q is not r]
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans) / (t1 - t0)


def fit_prefill(records: Sequence[Record]) -> PrefillFit:
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    if len(ok) < 4:
        raise ValueError("need at least four same-DC requests to fit the first token")
    # P always computes a prompt's last token (prefill_job), so at least one is uncached.
    rows = [[1.0, max(1.0, r.prompt_tokens - r.cached_tokens), float(r.prompt_tokens),
             busy_during(records, r)] for r in ok]  # fmt: skip
    (a, b, c, h), r2 = least_squares(rows, [r.ttft_s for r in ok if r.ttft_s is not None])
    if b <= 0:
        raise ValueError("TTFT does not grow with uncached tokens: P's compute is unknown")
    return PrefillFit(a, b, c, h, r2, len(ok))


@dataclass(frozen=True)
class StepFit:
    overhead_s: float
    per_request_s: float
    per_token_s: float  # per token of context the step reads (its batch's new tokens too)
    r2: float
    requests: int

    def step_s(self, batch: float, context: float) -> float:
        return self.overhead_s + self.per_request_s * batch + self.per_token_s * (context + batch)


Span = tuple[float, float, Record]  # a request's decode on the client's clock: first token, end


def decode_spans(records: Sequence[Record]) -> list[Span]:
    spans = []
    for r in records:
        if r.ok and r.start_s is not None and r.ttft_s is not None and r.e2e_s is not None:
            spans.append((r.start_s + r.ttft_s, r.start_s + r.e2e_s, r))
    return spans


def step_load(spans: Sequence[Span], i: int, fit: StepFit | None) -> tuple[float, float]:
    """Mean batch and context of the steps request `i` ran in (time-weighted without a fit)."""
    a, b, _ = spans[i]
    cuts = sorted({a, b, *(t for s in spans for t in s[:2] if a < t < b)})
    total = batch_sum = ctx_sum = 0.0
    for u, v in itertools.pairwise(cuts):
        m = (u + v) / 2
        running = [(s0, s1, q) for s0, s1, q in spans if s0 <= m < s1]
        batch = float(len(running))
        ctx = sum(q.prompt_tokens + (q.output_tokens - 1) * (m - s0) / (s1 - s0)
                  for s0, s1, q in running if s1 > s0)  # fmt: skip
        steps = (v - u) / (fit.step_s(batch, ctx) if fit is not None else 1.0)
        total += steps
        batch_sum += batch * steps
        ctx_sum += ctx * steps
    return (batch_sum / total, ctx_sum / total) if total > 0 else (1.0, 0.0)


def fit_step(records: Sequence[Record], rounds: int = 3) -> StepFit:
    """The decode step from the TPOTs of requests that ran on one decoder (see the module)."""
    spans = decode_spans(records)
    idx = [i for i, (_, _, r) in enumerate(spans) if r.output_tokens >= 2 and r.tpot_s]
    if len(idx) < 3:
        raise ValueError("need three requests with two or more output tokens to fit a step")
    tpots = [spans[i][2].tpot_s or 0.0 for i in idx]
    steps = [float(spans[i][2].output_tokens - 1) for i in idx]
    fit: StepFit | None = None
    for _ in range(rounds):
        loads = [step_load(spans, i, fit) for i in idx]
        rows = [[1.0, n, ctx + n] for n, ctx in loads]
        (a, b, c), r2 = least_squares(rows, tpots, steps)
        fit = StepFit(a, b, c, r2, len(idx))
    assert fit is not None
    if fit.step_s(1, 0) <= 0 and fit.per_token_s <= 0:
        raise ValueError("the decode step fitted to zero")
    return fit


@dataclass(frozen=True)
class WanFit:
    bootstrap_s: float  # from arrival until MD takes the KV (P->MD)
    flows: float  # a request's KV ramps as this many TCP flows from idle (Link.ramp_flows)
    requests: int
    r2: float


def fit_wan(passes: Sequence[Sequence[Record]], prefill: PrefillFit, link: Link,
            kv_bytes_per_token: float) -> WanFit | None:  # fmt: skip
    """MD's bootstrap and the ramp of a request's KV from the P->MD first tokens of cross-DC
    `passes`; None without any."""
    xs: list[float] = []
    ys: list[float] = []
    ws: list[float] = []
    for recs in passes:
        for r in recs:
            if not r.ok or r.path != "P->MD" or r.ttft_s is None:
                continue
            new = max(1, r.prompt_tokens - r.cached_tokens)
            xs.append(float(r.wan_kv_bytes or new * kv_bytes_per_token))
            p = prefill.first_token_s(r, busy_during(recs, r))
            ys.append(r.ttft_s - p - 2 * link.mean_one_way_s())
            ws.append(1 / max(r.ttft_s, 1e-3) ** 2)  # relative errors, as the comparison
    if not xs:
        return None

    def fitted(flows: float) -> tuple[float, float]:  # (weighted SSE, bootstrap)
        ramp = replace(link, ramp_flows=flows)
        resid = [y - ramp.alone_s(x) for x, y in zip(xs, ys, strict=True)]
        boot = max(sum(w * e for w, e in zip(ws, resid, strict=True)) / sum(ws), 0.0)
        return sum(w * (e - boot) ** 2 for w, e in zip(ws, resid, strict=True)), boot

    # A coarse geometric grid, then a finer one around its best: the error is smooth in flows.
    grid = [FLOWS[0] * (FLOWS[1] / FLOWS[0]) ** (k / 40) for k in range(41)]
    best = min(grid, key=lambda n: fitted(n)[0])
    best = min((best * 1.2 ** (k / 10 - 1) for k in range(21)), key=lambda n: fitted(n)[0])
    sse, boot = fitted(best)
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sum(ws)
    syy = sum(w * (y - my) ** 2 for w, y in zip(ws, ys, strict=True))
    return WanFit(boot, best, len(xs), 1 - sse / syy if syy > 0 else 1.0)
