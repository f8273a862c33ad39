"""The plugin's --pdd-* flags as SGLang's own launcher sees them (real `sglang.launch_server`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.launch.servers import device_env

LAUNCH = [sys.executable, "-m", "sglang.launch_server"]


def launch(
    args: list[str], timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        LAUNCH + args,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **device_env(), **(env or {})},
    )


def test_help_lists_pdd_flags() -> None:
    out = launch(["--help"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--pdd-role {prefill,relay,main}" in out.stdout
    assert "RelayDecode" in out.stdout


def test_a_role_without_its_mode_stops_the_server_naming_both(tiny_model: Path) -> None:
    """Every role and mode is checked in tests/test_flags.py; this shows SGLang's launcher runs
    that check and exits on it."""
    out = launch(["--model-path", str(tiny_model), "--pdd-role", "relay",
                  "--disaggregation-mode", "prefill"])  # fmt: skip
    assert out.returncode != 0
    assert "--pdd-role relay needs --disaggregation-mode decode" in out.stderr, out.stderr[-2000:]


# Each is started before anything else in every process of the server (a sitecustomize), as an
# SGLang upgrade would leave a function pdd hooks: removed, or with other parameters.
REMOVE_ON_IDLE = """
from sglang.srt.managers.scheduler import Scheduler
for klass in Scheduler.__mro__:
    if "on_idle" in vars(klass):
        delattr(klass, "on_idle")
"""
CHANGE_ON_IDLE = """
from sglang.srt.managers.scheduler import Scheduler
def on_idle(self, now=None):
    pass
Scheduler.on_idle = on_idle
"""
ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"


@pytest.mark.parametrize(
    ("change", "role", "named"),
    [(REMOVE_ON_IDLE, ["--pdd-role", "relay", "--disaggregation-mode", "decode"],
      f"{ON_IDLE}: not found"),
     (CHANGE_ON_IDLE, [], f"{ON_IDLE}: expected (self), found (self, now)")],
    ids=["removed-with-a-role", "changed-on-a-plain-server"],
)  # fmt: skip
def test_a_hook_target_that_changed_stops_the_server_naming_it(
    tiny_model: Path, tmp_path: Path, change: str, role: list[str], named: str
) -> None:
    (tmp_path / "sitecustomize.py").write_text(change)
    out = launch(["--model-path", str(tiny_model), *role], env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode != 0
    assert "pdd's SGLang hooks do not fit" in out.stderr, out.stderr[-2000:]
    assert named in out.stderr, out.stderr[-2000:]
