"""Router counters, gauges and latency histograms, rendered as Prometheus text."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "pdd_router_"
Labels = tuple[tuple[str, str], ...]
HELP = {
    "requests_total": "Finished requests by the path that served them",
    "handoffs_total": "Handoffs from RLD to MD by mode",
    "relay_tokens_total": "Output tokens the clients received from RLD",
    "main_tokens_total": "Output tokens the clients received from MD",
    "wan_kv_bytes_total": "KV bytes MD received across the WAN, as its READYs report them",
    "control_bytes_total": "Encoded control-message bytes by direction",
    "catchup_chunks_total": "Catch-Up chunks sent to MD",
    "resumes_total": "Requests one side finished after the other failed while feeding the "
    "client, by the side that took over",
    "md_cancels_total": "Requests MD was told to drop, by reason",
    "errors_total": "Errors by kind",
    "timeouts_total": "Waits that ran out, by what was awaited (a tier's call, MD's READY or "
    "ACK, the whole request, a kept transfer to MD)",
    "prefix_cached_tokens_total": "Prompt tokens found in the radix cache, by side (P or MD)",
    "prefix_prompt_tokens_total": "Prompt tokens looked up in the radix cache, by side",
}
GAUGES = {
    "active_requests": "Requests in flight",
    "control_malformed": "Malformed control messages",
    "instance_load": "Requests on each instance, as the server reports them (plus this "
    "router's sent since), by tier and instance",
    "instance_up": "1 while the instance passes its health checks, by tier and instance",
    "wan_bytes_per_second": "The WAN bandwidth to each MD the router has learnt from transfers",
    "wan_overhead_seconds": "The fixed cost per transfer to each MD the router has learnt",
}
# Seconds; TTFT spans a same-datacenter prefill to a WAN-bound one, TPOT a fast GPU to a CPU.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "ttft_seconds": (
        "Time to the first output token, by path",
        (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
    ),
    "tpot_seconds": (
        "Mean time per output token after the first, per request, by path",
        (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
    ),
}


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return "{" + inner + "}"


def _key(name: str, labels: dict[str, str]) -> tuple[str, Labels]:
    return name, tuple(sorted(labels.items()))


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; last: +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: Labels) -> list[str]:
        out, running = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True):
            running += n
            out.append(f"{name}_bucket{_labels((*labels, ('le', le)))} {running}")
        out.append(f"{name}_sum{_labels(labels)} {self.total}")
        out.append(f"{name}_count{_labels(labels)} {running}")
        return out


@dataclass
class Metrics:
    counters: Counter[tuple[str, Labels]] = field(default_factory=Counter)
    histograms: dict[tuple[str, Labels], Histogram] = field(default_factory=dict)
    active: int = 0

    def inc(self, name: str, value: int = 1, **labels: str) -> None:
        assert name in HELP, name
        self.counters[_key(name, labels)] += value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = _key(name, labels)
        if key not in self.histograms:
            self.histograms[key] = Histogram(HISTOGRAMS[name][1])
        self.histograms[key].observe(value)

    def get(self, name: str, **labels: str) -> int:
        return self.counters[_key(name, labels)]

    def snapshot(self) -> dict[str, int]:
        return {f"{n}{_labels(lb)}": v for (n, lb), v in sorted(self.counters.items())}

    def render(self, gauges: dict[str, list[tuple[Labels, float]]]) -> str:
        """Every metric; `gauges` holds the values of GAUGES known only to the caller."""
        lines = []
        for name, help_text in HELP.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} counter"]
            rows = sorted((lb, v) for (n, lb), v in self.counters.items() if n == name)
            if not rows:
                lines.append(f"{PREFIX}{name} 0")
            lines += [f"{PREFIX}{name}{_labels(lb)} {v}" for lb, v in rows]
        own: list[tuple[Labels, float]] = [((), float(self.active))]
        values = {"active_requests": own, **gauges}
        for name, help_text in GAUGES.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge"]
            lines += [f"{PREFIX}{name}{_labels(lb)} {v:g}" for lb, v in values.get(name, [])]
        for name, (help_text, _) in HISTOGRAMS.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram"]
            for (n, lb), hist in sorted(self.histograms.items(), key=lambda kv: kv[0]):
                if n == name:
                    lines += hist.lines(f"{PREFIX}{name}", lb)
        return "\n".join(lines) + "\n"
