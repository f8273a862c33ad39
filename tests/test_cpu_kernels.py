"""The pure-torch stand-ins for sgl_kernel ops against straightforward references."""

from __future__ import annotations

import pytest
import torch

from pdd.srt import cpu_kernels


def test_assign_req_to_token_pool_writes_each_rows_slice() -> None:
    req_to_token = torch.full((4, 16), -1, dtype=torch.int32)
    rows = torch.tensor([2, 0])
    start, end = torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64)
    cpu_kernels.assign_req_to_token_pool_cpu(rows, req_to_token, start, end, locs, 16)
    assert req_to_token[2, 3:6].tolist() == [10, 11, 12]
    assert req_to_token[0, 0:2].tolist() == [20, 21]
    assert (req_to_token == -1).sum() == 4 * 16 - 5


def test_copy_all_layer_kv_cache_moves_rows_in_every_layer() -> None:
    layers = [torch.randn(8, 6) for _ in range(3)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    tgt, src = torch.tensor([5, 7]), torch.tensor([1, 2])
    cpu_kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for t, b in zip(layers, before, strict=True):
        assert torch.equal(t[5], b[1]) and torch.equal(t[7], b[2])
        assert torch.equal(t[:5], b[:5]) and torch.equal(t[6], b[6])


def test_unimplemented_op_fails_loudly_when_called() -> None:
    op = cpu_kernels.some_cuda_only_op  # importing it must work: SGLang imports many it never calls
    with pytest.raises(NotImplementedError, match="some_cuda_only_op"):
        op(torch.zeros(1))


def test_sgl_kernel_resolves_to_the_stand_in_without_a_gpu() -> None:
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real sgl_kernel is used, the stand-in stays off")
    out = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel; print(sgl_kernel.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("pdd/srt/cpu_kernels.py")
