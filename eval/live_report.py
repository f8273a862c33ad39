"""What a live run reports: per deployment and rate the usual summary, the SLA goodput of a rate
sweep, the comparison of PDD with same-DC PD, and the files (markdown, JSON, PNG)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdd.eval.live_criteria import NO_GUARD, PDD, SAME_DC, criteria, criteria_table, ratio
from pdd.eval.report import Record, Run, Sla, markdown_table, plot_runs

Outputs = list[list[int] | None]


def agreement(outputs: list[Outputs]) -> list[float]:
    """Per deployment, the share of requests whose output equals the first deployment's."""
    base = outputs[0]
    shares = []
    for outs in outputs:
        pairs = [(o, b) for o, b in zip(outs, base, strict=True) if o is not None and b is not None]
        shares.append(sum(o == b for o, b in pairs) / max(len(pairs), 1))
    return shares


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two outputs differ (the shorter one's length if one is a
    prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def differences(outputs: Outputs, base: Outputs, records: Sequence[Record],
                base_records: Sequence[Record]) -> list[dict]:  # fmt: skip
    """The requests whose output differs from the first deployment's: where, and on which
    paths, so that a mismatch can be reproduced (greedy float32 outputs should never differ)."""
    return [
        {"request": i, "at_token": first_difference(o, b), "tokens": len(o),
         "path": records[i].path, "base_path": base_records[i].path}
        for i, (o, b) in enumerate(zip(outputs, base, strict=True))
        if o is not None and b is not None and o != b
    ]  # fmt: skip


def meets(summary: dict[str, float], sla: Sla) -> bool:
    """A pass meets the SLA when its TTFT P90 and TPOT P90 do and no request failed."""
    tpot = summary["tpot_p90"]
    return (
        summary["failed"] == 0
        and summary["ttft_p90"] <= sla.ttft_s
        and (math.isnan(tpot) or tpot <= sla.tpot_s)
    )


def sla_goodput(by_rate: dict[float, dict[str, float]], sla: Sla) -> float:
    """The highest rate whose pass meets the SLA (0 when none does)."""
    return max((rate for rate, s in by_rate.items() if meets(s, sla)), default=0.0)


def compare_line(name: str, s: dict[str, float], base: dict[str, float], goodput: float,
                 base_goodput: float) -> str:  # fmt: skip
    """`pdd md share X rld share Y ttft p99 ratio Z goodput ratio W` (ratios to same-DC PD)."""
    label = (
        "pdd" if name == PDD else name.lower().replace(" ", "-").replace("(", "").replace(")", "")
    )
    return (
        f"{label} md share {s['md_share']:.3f} rld share {s['rld_share']:.3f} "
        f"ttft p99 ratio {ratio(s['ttft_p99'], base['ttft_p99']):.3f} "
        f"goodput ratio {ratio(goodput, base_goodput):.3f}"
    )


def handoffs(s: dict[str, float]) -> str:
    return f"extend {s['handoffs_extend']:.0f}, catch-up {s['handoffs_catchup']:.0f}"


def where_time_went(run: Run) -> str:
    """The cores each part used over the pass (CPU seconds over its wall time) and the TPOT P50
    per path (whose decoder's steps, with the stream's way back to the router)."""
    cores = ", ".join(f"{part} {c:.2f}" for part, c in run.cores.items())
    tpot = ", ".join(f"{path} {t:.3f} s ({n})" for path, (t, n) in run.tpot_by_path().items())
    return f"cores used: {cores or 'not measured'}; TPOT P50 by path: {tpot or 'none'}"


def report(
    runs: dict[str, dict[float | None, Run]],
    outputs: dict[str, dict[float | None, Outputs]],
    sla: Sla,
    title: str,
    meta: dict[str, Any],
    out: Path,
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Prints and writes the report; returns the first pace's summaries and the final lines.

    `runs[deployment][rate]` (rate None: closed loop). Outputs are compared per rate against
    the first deployment's. JSON: `runs`/`summaries` hold the first rate's passes (what the
    simulator's calibration reads), `sweep` every rate's summaries, `criteria_by_rate` every
    rate's must-show rows (`criteria`: the first rate's)."""
    names = list(runs)
    rates = list(next(iter(runs.values())))
    sweep: dict[str, dict[float | None, dict[str, float]]] = {n: {} for n in names}
    differ: dict[str, dict[float | None, list[dict]]] = {n: {} for n in names}
    for rate in rates:
        here = [n for n in names if rate in runs[n]]
        same = agreement([outputs[n][rate] for n in here])
        for n, share in zip(here, same, strict=True):
            sweep[n][rate] = {**runs[n][rate].summary(sla), "same_output": share}
            differ[n][rate] = differences(
                outputs[n][rate],
                outputs[here[0]][rate],
                runs[n][rate].records,
                runs[here[0]][rate].records,
            )
    first = rates[0]
    summaries = {n: sweep[n][first] for n in names if first in sweep[n]}
    goodput = {n: sla_goodput({r: s for r, s in sweep[n].items() if r is not None}, sla)
               for n in names}  # fmt: skip
    sections = []
    for rate in rates:
        pace = "closed loop" if rate is None else f"{rate:g} req/s (Poisson)"
        table = markdown_table({n: sweep[n][rate] for n in names if rate in sweep[n]})
        extra = "\n".join(
            f"- {n}: handoffs {handoffs(sweep[n][rate])}; outputs equal to {names[0]}'s "
            f"{sweep[n][rate]['same_output']:.0%}" + "".join(
                f"; request {d['request']} differs from token {d['at_token']} of {d['tokens']} "
                f"({d['path']}, vs {d['base_path']})" for d in differ[n][rate])
            + f"\n  - {where_time_went(runs[n][rate])}"
            for n in names if rate in sweep[n]
        )  # fmt: skip
        sections.append(f"## {pace}\n\n{table}\n\n{extra}\n")
    if any(r is not None for r in rates):
        rows = "\n".join(f"| {n} | {goodput[n]:g} |" for n in names)
        sections.append(
            "## SLA goodput\n\nThe highest rate whose TTFT P90 <= "
            f"{sla.ttft_s:g} s and TPOT P90 <= {sla.tpot_s:g} s (no failures); 0: none.\n\n"
            f"| deployment | req/s |\n| --- | --- |\n{rows}\n"
        )
    # Every rate's: at a light load PDD's tail is its P -> MD round trips, at a heavy one the
    # baselines' queues; one rate alone would show only one side.
    checked_at = {rate: criteria({n: sweep[n][rate] for n in names if rate in sweep[n]}, goodput,
                                 {n: runs[n][rate] for n in names if rate in runs[n]})
                  for rate in rates}  # fmt: skip
    for rate, rows in checked_at.items():
        if rows:
            at = "closed loop" if rate is None else f"{rate:g} req/s"
            sections.append(f"## What PDD must show, at {at}\n\n{criteria_table(rows)}\n")
    checked = checked_at[first]
    lines = []
    if SAME_DC in summaries:
        base = summaries[SAME_DC]
        for n in names:
            if n.startswith(PDD) and n != NO_GUARD and n in summaries:
                lines.append(compare_line(n, summaries[n], base, goodput[n], goodput[SAME_DC]))
        if NO_GUARD in summaries and PDD in summaries:
            off, on = summaries[NO_GUARD]["ttft_p99"], summaries[PDD]["ttft_p99"]
            lines.append(f"rld guard ttft p99 off/on {ratio(off, on):.3f}")
        lines.sort(key=lambda line: line.startswith("pdd "))  # PDD (extend) last
    body = "\n".join(sections)
    print(f"\n{title}\n\n{body}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "live.md").write_text(f"# Live run\n\n{title}\n\n{body}\n" + "".join(
        f"    {line}\n" for line in lines) + "\n![TTFT and WAN](live.png)\n")  # fmt: skip
    data = {
        **meta,
        "title": title,
        "summaries": summaries,
        "runs": {n: [asdict(r) for r in runs[n][first].records] for n in names if first in runs[n]},
        "sweep": {n: {str(r): s for r, s in sweep[n].items()} for n in names},
        "sla_goodput_rps": goodput,
        "differences": {n: {str(r): d for r, d in differ[n].items()} for n in names},
        "compare": lines,
        "criteria": [{**asdict(c), "met": c.met} for c in checked],
        "criteria_by_rate": {
            str(r): [{**asdict(c), "met": c.met} for c in rows] for r, rows in checked_at.items()
        },
    }
    (out / "live.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_runs([runs[n][first] for n in names if first in runs[n]], sla, out / "live.png", title)
    print(f"wrote {out}/live.md, live.json and live.png")
    if lines:  # last, one line per PDD deployment, PDD (extend) the very last
        at = "closed loop" if first is None else f"{first:g} req/s"
        print(f"shares and TTFT P99 at {at}; ratios to same-DC PD:")
        print("\n".join(lines), flush=True)
    return summaries, lines
