"""Prints the modules that held a worker longest (set-up, calls and tear-down together), after
pytest's own slowest tests: what to share or trim when the suite grows too long."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

SHOWN = 15


def module_seconds(reports: Iterable[Any]) -> Counter[str]:
    """Seconds per test module, summed over every phase of every report that has a duration."""
    seconds: Counter[str] = Counter()
    for report in reports:
        duration = getattr(report, "duration", None)
        nodeid = getattr(report, "nodeid", "")
        if getattr(report, "when", None) in ("setup", "call", "teardown") and duration is not None:
            seconds[nodeid.split("::", 1)[0]] += duration
    return seconds


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reports = [r for rs in terminalreporter.stats.values() for r in rs]
    seconds = module_seconds(reports)
    if not seconds:
        return
    terminalreporter.write_sep("=", f"slowest {min(SHOWN, len(seconds))} modules")
    for module, s in seconds.most_common(SHOWN):
        terminalreporter.write_line(f"{s:8.1f}s {module}")
    terminalreporter.write_line(f"{sum(seconds.values()):8.1f}s all {len(seconds)} modules")
