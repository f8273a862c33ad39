"""`python -m pdd.eval live`: what it sends (trace at a rate, working set, KV pool), what it
reports (SLA goodput, the PDD line), and, short, a small agentic trace through the five
deployments on the testbed with the tiny model: real servers, real WAN."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from pdd.eval.__main__ import main
from pdd.eval.live_criteria import Criterion, paired_e2e_ratio
from pdd.eval.live_plan import (
    TraceSpec,
    low_hit_burst,
    pool_tokens,
    sessions_for,
    tier_cpus,
    trace_at,
    warmup,
    working_set,
)
from pdd.eval.live_report import compare_line, differences, meets, report, sla_goodput
from pdd.eval.report import Record, Run, Sla
from pdd.eval.workload import TraceRequest, hit_rate_summary
from pdd.launch.pdd_deploy import RELAY_FRACTION, relay_capacity_args
from pdd.launch.servers import Placement, flag_value
from tests.marks import needs_root


def test_the_default_trace_is_in_pdds_regime() -> None:
    spec = TraceSpec()
    trace = trace_at(spec, 0.15)
    s = hit_rate_summary(trace)
    assert len(trace) == 40 and abs(s["mean_hit"] - 0.90) <= 0.03  # warm: system prompts cached
    outputs = [r.output_tokens for r in trace if not r.singular]
    assert sum(outputs) / len(outputs) >= 150 and max(outputs) <= 512  # answers not scaled
    assert s["max_prompt_tokens"] <= 1920  # prompts are
    assert 200 <= trace[-1].arrival_s <= 400  # ~5 minutes a pass at 0.15 req/s
    assert trace_at(spec, 0.15) == trace and trace_at(spec, 0.3) != trace
    systems = warmup(spec)
    assert systems and all(r.output_tokens == 1 for r in systems)


def test_a_higher_rate_offers_more_load() -> None:
    # Six sessions whose turns are >= 20 s apart offer ~0.3 req/s at most, whatever is asked.
    capped = trace_at(TraceSpec(sessions=6), 0.9)
    trace = trace_at(TraceSpec(), 0.9)  # sessions enough for the rate
    assert sessions_for(0.9, 20.0) == 27 and sessions_for(0.15, 20.0) == 6
    assert len(trace) / trace[-1].arrival_s >= 0.65 > 0.35 >= len(capped) / capped[-1].arrival_s
    assert abs(hit_rate_summary(trace)["mean_hit"] - 0.90) <= 0.05


def test_a_low_hit_burst_joins_the_trace_at_its_midpoint() -> None:
    spec = TraceSpec(burst=12)
    base, trace = trace_at(TraceSpec(), 0.15), trace_at(spec, 0.15)
    assert trace == low_hit_burst(spec.config(0.15), base, 12)
    assert [r.id for r in trace] == list(range(52))
    added = [r for r in trace if r.session > max(b.session for b in base)]
    assert len(added) == 12 and all(r.hit < 0.5 for r in added)  # the low tail, measured
    at = [r.arrival_s for r in added]
    assert at[0] == base[20].arrival_s and at == pytest.approx([at[0] + 0.5 * k for k in range(12)])
    assert all(r.output_tokens >= 8 and r.cached_tokens > 0 for r in added)  # a system prompt
    kept = [r for r in trace if r.session <= max(b.session for b in base)]
    assert [(r.segments, r.output_tokens, r.cached_tokens) for r in kept] == [
        (r.segments, r.output_tokens, r.cached_tokens) for r in base
    ]


def test_working_set_and_pool() -> None:
    def req(i: int, session: int, prompt: int, out: int) -> TraceRequest:
        return TraceRequest(i, session, 0, float(i), prompt, 0, out)

    # Sessions 0 (until request 2) and 1 (until 3) overlap; 2 starts after 0 ended.
    trace = [req(0, 0, 100, 10), req(1, 1, 50, 5), req(2, 0, 200, 20), req(3, 1, 60, 6),
             req(4, 2, 30, 3)]  # fmt: skip
    assert working_set(trace) == 220 + 55  # request 2: session 0's 200 + 20, session 1's 55
    assert pool_tokens([trace], 512) == (1024, 275)  # at least 1024
    big = [req(0, 0, 3000, 400), req(1, 1, 2000, 300), req(2, 0, 3100, 50), req(3, 1, 2100, 9)]
    assert working_set(big) == 3400 + 2300  # at request 1; then 3150 + 2300
    assert pool_tokens([big], 512) == (2 * 5700, 5700)
    assert pool_tokens([big[:1]], 512) == (2 * 3400, 3400)  # the longest request fits twice
    assert pool_tokens([[req(0, 0, 3000, 900)]], 512) == (2 * 3512, 3512)  # answers capped


def test_a_file_trace_keeps_its_outputs_and_takes_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "user.jsonl"
    rows = [{"arrival_s": 2.0 * i, "prompt_tokens": 100 + i, "output_tokens": 300 + i}
            for i in range(5)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = TraceSpec(path=path, requests=4)
    trace = trace_at(spec, 0.5)
    assert [r.output_tokens for r in trace] == [300, 301, 302, 303]
    assert [r.arrival_s for r in trace] == pytest.approx([0, 2, 4, 6])  # 0.5/s: its own clock
    assert [r.arrival_s for r in trace_at(spec, 1.0)] == pytest.approx([0, 1, 2, 3])
    assert warmup(spec) == []


def test_differing_outputs_are_named_with_where_and_on_which_paths() -> None:
    base = [[1, 2, 3], [4, 5], [6], None]
    other = [[1, 2, 3], [4, 9], [6, 7], [8]]
    records = [Record(10, path=p) for p in ("P->MD", "P->RLD->MD", "P->RLD", "P->MD")]
    base_records = [Record(10, path="P->MD") for _ in base]
    assert differences(other, base, records, base_records) == [
        {"request": 1, "at_token": 1, "tokens": 2, "path": "P->RLD->MD", "base_path": "P->MD"},
        {"request": 2, "at_token": 1, "tokens": 2, "path": "P->RLD", "base_path": "P->MD"},
    ]
    assert differences(base, base, base_records, base_records) == []


def test_each_tier_gets_cpus_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert tier_cpus(RELAY_FRACTION) == {"prefill": "0", "relay": "0", "main": "1"}
    assert tier_cpus(1.0) == {"prefill": "0", "relay": "1", "main": "1"}  # same-DC's decoder
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 4, 5, 6, 7})
    assert tier_cpus(RELAY_FRACTION) == {"prefill": "3,4", "relay": "3,4", "main": "5,6,7"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert tier_cpus(RELAY_FRACTION) == {}
    # The pin is a prefix of the server's command, after the namespace it runs in.
    netns = Placement("10.0.0.1", ("ip", "netns", "exec", "a"))
    assert netns.on_cpus("0").prefix == ("ip", "netns", "exec", "a", "taskset", "--cpu-list", "0")
    assert netns.on_cpus(None) == netns


def test_a_criterion_is_met_on_its_side_of_the_bound_and_never_on_nan() -> None:
    assert Criterion("x", 1.2, "<= 1.2").met and not Criterion("x", 1.21, "<= 1.2").met
    assert Criterion("x", 3.0, ">= 3").met and not Criterion("x", 2.9, ">= 3").met
    assert not Criterion("x", math.nan, "<= 1").met and not Criterion("x", math.nan, ">= 1").met


def test_the_paired_e2e_ratio_follows_requests_not_medians() -> None:
    """Two runs of the same three requests, each 10% slower in the second: the median of the
    per-request ratios says 1.1, whatever the medians of the two runs do."""

    def run(e2e: list[float]) -> Run:
        return Run("r", [Record(10, 0, 0.0, 5, 0.1, e) for e in e2e])

    assert paired_e2e_ratio(run([1.1, 4.4, 8.8]), run([1.0, 4.0, 8.0])) == pytest.approx(1.1)
    assert math.isnan(paired_e2e_ratio(run([]), run([])))


def test_sla_goodput_is_the_highest_rate_that_meets_the_sla() -> None:
    sla = Sla(3.0, 0.5)

    def s(ttft: float, tpot: float, failed: int = 0) -> dict[str, float]:
        return {"ttft_p90": ttft, "tpot_p90": tpot, "failed": failed}

    assert meets(s(2.9, 0.4), sla) and not meets(s(3.1, 0.4), sla)
    assert not meets(s(1, 0.6), sla) and not meets(s(1, 0.1, failed=1), sla)
    assert sla_goodput({0.1: s(1, 0.1), 0.2: s(2, 0.2), 0.4: s(5, 0.2)}, sla) == 0.2
    assert sla_goodput({0.1: s(4, 0.1)}, sla) == 0.0
    pdd = {"md_share": 0.9, "rld_share": 0.1, "ttft_p99": 1.0}
    base = {"md_share": 0.0, "rld_share": 1.0, "ttft_p99": 2.0}
    line = compare_line("PDD", pdd, base, 0.3, 0.2)
    assert line == "pdd md share 0.900 rld share 0.100 ttft p99 ratio 0.500 goodput ratio 1.500"
    assert compare_line("PDD catch-up", pdd, base, 0.3, 0.2).startswith("pdd-catch-up md share")
    assert math.isnan(float(compare_line("PDD", pdd, base, 0.3, 0.0).split()[-1]))


# What the router's path policy plans (pdd.policy.path.auto_path), and what the client can then
# see: a request planned P->RLD->MD ends P->RLD when RLD finishes before MD is ready.
PLANNED_PATHS = {"main": {"P->MD"}, "pdd": {"P->RLD->MD", "P->RLD"}, "relay": {"P->RLD"}}


def planned(reason: str) -> str:
    """The path an automatic plan's reason (`path_reason`) stands for."""
    if reason.startswith(("meets the SLA", "RLD full", "RLD's KV full")):
        return "main"
    if "RLD hides it" in reason or "MD fed to measure" in reason:
        return "pdd"
    assert reason.startswith(("singular", "handoff unsupported")), reason
    return "relay"


