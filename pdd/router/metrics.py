"""Router counters, rendered as Prometheus text."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PREFIX = "pdd_router_"
HELP = {
    "requests_total": "Finished requests by the path that served them",
    "handoffs_total": "Handoffs from RLD to MD by mode",
    "relay_tokens_total": "Output tokens the clients received from RLD",
    "main_tokens_total": "Output tokens the clients received from MD",
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
}


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return "{" + inner + "}"


@dataclass
class Metrics:
    counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = field(default_factory=Counter)
    active: int = 0

    def inc(self, name: str, value: int = 1, **labels: str) -> None:
        assert name in HELP, name
        self.counters[(name, tuple(sorted(labels.items())))] += value

    def get(self, name: str, **labels: str) -> int:
        return self.counters[(name, tuple(sorted(labels.items())))]

    def snapshot(self) -> dict[str, int]:
        return {f"{n}{_labels(lb)}": v for (n, lb), v in sorted(self.counters.items())}

    def render(self, malformed: int = 0) -> str:
        lines = []
        for name, help_text in HELP.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} counter"]
            rows = sorted((lb, v) for (n, lb), v in self.counters.items() if n == name)
            if not rows:
                lines.append(f"{PREFIX}{name} 0")
            lines += [f"{PREFIX}{name}{_labels(lb)} {v}" for lb, v in rows]
        values = {"active_requests": self.active, "control_malformed": malformed}
        for name, help_text in GAUGES.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge"]
            lines.append(f"{PREFIX}{name} {values[name]}")
        return "\n".join(lines) + "\n"
