"""Per-request records of a benchmark run and what a report shows of them: latency percentiles,
SLA goodput, WAN bytes, RelayDecode's and MainDecode's shares of the output, handoffs by mode;
as a table, markdown and plots."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Record:
    """One request as a client saw it (times in seconds) and as the router reported it."""

    prompt_tokens: int
    cached_tokens: int = 0  # the trace's: the prefix shared with earlier prompts
    start_s: float | None = None  # sent, seconds after the run's start
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    path: str | None = None
    relay_tokens: int = 0
    wan_kv_bytes: int = 0
    error: str | None = None
    path_reason: str | None = None  # why the router chose the path
    main_tokens: int = 0  # output tokens the client got from MD
    handoff_mode: str | None = None  # RLD -> MD handoff: "extend" or "catchup"; None: none

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a single-token answer."""
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.ttft_s is not None and self.e2e_s is not None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Sla:
    ttft_s: float
    tpot_s: float

    def met(self, r: Record) -> bool:
        tpot = r.tpot_s
        return (
            r.ok
            and r.ttft_s is not None
            and r.ttft_s <= self.ttft_s
            and (tpot is None or tpot <= self.tpot_s)
        )


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Run:
    """One deployment's pass over the workload."""

    name: str
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    wan_link_bytes: int = 0  # the WAN's own byte counter, A -> B, over the run
    cores: dict[str, float] = field(default_factory=dict)  # CPU per part / wall, over the run

    def summary(self, sla: Sla) -> dict[str, float]:
        ok = [r for r in self.records if r.ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpot = [t for r in ok if (t := r.tpot_s) is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        out_tokens = sum(r.output_tokens for r in ok)
        wall = max(self.wall_s, 1e-9)
        failed = len(self.records) - len(ok)
        row: dict[str, float] = {"requests": len(self.records), "failed": failed}
        for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
            for q in (50, 90, 99):
                row[f"{name}_p{q}"] = percentile(values, q)
        row["goodput_rps"] = sum(sla.met(r) for r in ok) / wall
        row["sla_share"] = sum(sla.met(r) for r in ok) / max(len(self.records), 1)
        row["throughput_tok_s"] = out_tokens / wall
        row["wan_mb_per_request"] = self.wan_link_bytes / 1e6 / max(len(self.records), 1)
        row["kv_mb_per_request"] = statistics.fmean(r.wan_kv_bytes for r in ok) / 1e6 if ok else 0
        row["rld_share"] = sum(r.relay_tokens for r in ok) / max(out_tokens, 1)
        row["md_share"] = sum(r.main_tokens for r in ok) / max(out_tokens, 1)
        for mode in ("extend", "catchup"):
            row[f"handoffs_{mode}"] = sum(r.handoff_mode == mode for r in ok)
        row["wall_s"] = self.wall_s
        row.update({f"cores_{part}": c for part, c in self.cores.items()})
        return row

    def tpot_by_path(self) -> dict[str, tuple[float, int]]:
        """Per path, the TPOT P50 of its requests and how many there were: on P->MD it is MD's
        step time (with the stream's way back), on P->RLD RLD's."""
        by: dict[str, list[float]] = {}
        for r in self.records:
            if r.path is not None and (t := r.tpot_s) is not None:
                by.setdefault(r.path, []).append(t)
        return {path: (percentile(ts, 50), len(ts)) for path, ts in sorted(by.items())}


COLUMNS = [  # (key, header, format)
    ("ttft_p50", "TTFT P50", "{:.2f}"),
    ("ttft_p90", "P90", "{:.2f}"),
    ("ttft_p99", "P99", "{:.2f}"),
    ("tpot_p50", "TPOT P50", "{:.3f}"),
    ("tpot_p90", "P90", "{:.3f}"),
    ("tpot_p99", "P99", "{:.3f}"),
    ("e2e_p50", "E2E P50", "{:.2f}"),
    ("e2e_p99", "P99", "{:.2f}"),
    ("goodput_rps", "in-SLA req/s", "{:.3f}"),
    ("sla_share", "in SLA", "{:.0%}"),
    ("wan_mb_per_request", "WAN MB/req", "{:.2f}"),
    ("rld_share", "RLD share", "{:.1%}"),
    ("md_share", "MD share", "{:.1%}"),
    ("failed", "failed", "{:.0f}"),
]


def markdown_table(summaries: dict[str, dict[str, float]]) -> str:
    head = "| deployment | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    rule = "| --- " * (len(COLUMNS) + 1) + "|"
    rows = [
        f"| {name} | " + " | ".join(fmt.format(s[key]) for key, _, fmt in COLUMNS) + " |"
        for name, s in summaries.items()
    ]
    return "\n".join([head, rule, *rows])


def plot_runs(runs: list[Run], sla: Sla, path: Path, title: str) -> None:
    """TTFT CDFs (left) and WAN MB per request with RLD's share of the output (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        ttft = sorted(r.ttft_s for r in run.records if r.ok and r.ttft_s is not None)
        if ttft:
            left.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                      label=run.name)  # fmt: skip
    left.axvline(sla.ttft_s, color="grey", linestyle="--", label="TTFT SLA")
    left.set_xlabel("time to first token (s)")
    left.set_ylabel("share of requests")
    left.legend(fontsize=8)
    summaries = [run.summary(sla) for run in runs]
    names = [run.name for run in runs]
    right.bar(names, [s["wan_mb_per_request"] for s in summaries], color="tab:blue")
    right.set_ylabel("WAN MB per request (link counter)")
    right.tick_params(axis="x", labelrotation=20, labelsize=8)
    share = right.twinx()
    share.plot(names, [100 * s["rld_share"] for s in summaries], "o", color="tab:red")
    share.set_ylabel("RLD share of output tokens (%)", color="tab:red")
    share.set_ylim(0, 100)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
