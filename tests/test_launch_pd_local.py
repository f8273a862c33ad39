"""`python -m pdd.launch.pd_local up/status/down`: a real P + D + router, then nothing left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdd.launch.pd_local import STATE_FILE, generate
from pdd.launch.process import group_alive

CLI = [sys.executable, "-m", "pdd.launch.pd_local"]


def cli(run_dir: Path, *args: str, timeout: float = 400) -> str:
    out = subprocess.run(
        [*CLI, "--run-dir", str(run_dir), *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def group_cmdlines(pgid: int) -> list[str]:
    """The command lines of the live processes in process group `pgid`."""
    lines = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                lines.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return lines


def test_up_serves_with_forked_schedulers_then_down_leaves_no_process(
    tiny_model: Path, tmp_path: Path
) -> None:
    print(cli(tmp_path, "up", "--model", str(tiny_model)))
    state = json.loads((tmp_path / STATE_FILE).read_text())
    groups = state["groups"]
    try:
        assert set(groups) == {"prefill", "decode", "router"}
        assert cli(tmp_path, "status").count("running") == 3
        # On CPU a server's scheduler and detokenizer are forked from it (pdd.srt.cpu_fork), not
        # spawned: a spawned child runs multiprocessing's spawn_main.
        for role in ("prefill", "decode"):
            lines = group_cmdlines(groups[role])
            assert len(lines) >= 3, lines
            assert not [line for line in lines if "spawn_main" in line], lines
        out = generate(
            state["url"],
            {
                "input_ids": list(range(5, 40)),
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            },
        )
        assert len(out["output_ids"]) == 8
    finally:
        print(cli(tmp_path, "down"))
    assert not [name for name, pgid in groups.items() if group_alive(pgid)]
    assert not (tmp_path / STATE_FILE).exists()
    assert "no deployment recorded" in cli(tmp_path, "status")
