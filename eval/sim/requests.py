"""The simulator's requests: what arrives when, how long its prompt is, how much of it P has
cached and how many tokens it asks for; read from any trace-like object, or generated for
standalone runs (the full agentic generator lives in pdd.eval.workload)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = 0  # P-side prefix hit
    output_tokens: int = 1  # including token 0, which P computes
    # MD's prefix hit when known (a replayed live request: what MD lacked and was sent); None:
    # the simulator's model (simulation.Simulation.md_cached)
    md_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("a request needs >= 1 prompt token and >= 1 output token")
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError("need 0 <= cached_tokens <= prompt_tokens")
        md = self.md_cached_tokens
        if md is not None and not 0 <= md <= self.prompt_tokens:
            raise ValueError("need 0 <= md_cached_tokens <= prompt_tokens")


_FIELDS = {
    "arrival_s": ("arrival_s", "arrival", "t", "time_s"),
    "prompt_tokens": ("prompt_tokens", "input_tokens", "prompt_len"),
    "cached_tokens": ("cached_tokens", "prefix_hit_tokens", "hit_tokens", "cached"),
    "output_tokens": ("output_tokens", "max_new_tokens", "output_len"),
}


def as_sim_request(obj: Any) -> SimRequest:
    """A SimRequest from any object (or dict) with arrival, prompt, cached and output fields."""
    if isinstance(obj, SimRequest):
        return obj
    get = obj.get if isinstance(obj, dict) else (lambda k: getattr(obj, k, None))
    values: dict[str, Any] = {}
    for name, aliases in _FIELDS.items():
        found = next((v for v in map(get, aliases) if v is not None), None)
        if found is None and name != "cached_tokens":
            raise ValueError(f"request {obj!r} has no {name}")
        values[name] = found or 0
    prompt = int(values["prompt_tokens"])
    cached = min(int(values["cached_tokens"]), prompt)
    return SimRequest(float(values["arrival_s"]), prompt, cached, int(values["output_tokens"]))


def poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def fixed_requests(
    n: int, rate: float, prompt: int, hit: float, output: int, seed: int = 0
) -> list[SimRequest]:
    """Poisson arrivals of identical requests: `prompt` tokens, a `hit` fraction cached."""
    rng = random.Random(seed)
    cached = min(prompt, round(prompt * hit))
    return [SimRequest(t, prompt, cached, output) for t in poisson_times(n, rate, rng)]


def agentic_requests(
    n: int,
    rate: float,
    seed: int = 0,
    *,
    prompt: tuple[int, int] = (16_000, 96_000),
    output: tuple[int, int] = (200, 2000),
    singular: float = 0.035,
) -> list[SimRequest]:
    """A skewed agentic mix (the paper's shape): 75% of requests hit 95-100%, 20% hit 70-95%,
    5% a low-hit tail (0-50%), mean ~90%; `singular` of them are long-input, short-output
    (1-16 tokens), low-hit requests."""
    rng = random.Random(seed)
    out = []
    for t in poisson_times(n, rate, rng):
        length = round(math.exp(rng.uniform(math.log(prompt[0]), math.log(prompt[1]))))
        gen = round(math.exp(rng.uniform(math.log(output[0]), math.log(output[1]))))
        u = rng.random()
        if u < singular:
            hit, gen = rng.uniform(0.0, 0.3), rng.randint(1, 16)
        elif u < 0.75:
            hit = rng.uniform(0.95, 1.0)
        elif u < 0.95:
            hit = rng.uniform(0.7, 0.95)
        else:
            hit = rng.uniform(0.0, 0.5)
        out.append(SimRequest(t, length, min(length, round(length * hit)), gen))
    return out


def rescale(requests: Sequence[Any], rate: float) -> list[SimRequest]:
    """The same requests with arrival times stretched to a mean rate of `rate` per second."""
    reqs = sorted((as_sim_request(r) for r in requests), key=lambda r: r.arrival_s)
    if len(reqs) < 2:
        return reqs
    t0 = reqs[0].arrival_s
    span = reqs[-1].arrival_s - t0
    if span <= 0:
        return reqs
    k = (len(reqs) - 1) / rate / span
    return [replace(r, arrival_s=(r.arrival_s - t0) * k) for r in reqs]
