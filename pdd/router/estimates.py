"""What the router learns from traffic to predict a path's cost: per MD, the KV bytes per token
and the WAN's bandwidth and fixed latency (from each READY: KV bytes and the time from feeding
MD to READY, less P's compute on P -> MD); P's prefill time per token and RLD's time per output
token (from their answers and streams). Moving averages, so estimates follow a WAN that
changes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.policy.path import transfer_seconds

ALPHA = 0.3  # weight of a new observation
SMALL_TRANSFER = 64 << 10  # bytes: a transfer this small measures the fixed latency
LARGE_TRANSFER = 256 << 10  # bytes: one this large measures the bandwidth
# On P -> MD, P's estimated compute is subtracted from the time to READY; beyond this share of
# it, the estimate's error would swamp the WAN's part.
MAX_COMPUTE_SHARE = 0.25


@dataclass
class Ewma:
    value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - ALPHA) * self.value + ALPHA * x


@dataclass
class WanEstimate:
    """One MD's link: transfer time = overhead + bytes / bandwidth."""

    kv_bytes_per_token: float | None = None
    bytes_per_s: Ewma = field(default_factory=Ewma)
    overhead_s: Ewma = field(default_factory=Ewma)
    samples: int = 0

    def observe(self, kv_bytes: int, kv_tokens: int, seconds: float) -> None:
        if kv_tokens > 0 and kv_bytes > 0:
            self.kv_bytes_per_token = kv_bytes / kv_tokens
        if seconds <= 0:
            return
        self.samples += 1
        if kv_bytes <= SMALL_TRANSFER:
            self.overhead_s.add(seconds)
        elif kv_bytes >= LARGE_TRANSFER:
            fixed = min(self.overhead_s.value or 0.0, 0.8 * seconds)
            self.bytes_per_s.add(kv_bytes / (seconds - fixed))

    def transfer_s(self, suffix_tokens: int) -> float | None:
        return transfer_seconds(suffix_tokens, self.kv_bytes_per_token, self.bytes_per_s.value,
                                self.overhead_s.value or 0.0)  # fmt: skip

    def to_dict(self) -> dict[str, float | int | None]:
        bw, fixed = self.bytes_per_s.value, self.overhead_s.value
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "mbit_per_s": None if bw is None else round(bw * 8 / 1e6, 3),
            "overhead_s": None if fixed is None else round(fixed, 4),
            "samples": self.samples,
        }


def direct_wan_seconds(total_s: float, compute_s: float | None) -> float:
    """On P -> MD, the WAN's part of `total_s` (feeding P to MD's READY): what is left once P's
    compute is subtracted; 0 (learn no time) when that compute is unknown or more than
    MAX_COMPUTE_SHARE of the total. The estimate comes from P -> RLD's answers, fixed costs and
    queueing included: where it is a large part, its error would decide the bandwidth."""
    if compute_s is None or compute_s > MAX_COMPUTE_SHARE * total_s:
        return 0.0
    return total_s - compute_s


def wan_estimate(prior_mbit: float | None) -> WanEstimate:
    est = WanEstimate()
    if prior_mbit:
        est.bytes_per_s.add(prior_mbit * 1e6 / 8)
    return est


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
