"""The extend-attention kernels (GQA and MLA) against their torch references, case by case.

    TRITON_INTERPRET=1 python -m pdd.kernels.check [SEED]    # CPU, Triton's interpreter
    python -m pdd.kernels.check [SEED] --device cuda          # a GPU

Prints one line per case (ok, or what is wrong) and a final `REPORT {json}` line; exits 1 if any
case fails. tests/test_extend_attention_kernel.py runs it in the interpreter; the GPU check
script (kernels/gpu_check.sh) runs it on the device. Needs only torch and Triton.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdd.kernels.paged_batch import new_slots, random_paged_batch
from pdd.kernels.reference import extend_attention_reference, mla_extend_attention_reference

# Outputs are O(1); fp16 keeps ~3 significant digits and the kernel rounds p to fp16 for P @ V.
TOLERANCES = {"float32": (2e-5, 1e-5), "float16": (4e-3, 4e-3)}


@dataclass
class Case:
    name: str
    dtype: str
    num_kv_heads: int
    group: int
    head_dim: int
    prefix_lens: list[int] | None  # None: drawn from the seed (with extend_lens)
    extend_lens: list[int] | None
    index_dtype: str = "int32"
    sm_scale: float | None = None
    poison_out: bool = True
    # MLA: the pool holds one latent of this width plus a rope part (head_dim in all), one KV
    # "head" read by every query head (group = the query heads).
    latent_dim: int | None = None


CASES = [
    Case("fp32_ragged_g1", "float32", 2, 1, 32, [0, 37, 130], [1, 17, 70]),
    Case("fp16_ragged_g2", "float16", 2, 2, 64, [65, 0, 200], [3, 64, 1], "int64"),
    Case("fp32_g4_head_dim_48", "float32", 1, 4, 48, [100, 1], [33, 1], sm_scale=0.3),
    Case("fp16_prefix0_extend1", "float16", 2, 4, 32, [0], [1]),
    Case("fp16_extend_256", "float16", 1, 2, 32, [150], [256], "int64"),
    Case("fp32_zero_extend_row", "float32", 2, 2, 32, [40, 10, 0], [5, 0, 9]),
    Case("fp32_random", "float32", 2, 0, 32, None, None),
    Case("fp16_random", "float16", 2, 0, 64, None, None, "int64"),
    Case("fp16_random_out_none", "float16", 1, 0, 32, None, None, poison_out=False),
    # The test model's MLA shape (latent 64 + rope 16, 4 heads), DeepSeek-V3's per-rank shape
    # (latent 512 + rope 64, 16 heads: 128 over TP 8), a scaled one.
    Case("mla_fp32_tiny_shape", "float32", 1, 4, 80, [0, 37, 130], [1, 17, 70], latent_dim=64),
    Case("mla_fp16_deepseek_shape", "float16", 1, 16, 576, None, None, "int64", latent_dim=512),
    Case("mla_fp32_scaled", "float32", 1, 8, 48, [100, 1], [33, 1], sm_scale=0.3, latent_dim=32),
]


def make_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen, device=gen.device))

    group = case.group or [1, 2, 4][draw(0, 2)]
    if case.prefix_lens is None or case.extend_lens is None:
        batch = draw(1, 4)
        prefix_lens = [draw(0, 200) for _ in range(batch)]
        extend_lens = [draw(1, 80) for _ in range(batch)]
    else:
        prefix_lens, extend_lens = case.prefix_lens, case.extend_lens
    batch = random_paged_batch(
        prefix_lens,
        extend_lens,
        case.num_kv_heads,
        group,
        case.head_dim,
        getattr(torch, case.dtype),
        gen,
        getattr(torch, case.index_dtype),
        case.sm_scale,
    )
    if case.latent_dim is None:
        return batch
    mla = {k: v for k, v in batch.items() if k not in ("k_new", "v_new", "k_pool", "v_pool")}
    return {**mla, "kv_new": batch["k_new"], "kv_pool": batch["k_pool"],
            "latent_dim": case.latent_dim}  # fmt: skip


def run_case(case: Case, seed: int, device: str = "cpu") -> dict[str, Any]:
    """Kernel vs reference on one case, as a JSON-able report."""
    from pdd.kernels.extend_attention import extend_attention
    from pdd.kernels.mla_extend_attention import mla_extend_attention

    inputs = make_inputs(case, torch.Generator(device).manual_seed(seed))
    mla = case.latent_dim is not None
    pools = [("kv_pool", "kv_new")] if mla else [("k_pool", "k_new"), ("v_pool", "v_new")]
    pool_before = {p: inputs[p].clone() for p, _ in pools}
    ref_inputs: dict[str, Any] = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
    }
    kernel, reference = ((mla_extend_attention, mla_extend_attention_reference) if mla
                         else (extend_attention, extend_attention_reference))  # fmt: skip
    expected = reference(**ref_inputs)
    out = torch.full_like(expected, float("nan")) if case.poison_out else None
    got = kernel(**inputs, out=out)

    slots = new_slots(inputs)
    untouched = torch.ones(inputs[pools[0][0]].shape[0], dtype=torch.bool, device=device)
    untouched[slots] = False
    atol, rtol = TOLERANCES[case.dtype]
    diff = (got.float() - expected.float()).abs()
    return {
        "shape": {
            "q": list(inputs["q"].shape),
            "prefix_lens": inputs["prefix_lens"].tolist(),
            "extend_lens": inputs["extend_lens"].tolist(),
        },
        "same_buffer": out is None or got.data_ptr() == out.data_ptr(),
        "all_written": bool(torch.isfinite(got).all()),
        "max_abs_err": float(diff.max()) if diff.numel() else 0.0,
        "tolerance_ratio": float((diff / (atol + rtol * expected.float().abs())).max())
        if diff.numel()
        else 0.0,
        "pool_new_ok": all(torch.equal(inputs[p][slots], inputs[n]) for p, n in pools),
        "pool_rest_ok": all(
            torch.equal(inputs[p][untouched], pool_before[p][untouched]) for p, _ in pools
        ),
        "pool_matches_reference": all(torch.equal(inputs[p], ref_inputs[p]) for p, _ in pools),
    }


def problems(result: dict[str, Any]) -> list[str]:
    """What is wrong with one case's report; empty when it passed."""
    if "error" in result:
        return [result["error"]]
    checks = {
        "same_buffer": "the result is not the given out buffer",
        "all_written": "output elements left unwritten (NaN poison)",
        "pool_new_ok": "the pool does not hold the new K/V at their slots",
        "pool_rest_ok": "the pool changed outside the new slots",
        "pool_matches_reference": "the pool differs from the reference's",
    }
    found = [why for key, why in checks.items() if not result[key]]
    if result["tolerance_ratio"] > 1.0:
        found.append(f"kernel differs from reference ({result['tolerance_ratio']:.2f}x tolerance)")
    return found


def run_all(seed: int, device: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for i, case in enumerate(CASES):
        start = time.perf_counter()
        try:
            report[case.name] = run_case(case, seed + i, device)
        except Exception as exc:  # reported per case so one failure does not hide the rest
            report[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[case.name]["seconds"] = round(time.perf_counter() - start, 2)
        bad = problems(report[case.name])
        print(f"{case.name}: {'; '.join(bad) if bad else 'ok'}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdd.kernels.check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("seed", type=int, nargs="?", default=None, help="default: random")
    parser.add_argument("--device", default="cpu", help="cpu (TRITON_INTERPRET=1) or cuda")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.device == "cpu":
        torch.set_num_threads(1)
    report = run_all(seed, args.device)
    print("REPORT " + json.dumps(report))
    failed = [name for name, result in report.items() if problems(result)]
    print(
        f"kernel check, seed {seed} on {args.device}: {len(report) - len(failed)} of "
        f"{len(report)} cases ok" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
