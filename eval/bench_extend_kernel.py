"""pdd's Triton handoff-extend kernel against SGLang's own extend attention, on one GPU.

    python -m pdd.eval.bench_extend_kernel [--dtype bf16|fp16] [--q-heads 32] [--kv-heads 8]
                                           [--head-dim 128] [--peak-gbs N] [--out DIR]
    python -m pdd.eval.bench_extend_kernel --shape mla   # DeepSeek-V3 per rank: 16 x (512 + 64)
    TRITON_INTERPRET=1 python -m pdd.eval.bench_extend_kernel --smoke   # CPU: checks only

A handoff extend is a batch of requests, each a short run of new tokens (1-256) over a long
cached prefix in the paged KV pool. For each (batch, extend, prefix) case, both sides store the
new K/V into the pool and attend over prefix + new tokens, one layer:
- pdd: `pdd.kernels.extend_attention` (the store and the attention, two launches), or for
  `--shape mla` `pdd.kernels.mla_extend_attention` (eval/bench_extend_mla.py);
- SGLang: what its Triton attention backend runs for an extend: the pool store, then
  `extend_attention_fwd` over the prefix's kv_indices (built once per batch, as SGLang does).
Each case checks pdd's output against the torch reference and SGLang's (without SGLang
installed, as on a bare GPU machine, only the reference and pdd's time), then times both
(median, L2 flushed between runs) and prints the bandwidth each achieves: the bytes an ideal
kernel must move (prefix K/V read once, new q/k/v read, new K/V and the output written) over its
time, against the device's memory bandwidth (its datasheet figure where known, or --peak-gbs; a
device-to-device copy is measured too). Writes JSON and a PNG to --out. Exits 1 if any case
disagrees. `bash kernels/gpu_check.sh` runs the kernel checks and both shapes on one GPU.

--smoke runs tiny fp32 cases on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set
before start) and also checks both against the torch reference; its times mean nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdd.launch.cli import command_parser

# Datasheet memory bandwidth, GB/s, by a substring of torch's device name (first match wins).
DATASHEET_GBS = [
    ("H200", 4800.0),
    ("H20", 4000.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
]
# Batches of at least this many requests over prefixes this long are "realistic" handoffs.
REALISTIC_BATCH, REALISTIC_PREFIX = 8, 4096
TARGET_SHARE = 0.60
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@dataclass(frozen=True)
class Case:
    batch: int
    extend: int
    prefix: int


GPU_CASES = [Case(b, e, p) for b in (1, 8, 32, 128) for e in (1, 16, 128) for p in (1024, 8192)] + [
    Case(32, 256, 8192),
    Case(64, 4, 32768),
]
SMOKE_CASES = [Case(1, 1, 0), Case(3, 7, 33), Case(2, 40, 5)]


@dataclass
class Row:
    batch: int
    extend: int
    prefix: int
    bytes: int
    max_abs_diff: float
    agrees: bool
    pdd_ms: float
    sglang_ms: float
    pdd_gbs: float
    sglang_gbs: float

    @property
    def speedup(self) -> float:
        return self.sglang_ms / self.pdd_ms if self.pdd_ms else 0.0


def ideal_bytes(inputs: dict[str, Any], case: Case) -> int:
    """What an ideal kernel moves: prefix K/V read once; new q, k, v read; new K/V and the
    output written; req_to_token read for every position."""
    q, k = inputs["q"], inputs["k_new"]
    tokens = case.batch * case.extend
    kv_token = 2 * k.shape[1] * k.shape[2] * k.element_size()
    q_token = q.shape[1] * q.shape[2] * q.element_size()
    index = inputs["req_to_token"].element_size()
    positions = case.batch * (case.prefix + case.extend)
    return (
        case.batch * case.prefix * kv_token
        + tokens * (2 * q_token + 2 * kv_token)
        + (positions * index)
    )


def sglang_indices(inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """SGLang's extend metadata for a batch, built once as SGLang builds it: qo_indptr,
    kv_indptr, kv_indices (the prefixes' slots) and the new tokens' slots."""
    from pdd.kernels.paged_batch import new_slots

    device = inputs["q"].device
    rows = inputs["req_to_token"][inputs["req_pool_idx"].long()].long()
    prefix_lens = inputs["prefix_lens"].tolist()
    kv_indices = torch.cat([rows[i, :p] for i, p in enumerate(prefix_lens)])
    kv_indptr = torch.tensor([0, *prefix_lens], device=device).cumsum(0).to(torch.int32)
    qo_indptr = torch.tensor([0, *inputs["extend_lens"].tolist()], device=device)
    return qo_indptr.cumsum(0).to(torch.int32), kv_indptr, kv_indices, new_slots(inputs)


def sglang_extend(inputs: dict[str, Any], case: Case) -> Callable[[], torch.Tensor]:
    """SGLang's Triton-backend extend for this batch: a closure that stores and attends."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    qo_indptr, kv_indptr, kv_indices, loc = sglang_indices(inputs)
    out = torch.empty_like(inputs["q"])
    q, k, v = inputs["q"], inputs["k_new"], inputs["v_new"]
    k_pool, v_pool = inputs["k_pool"], inputs["v_pool"]
    scale = q.shape[-1] ** -0.5

    def run() -> torch.Tensor:
        k_pool[loc] = k
        v_pool[loc] = v
        extend_attention_fwd(q, k, v, out, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices,
                             None, True, None, case.extend, 1.0, 1.0, sm_scale=scale)  # fmt: skip
        return out

    return run


def pdd_extend(inputs: dict[str, Any], case: Case) -> Callable[[], torch.Tensor]:
    from pdd.kernels.extend_attention import extend_attention

    out = torch.empty_like(inputs["q"])
    args = {k: v for k, v in inputs.items() if k != "sm_scale"}

    def run() -> torch.Tensor:
        return extend_attention(**args, out=out, max_extend_len=case.extend)

    return run


def time_ms(fn: Callable[[], Any], on_gpu: bool) -> float:
    if on_gpu:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def copy_gbs() -> float:
    """Device-to-device copy bandwidth (read + write) of a 1 GiB buffer."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = float(do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median"))
    return 2 * src.numel() / ms / 1e6


def datasheet_gbs(name: str) -> float | None:
    return next((gbs for key, gbs in DATASHEET_GBS if key in name), None)


def sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def run_case(case: Case, args: Any, dtype: torch.dtype, device: str, seed: int) -> Row:
    from pdd.eval import bench_extend_mla as mla
    from pdd.kernels.paged_batch import random_paged_batch
    from pdd.kernels.reference import extend_attention_reference

    gen = torch.Generator(device=device).manual_seed(seed)
    prefix, extend = [case.prefix] * case.batch, [case.extend] * case.batch
    if args.shape == "mla":
        inputs = mla.mla_inputs(prefix, extend, args.q_heads, args.latent_dim, args.rope_dim,
                                dtype, gen)  # fmt: skip
        ours = mla.pdd_extend(inputs, case.extend)
        theirs = mla.sglang_extend(inputs, case.extend) if args.sglang else None
    else:
        inputs = random_paged_batch(prefix, extend, args.kv_heads, args.q_heads // args.kv_heads,
                                    args.head_dim, dtype, gen)  # fmt: skip
        ours = pdd_extend(inputs, case)
        theirs = sglang_extend(inputs, case) if args.sglang else None
    got = ours().clone()
    if args.shape == "mla":  # the reference runs on a copy of the pools
        ref = mla.reference(inputs)
    else:
        copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        ref = extend_attention_reference(**copy)
    diff = float((got.float() - ref.float()).abs().max())
    if theirs is not None:
        diff = max(diff, float((got.float() - theirs().float()).abs().max()))
    agrees = diff <= TOLERANCE[dtype]
    on_gpu = device == "cuda"
    pdd_ms = time_ms(ours, on_gpu)
    sglang_ms = time_ms(theirs, on_gpu) if theirs is not None else float("nan")
    if args.shape == "mla":
        moved = mla.ideal_bytes(inputs, case.batch, case.extend, case.prefix)
    else:
        moved = ideal_bytes(inputs, case)
    return Row(case.batch, case.extend, case.prefix, moved, diff, agrees, pdd_ms, sglang_ms,
               moved / pdd_ms / 1e6, moved / sglang_ms / 1e6)  # fmt: skip


def table(rows: list[Row], peak: float) -> str:
    head = (
        f"{'batch':>5} {'extend':>6} {'prefix':>6} {'MB':>8} {'pdd ms':>8} {'sglang ms':>9} "
        f"{'pdd GB/s':>9} {'sglang GB/s':>11} {'pdd %peak':>9} {'speedup':>7} {'check':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.batch:>5} {r.extend:>6} {r.prefix:>6} {r.bytes / 1e6:>8.1f} {r.pdd_ms:>8.3f} "
            f"{r.sglang_ms:>9.3f} {r.pdd_gbs:>9.0f} {r.sglang_gbs:>11.0f} "
            f"{100 * r.pdd_gbs / peak:>8.0f}% {r.speedup:>6.2f}x "
            f"{'ok' if r.agrees else 'MISMATCH':>8}"
        )
    return "\n".join(lines)


def verdict(rows: list[Row], peak: float) -> str:
    real = [r for r in rows if r.batch >= REALISTIC_BATCH and r.prefix >= REALISTIC_PREFIX]
    if not real:
        return "no realistic case (batch >= 8, prefix >= 4096) was run"
    share = statistics.median(r.pdd_gbs / peak for r in real)
    compared = [r for r in real if r.sglang_ms == r.sglang_ms]  # not NaN: SGLang ran
    slower = [r for r in compared if r.speedup < 1.0]
    against = (f"slower than SGLang in {len(slower)} of {len(compared)}" if compared
               else "SGLang not compared")  # fmt: skip
    return (
        f"realistic cases (batch >= {REALISTIC_BATCH}, prefix >= {REALISTIC_PREFIX}): median "
        f"{100 * share:.0f}% of {peak:.0f} GB/s (target {100 * TARGET_SHARE:.0f}%: "
        f"{'met' if share >= TARGET_SHARE else 'not met'}); {against}"
    )


def plot(rows: list[Row], peak: float, path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.batch}x{r.extend}\n/{r.prefix}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 4.5))
    ax.bar([i - 0.2 for i in x], [100 * r.pdd_gbs / peak for r in rows], 0.4, label="pdd")
    ax.bar([i + 0.2 for i in x], [100 * r.sglang_gbs / peak for r in rows], 0.4, label="SGLang")
    ax.axhline(100 * TARGET_SHARE, color="grey", linestyle="--", label="target")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel(f"% of {peak:.0f} GB/s")
    ax.set_xlabel("batch x extend / prefix")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("pdd.eval.bench_extend_kernel", __doc__)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--shape", choices=("gqa", "mla"), default="gqa",
        help="mla: absorbed latent attention, DeepSeek-V3 per rank (16 heads, latent 512 + rope "
        "64; the head options are ignored)",
    )  # fmt: skip
    parser.add_argument(
        "--peak-gbs", type=float, default=None,
        help="the device's memory bandwidth (default: its datasheet figure)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true",
        help="tiny fp32 cases on the CPU under TRITON_INTERPRET=1 (checks only)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-sglang",
        dest="sglang",
        action="store_false",
        help="skip SGLang's kernel (the default when SGLang is not installed)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench_extend"))
    args = parser.parse_args(argv)
    args.sglang = args.sglang and sglang_installed()

    from pdd.eval import bench_extend_mla as mla
    from pdd.srt.cpu_support import triton_interpreted

    if args.smoke:
        if not triton_interpreted():
            parser.error("--smoke needs TRITON_INTERPRET=1 in the environment before start")
        device, dtype, cases = "cpu", torch.float32, SMOKE_CASES
        args.q_heads, args.kv_heads, args.head_dim = 4, 2, 32
        args.latent_dim, args.rope_dim = mla.SMOKE_LATENT, mla.SMOKE_ROPE
        name, peak = "CPU (Triton interpreter)", args.peak_gbs or 1.0
    else:
        if not torch.cuda.is_available():
            print("bench_extend_kernel: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)",
                  file=sys.stderr)  # fmt: skip
            return 2
        device, cases = "cuda", GPU_CASES
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        name = torch.cuda.get_device_name()
        measured = copy_gbs()
        sheet = datasheet_gbs(name)
        peak = args.peak_gbs or sheet or measured
        print(f"{name}: datasheet {sheet or 'unknown'} GB/s, device copy {measured:.0f} GB/s; "
              f"peak used: {peak:.0f} GB/s")  # fmt: skip
    if args.shape == "mla" and not args.smoke:
        args.q_heads, args.latent_dim, args.rope_dim = mla.HEADS, mla.LATENT, mla.ROPE
    if args.q_heads % args.kv_heads:
        parser.error("--q-heads must be a multiple of --kv-heads")

    rows = []
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] batch {case.batch}, extend {case.extend}, "
              f"prefix {case.prefix}", flush=True)  # fmt: skip
        rows.append(run_case(case, args, dtype, device, args.seed + i))
    if args.shape == "mla":
        shape = f"MLA {args.q_heads} heads x ({args.latent_dim} + {args.rope_dim}), {dtype}"
    else:
        shape = f"{args.q_heads}/{args.kv_heads} heads x {args.head_dim}, {dtype}"
    shape = shape.replace("torch.", "")
    print(f"\nhandoff extend attention, one layer, {shape}, on {name}")
    print(table(rows, peak))
    if not args.smoke:
        print(verdict(rows, peak))
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"device": name, "peak_gbs": peak, "shape": shape,
            "rows": [asdict(r) | {"speedup": r.speedup} for r in rows]}  # fmt: skip
    (args.out / "extend_kernel.json").write_text(json.dumps(data, indent=1))
    plot(rows, peak, args.out / "extend_kernel.png", f"{shape}, {name}")
    print(f"wrote {args.out}/extend_kernel.json and extend_kernel.png")
    bad = [r for r in rows if not r.agrees]
    if bad:
        print(f"{len(bad)} case(s) disagree with the reference or SGLang's extend attention",
              file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
