"""The per-module time summary the suite prints (tests/module_times.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.module_times import module_seconds


def report(nodeid: str, when: str, duration: float) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)


def test_a_modules_phases_add_up_and_other_reports_do_not_count() -> None:
    reports = [
        report("tests/test_a.py::test_x", "setup", 60.0),
        report("tests/test_a.py::test_x", "call", 2.5),
        report("tests/test_a.py::test_y[p]", "call", 1.5),
        report("tests/test_a.py::test_y[p]", "teardown", 6.0),
        report("tests/test_b.py::test_z", "call", 3.0),
        SimpleNamespace(nodeid="tests/test_c.py", when=None, duration=9.0),  # a collect report
        "a warning entry without a duration",
    ]
    seconds = module_seconds(reports)
    assert seconds == {"tests/test_a.py": 70.0, "tests/test_b.py": 3.0}
    assert seconds.most_common(1) == [("tests/test_a.py", 70.0)]