@needs_root
def test_a_short_live_run_reports_all_five_deployments(tiny_model: Path, tmp_path: Path) -> None:
    rc = main(["live", "--model", str(tiny_model), "--requests", "10", "--scale", "0.01",
               "--max-new", "24", "--concurrency", "2", "--rate-mbit", "50",
               "--out", str(tmp_path)])  # fmt: skip
    data = json.loads((tmp_path / "live.json").read_text())
    s = data["summaries"]
    assert rc == 0, s
    names = ["same-DC PD", "naive cross-DC PD", "cross-DC PD + decode cache", "PDD",
             "PDD catch-up"]  # fmt: skip
    assert list(s) == names
    for name in names:
        assert s[name]["requests"] == 10 and s[name]["failed"] == 0, (name, s[name])
        assert s[name]["same_output"] == 1.0, (name, s[name])  # greedy: one answer per prompt
        assert s[name]["ttft_p50"] > 0 and s[name]["ttft_p99"] >= s[name]["ttft_p50"]
    # Only cross-DC deployments fill the WAN; the decode cache sends only what MD lacks.
    naive = s["naive cross-DC PD"]["wan_mb_per_request"]
    assert s["same-DC PD"]["wan_mb_per_request"] < 0.2 * naive, s
    assert s["cross-DC PD + decode cache"]["wan_mb_per_request"] < 0.8 * naive, s
    runs = data["runs"]
    assert {r["path"] for r in runs["same-DC PD"]} == {"P->RLD"}
    assert {r["path"] for r in runs["naive cross-DC PD"]} == {"P->MD"}
    assert all(r["relay_tokens"] == r["output_tokens"] for r in runs["same-DC PD"])
    assert s["same-DC PD"]["rld_share"] == 1.0 and s["naive cross-DC PD"]["rld_share"] == 0.0
    assert s["naive cross-DC PD"]["md_share"] == 1.0
    # Each pass's CPU by part: the decoder that decoded used more than the idle one.
    for name in names:
        assert {"cores_P", "cores_RLD", "cores_MD", "cores_router", "cores_WAN"} <= set(s[name])
        assert s[name]["cores_P"] > 0, (name, s[name])
    assert s["same-DC PD"]["cores_RLD"] > s["same-DC PD"]["cores_MD"], s["same-DC PD"]
    assert s["naive cross-DC PD"]["cores_MD"] > s["naive cross-DC PD"]["cores_RLD"], s
    for name in ("PDD", "PDD catch-up"):  # each request took the path its router planned
        for r in runs[name]:
            assert r["path"] in PLANNED_PATHS[planned(r["path_reason"])], (name, r)
    assert data["compare"][-1].startswith("pdd md share ")
    assert data["pool"]["tokens"] >= 2 * data["pool"]["working_set_tokens"]
    # PDD's RLD is an eighth of MD, as the servers themselves report (requests, and KV pool
    # beside SGLang's decode reservation: what sim --calibrate sizes its RLD by); same-DC PD's
    # decoder is as large as MD.
    pool = data["pool"]["tokens"]
    rld_args = list(relay_capacity_args(("--max-total-tokens", str(pool)), RELAY_FRACTION))
    rld_pool = int(flag_value(rld_args, "--max-total-tokens") or 0)
    reserve = {"relay_kv_reserve": 512}  # SGLang's num_reserved_decode_tokens
    pdd, same = data["capacity"], data["capacity_by_group"]["same-dc"]
    assert pdd == {"relay": 8, "main": 64, "relay_kv_pool": rld_pool, **reserve}, pdd
    assert same == {"relay": 64, "main": 64, "relay_kv_pool": pool, **reserve}, same
    # The router's estimates after each pass are in the report; P -> MD taught it the KV size.
    learnt = data["router_estimates"]["naive cross-DC PD"]["wan"]
    assert learnt["kv_bytes_per_token"] == 1024, learnt  # tiny model, float32
    assert data["model"]["kv_bytes_per_token"] == 1024, data["model"]  # what the servers ran
    for name in ("live.md", "live.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| PDD |" in (tmp_path / "live.md").read_text()


def test_the_report_of_a_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(name: str, ttft: float, relay: int, main_: int, mode: str | None) -> Run:
        path = "P->RLD->MD" if main_ else "P->RLD"
        records = [Record(100, 90, float(i), relay + main_, ttft, ttft + 0.05 * (relay + main_ - 1),
                          path, relay_tokens=relay, main_tokens=main_, handoff_mode=mode)
                   for i in range(10)]  # fmt: skip
        return Run(name, records, wall_s=60.0, cores={"P": 0.5, "MD": 0.25})

    runs = {
        "same-DC PD": {0.1: run("same-DC PD", 2.0, 200, 0, None),
                       0.2: run("same-DC PD", 4.0, 200, 0, None)},
        "PDD": {0.1: run("PDD", 1.0, 20, 180, "extend"), 0.2: run("PDD", 2.0, 20, 180, "extend")},
    }  # fmt: skip
    outputs = {n: {r: [[1, 2]] * 10 for r in (0.1, 0.2)} for n in runs}
    summaries, lines = report(runs, outputs, Sla(3.0, 0.5), "t", {"args": {}}, tmp_path)
    assert lines == ["pdd md share 0.900 rld share 0.100 ttft p99 ratio 0.500 goodput ratio 2.000"]
    assert summaries["PDD"]["handoffs_extend"] == 10 and summaries["PDD"]["same_output"] == 1.0
    data = json.loads((tmp_path / "live.json").read_text())
    assert data["sla_goodput_rps"] == {"same-DC PD": 0.1, "PDD": 0.2}
    assert set(data["sweep"]["PDD"]) == {"0.1", "0.2"} and len(data["runs"]["PDD"]) == 10
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1] == lines[0]  # the run's last line
    md = (tmp_path / "live.md").read_text()
    assert "## SLA goodput" in md
    assert "cores used: P 0.50, MD 0.25; TPOT P50 by path: P->RLD->MD 0.050 s (10)" in md
    assert summaries["PDD"]["cores_MD"] == 0.25
    # The must-show rows this run can check (no cross-DC pass here: those rows are left out).
    checked = {c["name"]: (round(c["value"], 3), c["met"]) for c in data["criteria"]}
    assert checked == {
        "PDD: MD's share of output tokens": (0.9, True),
        "PDD: RLD's share of output tokens": (0.1, True),
        "PDD: failed requests": (0.0, True),
        "PDD: outputs equal to the first deployment's": (1.0, True),
        "TTFT P99: PDD / same-DC PD": (0.5, True),
        "E2E P50: PDD / same-DC PD": (round(10.95 / 11.95, 3), True),
        "E2E per request, median of PDD / same-DC PD": (round(10.95 / 11.95, 3), True),
        "SLA goodput: PDD / same-DC PD": (2.0, True),
    }, checked
    assert "## What PDD must show, at 0.1 req/s" in md
    assert "## What PDD must show, at 0.2 req/s" in md  # every rate's, the first in "criteria"
    at_02 = {c["name"]: round(c["value"], 3) for c in data["criteria_by_rate"]["0.2"]}
    assert at_02["TTFT P99: PDD / same-DC PD"] == 0.5 and len(at_02) == len(checked)
    assert data["criteria_by_rate"]["0.1"] == data["criteria"]
