"""What the router learns from traffic to predict a path's cost: per MD, the KV bytes per token
and the WAN's bandwidth and fixed latency (from each READY: KV bytes and the time from feeding
MD to READY, less P's compute on P -> MD); P's prefill time per token and RLD's time per output
token (from their answers and streams). Recent observations weigh most, so estimates follow a
WAN that changes."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pdd.policy.path import transfer_seconds

ALPHA = 0.3  # weight of a new observation
WINDOW = 32  # the WAN fit weighs this many recent transfers
# The fit separates the fixed latency from the bandwidth only over transfers of different sizes:
# the largest at least this many times the smallest (a zero-byte READY counts as smallest).
MIN_SPREAD = 2.0
# A transfer this many times slower than predicted (once the fit has FIT_SAMPLES) is an outlier
# (a stall, P's queue) and left out, unless the next ones agree: then the link itself changed.
OUTLIER_FACTOR = 4.0
FIT_SAMPLES = 5
MAX_REJECTED = 2
# An estimate with no transfer for this long is stale: the router feeds MD a request that would
# have stayed on RLD, to measure the link again (a WAN that is not used is not learnt).
STALE_S = 60.0
# On P -> MD, P's estimated compute is subtracted from the time to READY; beyond this share of
# it, the estimate's error would swamp the WAN's part.
MAX_COMPUTE_SHARE = 0.25
# P -> MD's first token comes later than P's compute plus the KV's crossing: MD's admission and
# first step, the bootstrap's round trips, P's queue. The router adds a high quantile of what
# recent first tokens took beyond that prediction, so that its TTFT tail is what it plans for.
RESIDUAL_QUANTILE = 0.9
RESIDUAL_MIN_SAMPLES = 3
# Older residuals are forgotten: a residual that sends every request elsewhere would otherwise
# never be measured again.
RESIDUAL_TTL_S = 300.0


@dataclass
class Ewma:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x


@dataclass
class WanEstimate:
    """One MD's link: transfer time = overhead + bytes / bandwidth, a least-squares fit over the
    last WINDOW transfers, each weighing (1 - ALPHA) times the next newer one. Any time a
    transfer spends that does not grow with its size (queueing on P, MD's bootstrap, the round
    trips) lands in the overhead, not in the bandwidth, once sizes vary; until they do, the
    overhead is taken as 0, so the bandwidth is an underestimate that predicts transfers of the
    sizes seen."""

    kv_bytes_per_token: float | None = None
    prior_bytes_per_s: float | None = None  # used until a transfer was seen
    bytes_per_s: float | None = None
    overhead_s: float = 0.0
    samples: int = 0
    rejected: int = 0  # outliers in a row
    last_s: float | None = None  # when the latest transfer was observed (caller's clock)
    probe_s: float | None = None  # when the router last fed MD only to measure the link
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self) -> None:
        if self.bytes_per_s is None:
            self.bytes_per_s = self.prior_bytes_per_s

    def observe(self, kv_bytes: int, kv_tokens: int, seconds: float, now: float = 0.0) -> bool:
        """Learns one transfer; False when it was left out as an outlier."""
        if kv_tokens > 0 and kv_bytes > 0:
            self.kv_bytes_per_token = kv_bytes / kv_tokens
        if seconds <= 0:
            return True
        self.last_s = now
        bw = self.bytes_per_s
        predicted = self.overhead_s + max(kv_bytes, 0) / bw if bw else None
        slow = predicted is not None and seconds > OUTLIER_FACTOR * predicted
        if slow and self.samples >= FIT_SAMPLES and self.rejected < MAX_REJECTED:
            self.rejected += 1
            return False
        self.rejected = 0
        self.samples += 1
        self.recent.append((max(kv_bytes, 0), seconds))
        self._fit()
        return True

    def wants_probe(self, now: float) -> bool:
        """The estimate is stale (no transfer for STALE_S, nor a probe): the caller should feed
        MD one request to measure the link, and says so with `probed`."""
        if self.last_s is None:
            return False
        latest = max(self.last_s, self.probe_s or self.last_s)
        return now - latest > STALE_S

    def probed(self, now: float) -> None:
        self.probe_s = now

    def _fit(self) -> None:
        n = len(self.recent)
        w = [(1 - ALPHA) ** (n - 1 - i) for i in range(n)]
        x = [float(b) for b, _ in self.recent]
        y = [t for _, t in self.recent]
        overhead = 0.0
        if max(x) == 0:  # only fully cached prompts so far: their time is all fixed cost
            self.overhead_s = sum(wi * yi for wi, yi in zip(w, y, strict=True)) / sum(w)
            return
        if n >= 3 and max(x) >= MIN_SPREAD * min(x):
            sw = sum(w)
            mx = sum(wi * xi for wi, xi in zip(w, x, strict=True)) / sw
            my = sum(wi * yi for wi, yi in zip(w, y, strict=True)) / sw
            sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x, strict=True))
            sxy = sum(wi * (xi - mx) * (yi - my) for wi, xi, yi in zip(w, x, y, strict=True))
            if sxx > 0 and sxy > 0:
                # No transfer takes less than the fixed part; none takes a negative one.
                overhead = min(max(my - sxy / sxx * mx, 0.0), min(y))
        # The slope that fits best given that overhead (the least-squares one when unclamped).
        sxx0 = sum(wi * xi * xi for wi, xi in zip(w, x, strict=True))
        sxy0 = sum(wi * xi * (yi - overhead) for wi, xi, yi in zip(w, x, y, strict=True))
        self.overhead_s = overhead
        if sxx0 > 0 and sxy0 > 0:
            self.bytes_per_s = sxx0 / sxy0

    def transfer_s(self, suffix_tokens: int) -> float | None:
        return transfer_seconds(suffix_tokens, self.kv_bytes_per_token, self.bytes_per_s,
                                self.overhead_s)  # fmt: skip

    def to_dict(self) -> dict[str, float | int | None]:
        bw = self.bytes_per_s
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "mbit_per_s": None if bw is None else round(bw * 8 / 1e6, 3),
            "overhead_s": round(self.overhead_s, 4),
            "samples": self.samples,
            "rejected_in_a_row": self.rejected,
        }


@dataclass
class FirstTokenResidual:
    """One MD's recent (time, seconds) by which P -> MD first tokens missed their prediction."""

    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def observe(self, seconds: float, now: float) -> None:
        self.recent.append((now, seconds))

    def _live(self, now: float) -> list[float]:
        """The residuals younger than RESIDUAL_TTL_S."""
        return [x for t, x in self.recent if now - t <= RESIDUAL_TTL_S]

    def samples(self, now: float) -> int:
        return len(self._live(now))

    def value(self, now: float) -> float:
        """RESIDUAL_QUANTILE of the residuals younger than RESIDUAL_TTL_S (never below 0), or 0
        until there are RESIDUAL_MIN_SAMPLES of them."""
        live = sorted(self._live(now))
        if len(live) < RESIDUAL_MIN_SAMPLES:
            return 0.0
        rank = min(len(live) - 1, math.ceil(RESIDUAL_QUANTILE * len(live)) - 1)
        return max(live[rank], 0.0)


