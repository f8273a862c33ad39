"""A testbed's name is held by the process that brought it up: another process's `up` or `down`
(which stops every process in its namespaces) is refused, naming the holder, instead of taking
down a run that is still serving."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pdd.launch import netns, testbed_lock
from pdd.launch.testbed import Testbed
from pdd.launch.testbed_lock import TestbedInUse
from tests.marks import needs_root

HOLDER = """
import sys, time
from pathlib import Path
from pdd.launch import testbed_lock
testbed_lock.LOCK_DIR = Path(sys.argv[1])
testbed_lock.hold(sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


@contextmanager
def held_elsewhere(lock_dir: Path, name: str) -> Iterator[subprocess.Popen[str]]:
    """Another process holding `name` until the block ends (then it is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_dir), name],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_name_held_by_another_process_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(testbed_lock, "LOCK_DIR", tmp_path)
    with held_elsewhere(tmp_path, "pddtlock") as other:
        with pytest.raises(TestbedInUse, match=f"testbed pddtlock is in use by pid {other.pid} "):
            testbed_lock.hold("pddtlock")
        testbed_lock.hold("pddtother")  # another name is free
        testbed_lock.release("pddtother")
    testbed_lock.hold("pddtlock")  # the holder exited: its lock went with it
    testbed_lock.hold("pddtlock")  # this process holds it already
    try:
        refused = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path), "pddtlock"],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        assert refused.returncode != 0, refused.stdout
        assert "TestbedInUse: testbed pddtlock is in use by pid" in refused.stderr
    finally:
        testbed_lock.release("pddtlock")
    with held_elsewhere(tmp_path, "pddtlock"):  # released: another process takes it
        pass


@needs_root
def test_down_leaves_a_testbed_another_process_holds_alone() -> None:
    name = "pddtlock"
    ns = f"{name}-a"
    Testbed(name).down()
    netns.run(["ip", "netns", "add", ns])
    inside = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
    try:
        with held_elsewhere(testbed_lock.LOCK_DIR, name) as other:
            with pytest.raises(TestbedInUse, match=f"in use by pid {other.pid} "):
                Testbed(name).down()
            time.sleep(0.2)
            assert inside.poll() is None and netns.exists(ns), "down took the testbed anyway"
        assert f"namespace {ns}" in Testbed(name).down()  # the holder is gone: down works
        inside.wait(timeout=10)  # stopped with its namespace
        assert not netns.exists(ns)
    finally:
        if inside.poll() is None:
            inside.kill()
        if netns.exists(ns):
            netns.run(["ip", "netns", "del", ns])
