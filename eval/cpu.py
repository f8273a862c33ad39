"""CPU that processes used: a server's whole process group, or only its processes of one title
(SGLang names each of its processes, e.g. `sglang::scheduler`), sampled from /proc."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

CLK_TCK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.2
SCHEDULER_TITLE = "sglang::scheduler"  # SGLang's process title for a scheduler


@dataclass(frozen=True)
class Watched:
    """The processes of one server's process group, or only those whose title starts so."""

    pgid: int
    title: str = ""


def cpu_s(w: Watched) -> float:
    """CPU seconds (user + system) so far of the live processes `w` names."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != w.pgid:  # fields from the state on: state ppid pgrp ...
                continue
            if w.title:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if not f.read().startswith(w.title.encode()):
                        continue
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def cpu_by_part(pgids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process group."""
    return {name: cpu_s(Watched(pgid)) for name, pgid in pgids.items()}


class CpuSampler(threading.Thread):
    """CPU seconds of each watched set of processes, sampled every SAMPLE_S."""

    def __init__(self, watched: dict[str, Watched]) -> None:
        super().__init__(daemon=True)
        self.watched = watched
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), {k: cpu_s(w) for k, w in self.watched.items()}))
            if self.stop.wait(SAMPLE_S):
                return

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Cores each watched set used over the sampled span that covers [start, end]."""
        before = max((s for s in self.samples if s[0] <= start), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= end), default=self.samples[-1])
        dt = max(after[0] - before[0], 1e-9)
        return {k: (after[1][k] - before[1][k]) / dt for k in self.watched}
