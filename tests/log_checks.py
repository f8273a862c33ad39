"""Tracebacks in a server's log, less the one SGLang logs harmlessly under load.

SGLang's launcher, once its server has warmed up, asks it to freeze the GC (`/freeze_gc`, a 10 s
timeout) and logs a timeout's traceback as a warning: on a 2-core machine starting several
servers at once it times out, and the server serves as before (a frozen GC only spares later
collections of start-up objects). Every other traceback fails the tests that read logs."""

from __future__ import annotations

import re

HARMLESS = ("post-warmup freeze_gc failed",)
_ENTRY = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ", re.M)  # SGLang's log line prefix


def tracebacks(log: str) -> list[str]:
    """The log's entries (a timestamped line and the lines up to the next one) that hold a
    traceback, except those whose first line is a HARMLESS warning."""
    starts = [m.start() for m in _ENTRY.finditer(log)]
    bounds = zip([0, *starts], [*starts, len(log)], strict=True)
    entries = [log[a:b] for a, b in bounds]
    return [e for e in entries if "Traceback" in e and not _harmless(e)]


def _harmless(entry: str) -> bool:
    first = entry.split("\n", 1)[0]
    return any(h in first for h in HARMLESS)
