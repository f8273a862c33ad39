"""tests.log_checks: which tracebacks in a server log fail a test."""

from __future__ import annotations

from tests.log_checks import tracebacks

TIMEOUT = """Traceback (most recent call last):
  File "connectionpool.py", line 540, in _make_request
TimeoutError: timed out

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "adapters.py", line 696, in send
requests.exceptions.ReadTimeout: Read timed out. (read timeout=10)
"""


def test_only_sglangs_freeze_gc_warning_is_harmless() -> None:
    head = "[pdd] forked from the pre-imported launcher\n"
    ok = "[2026-12-08 01:25:03] End of disaggregation warmup\n"
    warned = f"[2026-12-08 01:25:14] post-warmup freeze_gc failed\n{TIMEOUT}"
    log = head + ok + warned + ok
    assert tracebacks(log) == []
    failed = f"[2026-12-08 01:25:20] Scheduler hit an exception\n{TIMEOUT}"
    assert tracebacks(log + failed) == [failed]
    # A traceback before any timestamped line (or in a log without them) counts too.
    assert tracebacks(TIMEOUT + ok) == [TIMEOUT]
