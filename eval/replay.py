"""Replays trace requests against a `send` callable: open loop at a rate, or closed loop.

Why abstract `send`: the same pacing, bookkeeping and stopping serve a live HTTP client, a
fake in tests, or anything else that takes a TraceRequest and returns a result or raises.

Modes (exactly one):
- `speed`: open loop on the trace's own clock, arrival_s / speed (2.0 = twice as fast);
- `rate`: open loop at a fixed rate, request i due at i / rate seconds;
- `concurrency`: closed loop, that many requests in flight, the next one sent when one ends.
Open loop runs `max_in_flight` worker threads; when all are busy, due requests wait and start
late (start_s - scheduled_s shows it). Every wait is bounded: a send still running after
`timeout_s` is recorded as timed out (its thread is abandoned, and in closed loop keeps its slot
until it returns, so the concurrency is never exceeded); Ctrl-C or `stop` ends the run: nothing
more is sent, in-flight requests get `grace_s` to finish, the rest are marked as not sent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdd.eval.workload import TraceRequest

NOT_SENT = "not sent: stopped"
ABANDONED = "stopped while in flight"


@dataclass
class ReplayResult:
    """One request's outcome; times in seconds from the start of the run."""

    index: int
    request: TraceRequest
    scheduled_s: float | None  # when it was due (open loop); None in closed loop
    start_s: float | None = None
    end_s: float | None = None
    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def latency_s(self) -> float | None:
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s


def schedule(
    requests: Sequence[TraceRequest], rate: float | None = None, speed: float | None = None
) -> list[float]:
    """Due times from the run's start: i / rate, or the trace's arrivals / speed."""
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        return [i / rate for i in range(len(requests))]
    if speed is None or speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    first = requests[0].arrival_s if requests else 0.0
    return [(r.arrival_s - first) / speed for r in requests]


class _Run:
    def __init__(
        self,
        requests: Sequence[TraceRequest],
        send: Callable[[TraceRequest], Any],
        due: list[float] | None,
        workers: int,
        timeout_s: float,
        stop: threading.Event,
        log: Callable[[str], None],
    ) -> None:
        self.send = send
        self.due = due
        self.workers = workers
        self.timeout_s = timeout_s
        self.stop = stop
        self.log = log
        self.results = [
            ReplayResult(i, r, None if due is None else due[i]) for i, r in enumerate(requests)
        ]
        self.cond = threading.Condition()
        self.todo: queue.Queue[int | None] = queue.Queue()
        self.in_flight: dict[int, float] = {}  # index -> start
        self.done = 0
        self.errors = 0
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _finish(self, res: ReplayResult, value: Any, error: str | None) -> None:
        """Records an outcome under the lock, unless one was recorded already (timed out)."""
        if res.end_s is not None:
            return
        res.end_s, res.value, res.error = self.now(), value, error
        self.done += 1
        self.errors += error is not None
        self.cond.notify_all()

    def worker(self) -> None:
        while not self.stop.is_set():
            try:
                index = self.todo.get(timeout=0.2)
            except queue.Empty:
                continue
            if index is None:
                return
            res = self.results[index]
            with self.cond:
                if self.stop.is_set():  # checked under the lock that marks unsent requests
                    return
                res.start_s = self.now()
                self.in_flight[index] = res.start_s
            value: Any = None
            error: str | None = None
            try:
                value = self.send(res.request)
            except Exception as err:  # a failed request is a result, not the end of the run
                error = f"{type(err).__name__}: {err}"
            with self.cond:
                self.in_flight.pop(index, None)
                self._finish(res, value, error)

    def dispatch(self) -> None:
        """Open loop: puts each request on the queue when it is due; then one stop per worker."""
        assert self.due is not None
        for index, due in enumerate(self.due):
            while (wait := due - self.now()) > 0:
                if self.stop.wait(min(wait, 0.5)):
                    return
            self.todo.put(index)
        for _ in range(self.workers):
            self.todo.put(None)

    def expire(self) -> None:
        """Marks in-flight sends older than timeout_s as timed out (under the lock)."""
        now = self.now()
        for index, start in list(self.in_flight.items()):
            if now - start > self.timeout_s:
                self._finish(self.results[index], None, f"timed out after {self.timeout_s:g} s")

    def progress(self, total: int) -> str:
        return (
            f"replay: {self.done}/{total} done, {self.errors} errors, "
            f"{len(self.in_flight)} in flight, {self.now():.1f} s"
        )


def replay(
    requests: Sequence[TraceRequest],
    send: Callable[[TraceRequest], Any],
    *,
    rate: float | None = None,
    speed: float | None = None,
    concurrency: int | None = None,
    max_in_flight: int = 256,
    timeout_s: float = 600.0,
    progress_every: int = 100,
    progress_s: float = 10.0,
    grace_s: float = 10.0,
    stop: threading.Event | None = None,
    log: Callable[[str], None] = print,
) -> list[ReplayResult]:
    """Sends every request, paced as asked; results in request order (see the module doc).

    Progress goes to `log` every `progress_every` finished requests or `progress_s` seconds.
    """
    if sum(x is not None for x in (rate, speed, concurrency)) != 1:
        raise ValueError("give exactly one of rate, speed, concurrency")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if max_in_flight < 1 or timeout_s <= 0:
        raise ValueError("max_in_flight must be >= 1 and timeout_s > 0")
    stop = stop or threading.Event()
    total = len(requests)
    due = None if concurrency is not None else schedule(requests, rate, speed)
    workers = max(1, min(concurrency or max_in_flight, total))
    run = _Run(requests, send, due, workers, timeout_s, stop, log)
    if due is None:
        for index in range(total):
            run.todo.put(index)
        for _ in range(workers):
            run.todo.put(None)
    else:
        threading.Thread(target=run.dispatch, name="replay-dispatch", daemon=True).start()
    for k in range(workers):
        threading.Thread(target=run.worker, name=f"replay-{k}", daemon=True).start()

    shown_done, shown_at = 0, 0.0
    try:
        while True:
            line = None
            with run.cond:
                if run.done >= total or stop.is_set():
                    break
                run.cond.wait(timeout=0.2)
                run.expire()
                if run.done - shown_done >= progress_every or run.now() - shown_at >= progress_s:
                    line = run.progress(total)
                    shown_done, shown_at = run.done, run.now()
            if line is not None:
                log(line)  # outside the lock: a slow terminal must not hold up the workers
    except KeyboardInterrupt:
        log("replay: interrupted; stopping")
    stopped = run.done < total
    stop.set()
    if stopped:
        _wind_down(run, grace_s)
    if stopped or shown_done < total:  # the last progress line may already say it all
        log(run.progress(total) + (" (stopped)" if stopped else ""))
    return run.results


def _wind_down(run: _Run, grace_s: float) -> None:
    """After a stop: in-flight sends get grace_s; then every open result gets its reason."""
    deadline = time.monotonic() + grace_s
    try:
        with run.cond:
            while run.in_flight and (left := deadline - time.monotonic()) > 0:
                run.cond.wait(timeout=min(left, 0.2))
    except KeyboardInterrupt:
        pass  # a second Ctrl-C: no more grace
    with run.cond:
        for res in run.results:
            if res.end_s is None:
                run._finish(res, None, ABANDONED if res.start_s is not None else NOT_SENT)
