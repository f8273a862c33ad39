"""`python -m pdd.eval live`, short: a small agentic trace through the four deployments on the
testbed with the tiny model. Real servers, real WAN; checks what the report says."""

from __future__ import annotations

import json
from pathlib import Path

from pdd.eval.__main__ import main
from tests.marks import needs_root


@needs_root
def test_a_short_live_run_reports_all_four_deployments(tiny_model: Path, tmp_path: Path) -> None:
    rc = main(["live", "--model", str(tiny_model), "--requests", "10", "--scale", "0.01",
               "--max-new", "24", "--concurrency", "2", "--rate-mbit", "50",
               "--out", str(tmp_path)])  # fmt: skip
    data = json.loads((tmp_path / "live.json").read_text())
    s = data["summaries"]
    assert rc == 0, s
    names = ["same-DC PD", "naive cross-DC PD", "cross-DC PD + decode cache", "PDD"]
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
    assert {r["path"] for r in runs["PDD"]} <= {"P->RLD", "P->MD", "P->RLD->MD"}
    # The router's estimates after each pass are in the report; P -> MD taught it the KV size.
    learnt = data["router_estimates"]["naive cross-DC PD"]["wan"]
    assert learnt["kv_bytes_per_token"] == 1024, learnt  # tiny model, float32
    assert data["model"]["kv_bytes_per_token"] == 1024, data["model"]  # what the servers ran
    for name in ("live.md", "live.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| PDD |" in (tmp_path / "live.md").read_text()
