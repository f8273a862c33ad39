"""What the simulator is built from: chips, models and links, and presets for each.

A chip is described on the four axes that make heterogeneous PD worth it (compute, memory
capacity, memory bandwidth, interconnect bandwidth) plus a price in relative units (chip A = 1).
A model is what those axes are spent on: active parameters (compute per token), weight bytes
(memory read per decode step, memory held) and KV bytes per token (what crosses the WAN).
A link is the WAN between the datacenters: line rate, round-trip time and its jitter, and the
TCP window that caps what one transfer can reach over a long round trip.

The presets are stand-ins, not measurements of particular products: chip A is compute-heavy,
chip B memory-heavy and 25% dearer (the paper: 20-30%), the model is a 1T-class MoE whose KV per
token is the paper's own (4649 KB per 100 tokens in its handoff microbenchmark).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Chip:
    name: str
    tflops: float  # peak dense TFLOP/s
    mem_gb: float  # memory capacity, GB
    mem_bw_gbs: float  # memory bandwidth, GB/s
    interconnect_gbs: float  # what one chip sends to another instance (scale-out RDMA), GB/s
    price: float  # relative units: chip A = 1.0

    def __post_init__(self) -> None:
        if min(self.tflops, self.mem_gb, self.mem_bw_gbs, self.interconnect_gbs) <= 0:
            raise ValueError(f"chip {self.name}: every axis must be > 0")
        if self.price < 0:
            raise ValueError(f"chip {self.name}: price must be >= 0")


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float  # active parameters per token, billions (compute per token)
    weight_bytes: float  # all weights as stored
    kv_bytes_per_token: float
    total_params_b: float | None = None  # MoE: all experts; None: dense (= params_b)
    # Attention FLOPs per (query token, context token) pair, all layers: ~4 x layers x heads x
    # head_dim for standard attention.
    attn_flops_per_pair: float = 0.0

    def __post_init__(self) -> None:
        if self.params_b <= 0 or self.weight_bytes <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(f"model {self.name}: sizes must be > 0")
        if self.total_params_b is not None and self.total_params_b < self.params_b:
            raise ValueError(f"model {self.name}: total params below active params")

    @property
    def active_weight_bytes(self) -> float:
        """Weight bytes one token touches (MoE: its experts only)."""
        total = self.total_params_b or self.params_b
        return self.weight_bytes * self.params_b / total

    def weights_read(self, tokens: float) -> float:
        """Weight bytes a forward over `tokens` tokens reads. MoE: each token picks an
        `active` fraction of the experts, so `tokens` tokens touch 1 - (1 - active)^tokens
        of the weights (the expectation for independent picks); dense: all of them."""
        if tokens <= 0:
            return 0.0
        active = self.params_b / (self.total_params_b or self.params_b)
        if active >= 1:
            return self.weight_bytes
        return self.weight_bytes * -math.expm1(tokens * math.log1p(-active))

    def flops(self, tokens: float, pairs: float) -> float:
        """FLOPs of a forward over `tokens` new tokens with `pairs` attention pairs."""
        return 2e9 * self.params_b * tokens + self.attn_flops_per_pair * pairs


SEGMENT_BYTES = 1460  # a TCP segment (Ethernet MTU)


@dataclass(frozen=True)
class Link:
    """The WAN. Transfers share the line fairly; one transfer also runs at most at
    tcp_window / RTT (a TCP flow's ceiling over a long round trip), and with `ramp_flows` at a
    rate that climbs from idle as TCP's does; every message arrives one one-way delay after it
    leaves: RTT / 2 plus lognormal jitter (mean `jitter_ms`)."""

    gbit_s: float
    rtt_ms: float
    jitter_ms: float = 0.0
    jitter_sigma: float = 1.0  # lognormal shape: larger = heavier tail
    tcp_window_mb: float | None = None  # None: one flow can fill the line
    loss: float = 0.0  # fraction of bytes sent twice
    init_window_kb: float = 14.6  # TCP's first window (10 segments): slow start after idle
    # A transfer that starts after idle on this many TCP flows, each at its first window and
    # one segment more each round trip (congestion avoidance), up to the ceiling. None: it
    # starts at the ceiling.
    ramp_flows: float | None = None

    def __post_init__(self) -> None:
        if self.gbit_s <= 0 or self.rtt_ms < 0 or self.jitter_ms < 0:
            raise ValueError("link: need gbit_s > 0, rtt_ms >= 0, jitter_ms >= 0")
        if not 0 <= self.loss < 1:
            raise ValueError("link: loss must be in [0, 1)")
        if self.tcp_window_mb is not None and self.tcp_window_mb <= 0:
            raise ValueError("link: tcp_window_mb must be > 0")
        if self.ramp_flows is not None and self.ramp_flows <= 0:
            raise ValueError("link: ramp_flows must be > 0")

    @property
    def bytes_per_s(self) -> float:
        """Goodput of the whole line."""
        return self.gbit_s * 1e9 / 8 * (1 - self.loss)

    @property
    def flow_bytes_per_s(self) -> float:
        """Goodput one transfer can reach alone."""
        if self.tcp_window_mb is None or self.rtt_ms == 0:
            return self.bytes_per_s
        window = self.tcp_window_mb * 2**20 / (self.rtt_ms / 1000) * (1 - self.loss)
        return min(self.bytes_per_s, window)

    def ramp_bytes_per_s(self, elapsed_s: float) -> float:
        """A transfer's ceiling `elapsed_s` after it started: stepped once a round trip."""
        ceiling = self.flow_bytes_per_s
        if self.ramp_flows is None or self.rtt_ms == 0:
            return ceiling
        rtt = self.rtt_ms / 1000
        rounds = math.floor(elapsed_s / rtt + 1e-9)
        window = self.ramp_flows * (self.init_window_kb * 1000 + rounds * SEGMENT_BYTES)
        return min(ceiling, window / rtt)

    def alone_s(self, nbytes: float) -> float:
        """One transfer alone on the line: until its last byte leaves."""
        ceiling, rtt = self.flow_bytes_per_s, self.rtt_ms / 1000
        t, left = 0.0, float(nbytes)
        while True:
            rate = self.ramp_bytes_per_s(t)
            if rate >= ceiling or left <= rate * rtt:
                return t + left / rate
            left -= rate * rtt
            t += rtt

    def jitter_s(self, rng: random.Random) -> float:
        if self.jitter_ms == 0:
            return 0.0
        sigma = self.jitter_sigma
        mu = math.log(self.jitter_ms / 1000) - sigma * sigma / 2
        return rng.lognormvariate(mu, sigma)

    def one_way_s(self, rng: random.Random) -> float:
        """One sample of the one-way delay (the mean is RTT / 2 + jitter_ms)."""
        return self.rtt_ms / 2000 + self.jitter_s(rng)

    def mean_one_way_s(self) -> float:
        return (self.rtt_ms / 2 + self.jitter_ms) / 1000

    def cold_transfer_s(self, nbytes: float, rng: random.Random) -> float:
        """One transfer on an idle connection: TCP slow start doubles the window each round
        trip (each round trip sampled, so jitter adds up) until the window reaches the flow's
        ceiling; the rest goes at the flow rate; the last bytes take one one-way delay."""
        if nbytes <= 0:
            return self.one_way_s(rng)
        rate = self.flow_bytes_per_s
        rtt = self.rtt_ms / 1000
        ceiling = rate * rtt  # bytes in flight per round trip at the flow rate
        window = min(self.init_window_kb * 1000, ceiling) if ceiling > 0 else nbytes
        left, seconds = float(nbytes), 0.0
        while left > window and window < ceiling:
            left -= window
            seconds += rtt + 2 * self.jitter_s(rng)
            window = min(2 * window, ceiling)
        return seconds + left / rate + self.one_way_s(rng)


# Compute-heavy (type A) and memory-heavy (type B) chips.
CHIP_A = Chip("A", tflops=800, mem_gb=96, mem_bw_gbs=2400, interconnect_gbs=50, price=1.0)
CHIP_B = Chip("B", tflops=400, mem_gb=144, mem_bw_gbs=4800, interconnect_gbs=50, price=1.25)
CHIPS = {c.name: c for c in (CHIP_A, CHIP_B)}

# A 1T-class MoE (32B active, 4-bit experts: ~0.55 TB). KV per token from the paper's handoff
# microbenchmark: 4649 KiB for 100 tokens. Attention ~4 x 61 layers x 8192.
MOE_1T = Model(
    "moe-1t",
    params_b=32,
    total_params_b=1000,
    weight_bytes=0.55e12,
    kv_bytes_per_token=4649 * 1024 / 100,
    attn_flops_per_pair=2.0e6,
)
# This repository's test models (pdd.models.tiny): 2 layers; 512 B and 32 KB of KV per token.
TINY = Model(
    "tiny", params_b=0.00056, weight_bytes=1.1e6, kv_bytes_per_token=512, attn_flops_per_pair=1024
)
WIDE = Model(
    "wide", params_b=0.0047, weight_bytes=9.4e6, kv_bytes_per_token=32768, attn_flops_per_pair=32768
)
MODELS = {m.name: m for m in (MOE_1T, TINY, WIDE)}

# An ordinary cross-datacenter line: 100 Gbit/s, 25 ms RTT with a jittery tail, Linux's default
# 4 MiB TCP send buffer (one flow: ~1.3 Gbit/s at this RTT).
WAN = Link(gbit_s=100, rtt_ms=25, jitter_ms=2.0, jitter_sigma=1.0, tcp_window_mb=4.0)
LINKS = {"wan": WAN, "wan-10g": Link(10, 25, 2.0, 1.0, 4.0), "ideal": Link(100, 0.0)}
