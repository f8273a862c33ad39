"""`python -m pdd.eval faults`, short: a WAN cut, a bandwidth collapse, an MD crash, an RLD
crash and an overload burst on the testbed (tiny model, real servers). No request may be lost or
wrong, and the deployment serves again afterwards; failures must carry a reason."""

from __future__ import annotations

import json
from pathlib import Path

from pdd.eval.__main__ import main
from pdd.eval.faults import first_difference
from tests.marks import needs_root


@needs_root
def test_faults_lose_nothing(tiny_model: Path, tmp_path: Path) -> None:
    rc = main(["faults", "--model", str(tiny_model), "--requests", "12", "--concurrency", "4",
               "--scenarios", "cut,collapse,md-kill,rld-kill,overload", "--fault-s", "4",
               "--net", "10.233", "--out", str(tmp_path)])  # fmt: skip
    data = json.loads((tmp_path / "faults.json").read_text())
    rows = {r["scenario"]: r for r in data["rows"]}
    assert list(rows) == ["cut", "collapse", "md-kill", "rld-kill", "overload"]
    for name, row in rows.items():
        assert row["sent"] == 12 and row["completed"] + row["failed"] == 12, row
        assert row["lost"] == 0 and row["wrong"] == 0 and row["recovered"], row
        assert row["released"], row  # every server idle again: no KV stranded by the fault
        assert row["completed"] >= 8, row  # at most 4 (the concurrency) are in flight then
        for outcome in data["outcomes"][name]:
            assert outcome["kind"] != "failed" or len(outcome["reason"]) > 10, outcome
    # A crashed decode server fails nothing it was serving: the other tier finishes those.
    assert rows["md-kill"]["failed"] == 0 and rows["rld-kill"]["failed"] == 0, rows
    # Overload: 12 clients at once, 8 admitted; the rest are refused with Retry-After and get in
    # later.
    assert rows["overload"]["refused"] > 0 and rows["overload"]["completed"] == 12, rows
    assert (tmp_path / "faults.png").stat().st_size > 10_000
    assert rc == 0


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a shorter output is wrong too
    assert first_difference([], []) is None
