"""The Triton extend-attention kernels (GQA, and MLA's absorbed latent form) against their torch
references, under Triton's CPU interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, and the variable is inherited by every
process started later. Setting it in the pytest process would make SGLang servers started by
other test modules interpret their Triton kernels, and any module that imported triton first
would defeat it. So the kernel checks run in one child process (this file run with -m) whose
environment alone sets TRITON_INTERPRET=1 before anything imports triton; pytest only reads the
child's per-case report and asserts on it.

Inputs are fresh each run; the seed is in every failure message, and PDD_KERNEL_TEST_SEED=<seed>
reruns the same inputs. bf16 is not checked: the interpreter's bf16 tl.dot is wrong upstream.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # the child: before torch/pdd.kernels pull in triton

import pytest
import torch

from pdd.kernels.paged_batch import new_slots, random_paged_batch
from pdd.kernels.reference import extend_attention_reference, mla_extend_attention_reference
from tests.marks import without_gpu

REPO_ROOT = Path(__file__).resolve().parent.parent
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
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

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


def run_case(case: Case, seed: int) -> dict[str, Any]:
    """In the interpreter child: kernel vs reference on one case, as a JSON-able report."""
    from pdd.kernels.extend_attention import extend_attention
    from pdd.kernels.mla_extend_attention import mla_extend_attention

    inputs = make_inputs(case, torch.Generator().manual_seed(seed))
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
    untouched = torch.ones(inputs[pools[0][0]].shape[0], dtype=torch.bool)
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


def child_main(seed: int) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for i, case in enumerate(CASES):
        start = time.perf_counter()
        try:
            report[case.name] = run_case(case, seed + i)
        except Exception as exc:  # reported per case so one failure does not hide the rest
            report[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[case.name]["seconds"] = round(time.perf_counter() - start, 2)
    print("REPORT " + json.dumps(report))


@pytest.fixture(scope="module")
def interpreter_report() -> tuple[int, dict[str, Any]]:
    seed = int(os.environ.get("PDD_KERNEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_extend_attention_kernel", str(seed)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, (
        f"seed {seed}: interpreter child failed (rc {proc.returncode})\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return seed, json.loads(lines[-1][len("REPORT ") :])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference_in_interpreter(
    case: Case, interpreter_report: tuple[int, dict[str, Any]]
) -> None:
    seed, report = interpreter_report
    result = report[case.name]
    where = f"seed {seed} (PDD_KERNEL_TEST_SEED={seed}), case {asdict(case)}: {result}"
    assert "error" not in result, where
    assert result["same_buffer"], f"result is not the given out buffer; {where}"
    assert result["all_written"], f"output elements left unwritten (NaN poison); {where}"
    assert result["tolerance_ratio"] <= 1.0, f"kernel differs from reference; {where}"
    assert result["pool_new_ok"], f"pool does not hold k_new/v_new at their slots; {where}"
    assert result["pool_rest_ok"], f"pool changed outside the new slots; {where}"
    assert result["pool_matches_reference"], where


def test_reference_matches_sdpa_on_contiguous_slots() -> None:
    """The reference itself: one request, identity slots, against torch's causal SDPA."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    prefix, ext, hkv, group, d = 23, 9, 2, 2, 16
    length = prefix + ext
    k_all = torch.randn(length, hkv, d, generator=gen)
    v_all = torch.randn(length, hkv, d, generator=gen)
    q = torch.randn(ext, hkv * group, d, generator=gen)
    k_pool, v_pool = torch.zeros(length, hkv, d), torch.zeros(length, hkv, d)
    k_pool[:prefix], v_pool[:prefix] = k_all[:prefix], v_all[:prefix]
    out = extend_attention_reference(
        q,
        k_all[prefix:],
        v_all[prefix:],
        k_pool,
        v_pool,
        torch.arange(length).unsqueeze(0),
        torch.tensor([0]),
        torch.tensor([prefix]),
        torch.tensor([ext]),
    )
    # Pad the queries to the full length so SDPA's top-left causal mask is the right one.
    q_full = torch.zeros(length, hkv * group, d)
    q_full[prefix:] = q
    expected = torch.nn.functional.scaled_dot_product_attention(
        q_full.transpose(0, 1),
        k_all.repeat_interleave(group, 1).transpose(0, 1),
        v_all.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
        scale=1 / math.sqrt(d),
    ).transpose(0, 1)[prefix:]
    torch.testing.assert_close(
        out, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}"
    )
    assert torch.equal(k_pool, k_all) and torch.equal(v_pool, v_all), f"seed {seed}"


@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_benchmark_smoke_agrees_with_sglang_and_the_reference(tmp_path: Path, shape: str) -> None:
    """The GPU benchmark's own plumbing, in the interpreter: pdd's kernel and SGLang's Triton
    extend attention on the same paged batches (prefix 0 included) agree with each other and
    with the reference, and the table, JSON and PNG come out; for both shapes."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               SGLANG_USE_CPU_ENGINE="1")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.eval.bench_extend_kernel", "--smoke", "--shape", shape,
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "extend_kernel.json").read_text())
    assert [(r["batch"], r["extend"], r["prefix"]) for r in data["rows"]] == [
        (1, 1, 0), (3, 7, 33), (2, 40, 5)
    ]  # fmt: skip
    assert all(r["agrees"] and r["max_abs_diff"] <= 1e-4 for r in data["rows"]), data["rows"]
    assert (tmp_path / "extend_kernel.png").stat().st_size > 0
    assert proc.stdout.count(" ok") == 3, proc.stdout
    assert ("MLA" in data["shape"]) == (shape == "mla"), data["shape"]


@without_gpu("the benchmark runs there instead of refusing")
def test_benchmark_without_a_gpu_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.eval.bench_extend_kernel"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]


if __name__ == "__main__":
    child_main(int(sys.argv[1]))
