"""Reading server logs for leaks only once SGLang's idle leak check has run: pdd's servers log
`pdd.srt.idle.IDLE_CHECKED` when, fully idle after some work, they ran it. A fixed sleep would
pass without the check on a machine slow enough to still be busy."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdd.srt.idle import IDLE_CHECKED

WAIT_S = 60.0
MARKER = IDLE_CHECKED.split("%d")[-1]


def after_idle_checks(logs: Callable[[], dict[str, str]], timeout_s: float = WAIT_S
                      ) -> dict[str, str]:  # fmt: skip
    """`logs()`: each server's log from a point before its last work. Polls until every one
    shows the idle check ran after that point; returns them. Fails naming those that did not
    (still busy, or a decoder holding deferred KV releases, which skips the check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = logs()
        missing = sorted(name for name, text in got.items() if MARKER not in text)
        if not missing:
            return got
        assert time.monotonic() < deadline, f"no idle leak check within {timeout_s:g}s: {missing}"
        time.sleep(0.2)
