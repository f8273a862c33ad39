"""Pure-torch reference for the batched extend attention over SGLang's paged KV pool."""

from __future__ import annotations

import math

import torch


def extend_start_locs(extend_lens: torch.Tensor) -> torch.Tensor:
    """Offset of each request's first new token in the packed (ragged) token dimension."""
    lens = extend_lens.to(torch.int64)
    return torch.cumsum(lens, 0) - lens


def extend_attention_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Writes k_new/v_new into the pool, then returns attention over prefix + new tokens.

    q: [T, Hq, D]; k_new, v_new: [T, Hkv, D] (T = sum(extend_lens), packed in batch order);
    k_pool, v_pool: [slots, Hkv, D], modified in place; req_to_token: [rows, max_context];
    req_pool_idx, prefix_lens, extend_lens: [batch]. New token j of request i sits at position
    prefix_lens[i] + j and attends to positions 0 .. prefix_lens[i] + j. Computed in fp32,
    returned in q.dtype. Query head h reads kv head h // (Hq // Hkv).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_new.shape[1]
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    group = num_q_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    starts = extend_start_locs(extend_lens).tolist()
    out = torch.empty_like(q)
    for i, (start, prefix, ext) in enumerate(
        zip(starts, prefix_lens.tolist(), extend_lens.tolist(), strict=True)
    ):
        row = req_to_token[int(req_pool_idx[i])].to(torch.int64)
        new_slots = row[prefix : prefix + ext]
        k_pool[new_slots] = k_new[start : start + ext].to(k_pool.dtype)
        v_pool[new_slots] = v_new[start : start + ext].to(v_pool.dtype)
        if ext == 0:
            continue
        slots = row[: prefix + ext]
        keys = k_pool[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_pool[slots].float().repeat_interleave(group, dim=1)
        queries = q[start : start + ext].float()  # [E, Hq, D]
        scores = torch.einsum("thd,lhd->htl", queries, keys) * scale
        query_pos = prefix + torch.arange(ext, device=q.device)
        key_pos = torch.arange(prefix + ext, device=q.device)
        allowed = key_pos[None, :] <= query_pos[:, None]  # [E, L]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + ext] = torch.einsum("htl,lhd->thd", probs, values).to(q.dtype)
    return out


def mla_extend_attention_reference(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    kv_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    latent_dim: int,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Absorbed MLA extend (pdd.kernels.mla_extend_attention): writes kv_new into the pool,
    then every head scores the whole latent + rope row and reads the latent as its value.
    q [T, H, D]; kv_new [T, 1, D]; kv_pool [slots, 1, D]; returns [T, H, latent_dim]."""
    heads, dim = q.shape[1], q.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim)
    starts = extend_start_locs(extend_lens).tolist()
    out = q.new_empty(q.shape[0], heads, latent_dim)
    for i, (start, prefix, ext) in enumerate(
        zip(starts, prefix_lens.tolist(), extend_lens.tolist(), strict=True)
    ):
        row = req_to_token[int(req_pool_idx[i])].to(torch.int64)
        kv_pool[row[prefix : prefix + ext]] = kv_new[start : start + ext].to(kv_pool.dtype)
        if ext == 0:
            continue
        keys = kv_pool[row[: prefix + ext], 0].float()  # [L, D]
        scores = torch.einsum("thd,ld->htl", q[start : start + ext].float(), keys) * scale
        query_pos = prefix + torch.arange(ext, device=q.device)
        allowed = torch.arange(prefix + ext, device=q.device)[None, :] <= query_pos[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        out[start : start + ext] = torch.einsum("htl,ld->thd", probs, keys[:, :latent_dim]).to(
            q.dtype
        )
    return out
