"""The faults benchmark as a picture: per scenario, each request's time to first token against
when it was sent, by outcome and path, with the fault's window shaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MARKERS = {"completed": "o", "failed": "x", "lost": "X"}
COLORS = {"failed": "tab:red", "lost": "black"}  # completed ones: by path


def plot_faults(results: list[Any], path: Path, title: str) -> None:
    """`results` are faults.Result; one row of the figure per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.4 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        if result.fault_at_s is not None:
            end = result.fault_end_s if result.fault_end_s is not None else result.fault_at_s
            ax.axvspan(result.fault_at_s, max(end, result.fault_at_s + 0.5), color="tab:red",
                       alpha=0.15, label="fault")  # fmt: skip
        groups: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
        for o in result.outcomes:
            # Failed or lost requests without a first token are drawn at 0.
            key = (o.kind, o.path or "-") if o.kind == "completed" else (o.kind, "")
            xs, ys = groups.setdefault(key, ([], []))
            xs.append(o.started_s)
            ys.append(o.ttft_s or 0.0)
        for (kind, route), (xs, ys) in sorted(groups.items()):
            label = f"{kind} {route}".strip() + f" ({len(xs)})"
            ax.scatter(xs, ys, s=10, marker=MARKERS[kind], color=COLORS.get(kind), label=label)
        ax.set_title(result.scenario, fontsize=9, loc="left")
        ax.set_ylabel("TTFT (s)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1, 0].set_xlabel("sent at (s from the scenario's start)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
