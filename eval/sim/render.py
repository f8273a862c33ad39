"""What `python -m pdd.eval sim | plan | repro` print and draw: the markdown tables and the
plots (matplotlib only when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdd.eval.sim.config import Sla
from pdd.eval.sim.results import SimResult


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt_ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def sim_table(results: Sequence[SimResult], sla: Sla) -> str:
    head = (
        "| deployment | cost | offered/s | done/s | goodput/s | SLA met | TTFT p50/p90/p99 s | "
        "TPOT p50/p99 ms | E2E p50 s | WAN Gbit/s | RLD tokens | paths |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        s = r.summary
        t, p = s.ttft_s, s.tpot_s
        paths = ", ".join(f"{k} {v}" for k, v in sorted(s.paths.items()))
        lines.append(
            f"| {r.config.describe()} | {s.cost:.1f} | {s.offered_rps:.2f} | "
            f"{s.throughput_rps:.2f} | "
            f"{s.goodput_rps:.2f} | {s.sla_met:.0%} | {t['p50']:.2f}/{t['p90']:.2f}/"
            f"{t['p99']:.2f} | {_fmt_ms(p['p50'])}/{_fmt_ms(p['p99'])} | {s.e2e_s['p50']:.1f} | "
            f"{s.wan_gbit_s:.1f} | {s.rld_token_share:.1%} | {paths} |"
        )
    lines.append("")
    lines.append(
        f"done/s and goodput/s (requests with TTFT <= {sla.ttft_s:g} s and TPOT <= "
        f"{sla.tpot_s * 1e3:g} ms) are per second of the whole run, drain included; "
        "utilisation (time running forwards; WAN: average line load): "
        + "; ".join(
            f"{r.config.kind} "
            + ", ".join(f"{k} {v:.0%}" for k, v in r.summary.utilisation.items())
            for r in results
        )
    )
    return "\n".join(lines) + "\n"


def cdf_plot(results: Sequence[SimResult], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = sorted(x.ttft_s for x in r.results)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=r.config.kind)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per deployment")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_table(cands: Sequence[Any], rows: int) -> str:
    lines = [
        "| rank | deployment | cost | limit | analytic req/s | analytic BCR | "
        "simulated SLA req/s | simulated BCR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(cands[:rows], 1):
        d = c.to_dict()
        sim = "-" if d["sla_rps"] is None else f"{d['sla_rps']:.2f}"
        b = "-" if d["bcr"] is None else f"{d['bcr']:.3f}"
        lines.append(
            f"| {i} | {d['deployment']} | {d['cost']:.1f} | {d['bottleneck']} | "
            f"{d['analytic_rps']:.2f} | {d['analytic_bcr']:.3f} | {sim} | {b} |"
        )
    return "\n".join(lines) + "\n"


def bathtub_plot(points: Sequence[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    hits = [p["hit"] * 100 for p in points]
    for key, label in (("pdd", "PDD"), ("cache", "cross-DC + decode cache"),
                       ("pdd_ideal_wan", "PDD, ideal WAN")):  # fmt: skip
        ax.plot(hits, [p[key] for p in points], marker="o", label=label)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylabel("SLA throughput (req/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    ax2.plot(hits, [p["pdd_vs_ideal"] for p in points], marker="o", color="C3")
    ax2.set_ylabel("PDD / ideal-WAN PDD")
    ax2.set_xlabel("prefix hit rate (%)")
    ax2.grid(True, alpha=0.3)
    fig.suptitle("Bathtub: SLA throughput vs hit rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
