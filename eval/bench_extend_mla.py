"""The MLA shape of the handoff-extend benchmark (pdd.eval.bench_extend_kernel --shape mla):
one latent + rope row per token in the pool, every query head in absorbed form.

SGLang's side is what its Triton backend runs for an MLA extend over a cached prefix: the pool
store, then `extend_attention_fwd` with the pool as K (latent + rope) and its latent columns as
V, as its MLA backend passes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# DeepSeek-V3 (and Kimi-K2) per rank at TP 8: 128 / 8 query heads, latent 512, rope 64.
HEADS, LATENT, ROPE = 16, 512, 64
SMOKE_HEADS, SMOKE_LATENT, SMOKE_ROPE = 4, 64, 16


def mla_inputs(prefix: list[int], extend: list[int], heads: int, latent: int, rope: int,
               dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:  # fmt: skip
    from pdd.kernels.paged_batch import random_paged_batch

    b = random_paged_batch(prefix, extend, 1, heads, latent + rope, dtype, gen)
    return {"q": b["q"], "kv_new": b["k_new"], "kv_pool": b["k_pool"],
            "req_to_token": b["req_to_token"], "req_pool_idx": b["req_pool_idx"],
            "prefix_lens": b["prefix_lens"], "extend_lens": b["extend_lens"],
            "latent_dim": latent}  # fmt: skip


def ideal_bytes(inputs: dict[str, Any], batch: int, extend: int, prefix: int) -> int:
    """Prefix rows read once; new q and rows read; new rows and the output written; indices."""
    q, kv = inputs["q"], inputs["kv_new"]
    row = kv.shape[2] * kv.element_size()
    tokens = batch * extend
    q_token = q.shape[1] * q.shape[2] * q.element_size()
    out_token = q.shape[1] * inputs["latent_dim"] * q.element_size()
    index = inputs["req_to_token"].element_size() * batch * (prefix + extend)
    return batch * prefix * row + tokens * (q_token + 2 * row + out_token) + index


def pdd_extend(inputs: dict[str, Any], extend: int) -> Callable[[], torch.Tensor]:
    from pdd.kernels.mla_extend_attention import mla_extend_attention

    q = inputs["q"]
    out = q.new_empty(q.shape[0], q.shape[1], inputs["latent_dim"])

    def run() -> torch.Tensor:
        return mla_extend_attention(**inputs, out=out, max_extend_len=extend)

    return run


def sglang_extend(inputs: dict[str, Any], extend: int) -> Callable[[], torch.Tensor]:
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from pdd.eval.bench_extend_kernel import sglang_indices

    q, kv, pool, latent = inputs["q"], inputs["kv_new"], inputs["kv_pool"], inputs["latent_dim"]
    qo_indptr, kv_indptr, kv_indices, loc = sglang_indices(inputs)
    out = q.new_empty(q.shape[0], q.shape[1], latent)
    scale = q.shape[-1] ** -0.5

    def run() -> torch.Tensor:
        pool[loc] = kv
        extend_attention_fwd(q, kv, kv[..., :latent], out, pool, pool[..., :latent], qo_indptr,
                             kv_indptr, kv_indices, None, True, None, extend, 1.0, 1.0,
                             sm_scale=scale)  # fmt: skip
        return out

    return run


def reference(inputs: dict[str, Any]) -> torch.Tensor:
    from pdd.kernels.reference import mla_extend_attention_reference

    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return mla_extend_attention_reference(**copy)
