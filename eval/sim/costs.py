"""How long one forward step takes on one instance: a roofline.

Every forward (a prefill batch, a decode step, or an extend that recomputes handed-off tokens)
reduces to three numbers: new tokens, attention pairs (each new token times the context it
attends to) and context tokens whose KV is read. Its time is a fixed per-step overhead plus the
larger of compute time and memory time:

    flops = 2 x active_params x tokens + attn_flops_per_pair x pairs
    bytes = weights read (MoE: at most tokens x active weights) + (context + tokens) x KV/token
    t     = overhead + per_request x requests
            + max(flops / (peak x MFU), bytes / (bandwidth x utilisation))

`per_request` is what each request of a forward costs besides its FLOPs and bytes (scheduling,
sampling, streaming: on GPUs hidden by overlap scheduling, so 0 in the production presets; on a
CPU a decode step's per-request work). A decode step thus grows with its batch (MoE: the experts
it touches; compute at large batches; per_request) and with its context (KV read). A GPU
overlaps compute and memory traffic (the step takes the larger); a CPU does one, then the other
(`overlap=False`: their sum).
Prefill is compute-bound, decode memory-bound, and an extend of k tokens costs one pass over the
weights and its requests' KV plus k tokens of compute: the reason Extend-Decode handoff is cheap.
MD runs its extends as forwards of their own between decode steps (pdd.srt.main_decode), so a
handoff costs `extend_batch_s` on top of the decode step, never a share of it.
`StepCosts.calibrate` fits the effective compute and bandwidth to times measured on a real
machine, so the same simulator can be checked against the live harness.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdd.eval.sim.hardware import GB, Chip, Model


def prefill_pairs(new: int, cached: int) -> float:
    """Attention pairs of a causal prefill of `new` tokens after `cached` ones."""
    return new * cached + new * (new + 1) / 2


@dataclass(frozen=True)
class StepCosts:
    model: Model
    flops_s: float  # effective compute of one instance
    bytes_s: float  # effective memory bandwidth of one instance
    overhead_s: float = 0.0  # fixed cost of every forward (launch, scheduling)
    kv_capacity_tokens: int = 1 << 40  # KV the instance can hold besides its weights
    send_bytes_s: float = 50 * GB  # what the instance sends to another one (RDMA)
    per_request_s: float = 0.0  # each request of a forward (see the module docstring)
    overlap: bool = True  # compute and memory traffic overlap (False: they add up)

    def __post_init__(self) -> None:
        if self.flops_s <= 0 or self.bytes_s <= 0 or self.send_bytes_s <= 0:
            raise ValueError("flops_s, bytes_s and send_bytes_s must be > 0")
        if self.overhead_s < 0 or self.kv_capacity_tokens <= 0 or self.per_request_s < 0:
            raise ValueError("need overhead_s >= 0, per_request_s >= 0, kv_capacity_tokens > 0")

    @classmethod
    def of(
        cls,
        chip: Chip,
        chips: int,
        model: Model,
        *,
        mfu: float = 0.4,
        bw_util: float = 0.7,
        overhead_s: float = 0.01,
        kv_mem_fraction: float = 0.9,
        per_request_s: float = 0.0,
    ) -> StepCosts:
        """An instance of `chips` chips holding one copy of the model: an SGLang server at
        `--tp-size chips` (the communication between its chips is not modelled)."""
        if chips < 1:
            raise ValueError("an instance needs at least one chip")
        free = chips * chip.mem_gb * GB - model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{model.name} ({model.weight_bytes / GB:.0f} GB) does not fit on "
                f"{chips} x {chip.name} ({chips * chip.mem_gb:.0f} GB)"
            )
        return cls(
            model=model,
            flops_s=chips * chip.tflops * 1e12 * mfu,
            bytes_s=chips * chip.mem_bw_gbs * GB * bw_util,
            overhead_s=overhead_s,
            kv_capacity_tokens=int(free * kv_mem_fraction / model.kv_bytes_per_token),
            send_bytes_s=chips * chip.interconnect_gbs * GB,
            per_request_s=per_request_s,
        )

    @classmethod
    def calibrate(
        cls,
        model: Model,
        prefill_s_per_token: float,
        decode_step_s: float,
        *,
        prefill_tokens: int = 512,
        decode_batch: int = 1,
        decode_context: int = 512,
        overhead_s: float = 0.0,
        kv_capacity_tokens: int = 1 << 40,
        send_bytes_s: float = 50 * GB,
    ) -> StepCosts:
        """Fit compute and bandwidth to two measurements: the time per prompt token of a
        `prefill_tokens`-token prefill (taken as compute-bound) and the time of one decode
        step of `decode_batch` requests at `decode_context` tokens each (memory-bound)."""
        pf = prefill_tokens * prefill_s_per_token - overhead_s
        dec = decode_step_s - overhead_s
        if pf <= 0 or dec <= 0:
            raise ValueError("measured times must exceed the overhead")
        flops = model.flops(prefill_tokens, prefill_pairs(prefill_tokens, 0))
        kv = decode_batch * decode_context
        nbytes = model.weights_read(decode_batch) + (kv + decode_batch) * model.kv_bytes_per_token
        return cls(model, flops / pf, nbytes / dec, overhead_s, kv_capacity_tokens, send_bytes_s)

    from_measurements = calibrate

    def forward_s(self, tokens: float, pairs: float, kv_read: float, requests: int = 1) -> float:
        """One forward of `requests` requests over `tokens` new tokens, `pairs` attention
        pairs, `kv_read` context."""
        if tokens <= 0:
            return 0.0
        m = self.model
        compute = m.flops(tokens, pairs) / self.flops_s
        memory = (m.weights_read(tokens) + (kv_read + tokens) * m.kv_bytes_per_token) / self.bytes_s
        both = max(compute, memory) if self.overlap else compute + memory
        return self.overhead_s + self.per_request_s * requests + both

    def prefill_s(self, new: int, cached: int = 0) -> float:
        """Prefill of `new` uncached tokens after `cached` cached ones."""
        return self.forward_s(new, prefill_pairs(new, cached), cached)

    def prefill_batch_s(self, jobs: Sequence[tuple[int, int]]) -> float:
        """One prefill forward over several (new, cached) prompts."""
        tokens = sum(n for n, _ in jobs)
        pairs = sum(prefill_pairs(n, c) for n, c in jobs)
        return self.forward_s(tokens, pairs, sum(c for _, c in jobs), len(jobs))

    def decode_step_s(self, batch: int, kv_tokens: float) -> float:
        """One decode step of `batch` requests holding `kv_tokens` context in all."""
        return self.forward_s(batch, kv_tokens, kv_tokens, batch)

    def extend_s(self, tokens: int, context: int) -> float:
        """An extend alone: `tokens` handed-off tokens recomputed over `context` tokens of KV."""
        return self.extend_batch_s([(tokens, context)])

    def extend_batch_s(self, jobs: Sequence[tuple[int, int]]) -> float:
        """One extend forward over several (tokens, context) handoffs, as MD batches those that
        arrive in one scheduler step: their tokens, their attention pairs over their contexts,
        one pass over the weights (0 when there is nothing to recompute: MD skips it)."""
        return self.prefill_batch_s(jobs)

    def send_s(self, nbytes: float, latency_s: float = 0.0) -> float:
        """KV sent to another instance in the same datacenter (RDMA)."""
        return latency_s + nbytes / self.send_bytes_s

    def describe(self) -> dict[str, float]:
        return {
            "tflops_effective": self.flops_s / 1e12,
            "gbs_effective": self.bytes_s / GB,
            "overhead_ms": self.overhead_s * 1e3,
            "per_request_ms": self.per_request_s * 1e3,
            "kv_capacity_tokens": float(self.kv_capacity_tokens),
        }


def prediction_error(
    simulated: Mapping[str, float], measured: Mapping[str, float]
) -> dict[str, float]:
    """Relative error (simulated - measured) / measured for every metric both sides have
    (a measured zero gives 0 when the simulation also says 0, else infinity)."""
    errors = {}
    for name, value in measured.items():
        if name not in simulated:
            continue
        sim = float(simulated[name])
        if value == 0:
            errors[name] = 0.0 if sim == 0 else float("inf")
        else:
            errors[name] = (sim - value) / abs(value)
    return errors
