"""Random handoff-extend batches over a paged KV pool, laid out as SGLang lays them out (page
size 1): the inputs of ``extend_attention`` and its reference, for tests and benchmarks."""

from __future__ import annotations

from typing import Any

import torch

SPARE_ROWS = 3  # req_to_token rows no request uses
SPARE_SLOTS = 64  # pool slots no request uses: they must stay untouched


def random_paged_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    index_dtype: torch.dtype = torch.int32,
    sm_scale: float | None = None,
) -> dict[str, Any]:
    """A ragged batch over a shuffled pool, on gen's device: each request's req_to_token row is
    scattered over the pool and the rows are out of order. Unused req_to_token entries point past
    the pool, so a kernel reading one would not go unnoticed."""
    device = gen.device
    batch = len(prefix_lens)
    total = sum(extend_lens)
    slots = sum(prefix_lens) + total + SPARE_SLOTS
    max_context = max(p + e for p, e in zip(prefix_lens, extend_lens, strict=True)) + 7
    rows = torch.randperm(batch + SPARE_ROWS, generator=gen, device=device)[:batch]
    req_to_token = torch.full(
        (batch + SPARE_ROWS, max_context), slots, dtype=index_dtype, device=device
    )
    perm = torch.randperm(slots, generator=gen, device=device)
    offset = 0
    for row, p, e in zip(rows.tolist(), prefix_lens, extend_lens, strict=True):
        req_to_token[row, : p + e] = perm[offset : offset + p + e].to(index_dtype)
        offset += p + e

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return {
        "q": randn(total, num_kv_heads * group, head_dim),
        "k_new": randn(total, num_kv_heads, head_dim),
        "v_new": randn(total, num_kv_heads, head_dim),
        "k_pool": randn(slots, num_kv_heads, head_dim),
        "v_pool": randn(slots, num_kv_heads, head_dim),
        "req_to_token": req_to_token,
        "req_pool_idx": rows,
        "prefix_lens": torch.tensor(prefix_lens, device=device),
        "extend_lens": torch.tensor(extend_lens, device=device),
        "sm_scale": sm_scale,
    }


def new_slots(inputs: dict[str, Any]) -> torch.Tensor:
    """The pool slots of the batch's new tokens, in packed token order."""
    chunks = [
        inputs["req_to_token"][row, p : p + e].to(torch.int64)
        for row, p, e in zip(
            inputs["req_pool_idx"].tolist(),
            inputs["prefix_lens"].tolist(),
            inputs["extend_lens"].tolist(),
            strict=True,
        )
    ]
    return torch.cat(chunks)
