"""The Triton extend-attention kernels (GQA, and MLA's absorbed latent form) against their torch
references, under Triton's CPU interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, and the variable is inherited by every
process started later. Setting it in the pytest process would make SGLang servers started by
other test modules interpret their Triton kernels, and any module that imported triton first
would defeat it. So the kernel checks run in one child process (`python -m pdd.kernels.check`,
which a GPU machine runs on the device as it is) whose
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from pdd.kernels.check import CASES, Case, problems
from pdd.kernels.reference import extend_attention_reference
from tests.marks import without_gpu

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def interpreter_report() -> tuple[int, dict[str, Any]]:
    seed = int(os.environ.get("PDD_KERNEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.kernels.check", str(seed)],
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
    assert not problems(result), where


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