def relayed_direct_ttft(timings: dict[str, float]) -> float | None:
    """For a P -> RLD -> MD request, what P -> MD's first token would have taken: P's answer for
    RLD (its queue and compute) plus feeding MD to READY (MD's admission, the bootstrap, the KV
    crossing, READY's trip back), short of MD's first step only. Every relayed request so
    teaches the direct path's residual under the load of the moment: learnt from P -> MD
    requests alone, one slow first token would keep every request off P -> MD, and so unmeasured,
    for RESIDUAL_TTL_S."""
    done, sent, ready = (timings.get(k) for k in ("prefill_done", "prefill_md_sent", "ready"))
    if done is None or sent is None or ready is None or ready < sent:
        return None
    return done + ready - sent


def direct_wan_seconds(total_s: float, compute_s: float | None) -> float:
    """On P -> MD, the WAN's part of `total_s` (feeding P to MD's READY): what is left once P's
    compute is subtracted; 0 (learn no time) when that compute is unknown or more than
    MAX_COMPUTE_SHARE of the total. The estimate comes from P -> RLD's answers, fixed costs and
    queueing included: where it is a large part, its error would decide the bandwidth."""
    if compute_s is None or compute_s > MAX_COMPUTE_SHARE * total_s:
        return 0.0
    return total_s - compute_s


def wan_estimate(prior_mbit: float | None) -> WanEstimate:
    return WanEstimate(prior_bytes_per_s=prior_mbit * 1e6 / 8 if prior_mbit else None)


@dataclass
class PrefillSpeed:
    """P's seconds per uncached prompt token, from P's answers on paths whose KV stays in
    datacenter A (so no WAN time is in them)."""

    s_per_token: Ewma = field(default_factory=Ewma)
    min_tokens: int = 64  # shorter prompts say more about fixed costs than about compute

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= self.min_tokens and seconds > 0:
            self.s_per_token.add(seconds / tokens)

    def prefill_s(self, tokens: int) -> float | None:
        rate = self.s_per_token.value
        return None if rate is None else rate * tokens


@dataclass
class RelaySpeed:
    """RLD's seconds per output token, from the streams the router relays."""

    tpot_s: Ewma = field(default_factory=Ewma)
    min_tokens: int = 8  # shorter streams say more about TTFT than about decode speed

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens >= self.min_tokens and seconds > 0:
            self.tpot_s.add(seconds / (tokens - 1))

    def decode_s(self, max_new_tokens: int) -> float | None:
        tpot = self.tpot_s.value
        return None if tpot is None else tpot * max_new_tokens
