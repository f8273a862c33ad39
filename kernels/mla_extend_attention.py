"""The handoff extend for multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2 class).

An MLA layer's KV pool holds, per token, one latent of `latent_dim` (the compressed K and V of
every head) followed by a decoupled rope part of `rope_dim`: SGLang's MLATokenToKVPool buffer,
[slots, 1, latent_dim + rope_dim]. In absorbed form (what SGLang's MLA decode runs) each query
head is already projected into the latent space, q = [q_latent | q_rope], the score against a
token is q_latent . latent + q_rope . rope, and the value is the latent itself; the per-head
output (in latent space) is projected back by the model after this kernel.

So every query head reads the same K/V rows: one program handles all heads of a block of new
tokens, loads each latent tile once and uses it as the key (with its rope part) and as the
value. The new tokens' latents are stored into the pool first, then attended to straight from
`kv_new` with a causal mask, as in pdd.kernels.extend_attention.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdd.kernels.extend_attention import _LOG2E, _dot, _online_softmax_step, _store_kv_kernel
from pdd.kernels.reference import extend_start_locs


@triton.jit
def _mla_extend_kernel(
    Q,
    KV_new,
    KV_pool,
    Out,
    Req_to_token,
    Req_pool_idx,
    Prefix_lens,
    Extend_lens,
    Extend_start,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_kpt,
    stride_ot,
    stride_oh,
    stride_r2t,
    latent_dim,
    rope_dim,
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # One program per (request, block of new tokens); row r is new token r // HEADS of the
    # block and query head r % HEADS.
    req = tl.program_id(0)
    blk = tl.program_id(1)
    TOKENS: tl.constexpr = BLOCK_M // HEADS
    ext_len = tl.load(Extend_lens + req)
    tok_lo = blk * TOKENS
    if tok_lo >= ext_len:
        return
    start = tl.load(Extend_start + req).to(tl.int64)
    prefix = tl.load(Prefix_lens + req)
    row = tl.load(Req_pool_idx + req).to(tl.int64)

    r = tl.arange(0, BLOCK_M)
    tok = tok_lo + r // HEADS
    head = r % HEADS
    tok_ok = tok < ext_len
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    dl_ok = dl < latent_dim
    dr_ok = dr < rope_dim
    q_at = Q + (start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_l = tl.load(q_at + dl[None, :], mask=tok_ok[:, None] & dl_ok[None, :], other=0.0)
    q_r = tl.load(q_at + latent_dim + dr[None, :], mask=tok_ok[:, None] & dr_ok[None, :],
                  other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)

    # Cached prefix, through req_to_token: every new token sees all of it.
    for n0 in range(0, prefix, BLOCK_N):
        pos = n0 + n
        pos_ok = pos < prefix
        slot = tl.load(Req_to_token + row * stride_r2t + pos, mask=pos_ok, other=0).to(tl.int64)
        kv_at = KV_pool + slot[:, None] * stride_kpt
        lat = tl.load(kv_at + dl[None, :], mask=pos_ok[:, None] & dl_ok[None, :], other=0.0)
        rope = tl.load(kv_at + latent_dim + dr[None, :], mask=pos_ok[:, None] & dr_ok[None, :],
                       other=0.0)  # fmt: skip
        qk = (_dot(q_l, tl.trans(lat), IEEE_DOT) + _dot(q_r, tl.trans(rope), IEEE_DOT)) * qk_scale
        qk = tl.where(pos_ok[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, lat, m_i, l_i, acc, IEEE_DOT)

    # New tokens, causal, from kv_new.
    key_hi = tl.minimum(ext_len, tok_lo + TOKENS)
    for j0 in range(0, key_hi, BLOCK_N):
        j = j0 + n
        j_ok = j < ext_len
        kv_at = KV_new + (start + j).to(tl.int64)[:, None] * stride_knt
        lat = tl.load(kv_at + dl[None, :], mask=j_ok[:, None] & dl_ok[None, :], other=0.0)
        rope = tl.load(kv_at + latent_dim + dr[None, :], mask=j_ok[:, None] & dr_ok[None, :],
                       other=0.0)  # fmt: skip
        qk = (_dot(q_l, tl.trans(lat), IEEE_DOT) + _dot(q_r, tl.trans(rope), IEEE_DOT)) * qk_scale
        qk = tl.where(j_ok[None, :] & (j[None, :] <= tok[:, None]), qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, lat, m_i, l_i, acc, IEEE_DOT)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_at = Out + (start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_at + dl[None, :], out.to(Out.dtype.element_ty),
             mask=tok_ok[:, None] & dl_ok[None, :])  # fmt: skip


def mla_extend_attention(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    kv_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_idx: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    latent_dim: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Stores kv_new into the pool, then attends over prefix + new tokens in absorbed form.

    q [T, H, latent_dim + rope_dim] (each head's query in latent space, then its rope part);
    kv_new [T, 1, latent_dim + rope_dim]; kv_pool [slots, 1, latent_dim + rope_dim], written in
    place at req_to_token[req_pool_idx[i], prefix_lens[i] + j]; the batch as in
    pdd.kernels.extend_attention. Returns [T, H, latent_dim] (into ``out`` if given). The
    scale defaults to 1/sqrt(latent_dim + rope_dim); MLA models pass their own (the
    un-absorbed head dim's). H must be a power of two. dtypes as extend_attention's.
    """
    for name, t in (("q", q), ("kv_new", kv_new), ("kv_pool", kv_pool)):
        if t.dim() != 3 or t.stride(2) != 1:
            raise ValueError(f"{name} must be 3-D with a unit-stride last dim, got {t.shape}")
    num_tokens, heads, dim = q.shape
    rope_dim = dim - latent_dim
    if not 0 < latent_dim < dim:
        raise ValueError(f"latent_dim {latent_dim} must be within 1..{dim - 1} (q's last dim)")
    if kv_new.shape != (num_tokens, 1, dim) or kv_pool.shape[1:] != (1, dim):
        raise ValueError(f"kv_new {tuple(kv_new.shape)} / kv_pool {tuple(kv_pool.shape)} must "
                         f"be [T or slots, 1, {dim}]")  # fmt: skip
    if heads & (heads - 1):
        raise ValueError(f"the number of heads must be a power of two, got {heads}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if kv_new.dtype != q.dtype or kv_pool.dtype != q.dtype:
        raise ValueError("q, kv_new and kv_pool must have one dtype")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have a unit-stride last dim")
    shape = (num_tokens, heads, latent_dim)
    if out is None:
        out = q.new_empty(shape)
    elif out.shape != shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out is {out.dtype}{tuple(out.shape)}, expected {q.dtype}{shape}")
    batch = extend_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return out

    device = q.device
    req_pool_idx, prefix_lens = req_pool_idx.to(device), prefix_lens.to(device)
    extend_lens = extend_lens.to(device)
    extend_start = extend_start_locs(extend_lens)
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    if max_extend_len <= 0:
        return out

    block_d = max(16, triton.next_power_of_2(dim))
    # The store kernel writes a K and a V pool; MLA has one, so it gets the same one twice.
    _store_kv_kernel[(batch, triton.cdiv(max_extend_len, 32), 1)](
        kv_new, kv_new, kv_pool, kv_pool, req_to_token, req_pool_idx, prefix_lens, extend_lens,
        extend_start, kv_new.stride(0), kv_new.stride(1), kv_new.stride(0), kv_new.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(0), kv_pool.stride(1),
        req_to_token.stride(0), dim, BLOCK_T=32, BLOCK_D=block_d,
    )  # fmt: skip

    block_l = max(16, triton.next_power_of_2(latent_dim))
    block_r = max(16, triton.next_power_of_2(rope_dim))
    # Rows = tokens x heads; a wide latent (512) keeps the key tile small so that the fp32
    # accumulator [rows, latent] and the latent tile fit on chip.
    block_m = max(16, heads) if block_l >= 256 else max(64, heads)
    block_n = 16 if block_l >= 256 else 64
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim)
    grid = (batch, triton.cdiv(max_extend_len, block_m // heads))
    _mla_extend_kernel[grid](
        q, kv_new, kv_pool, out, req_to_token, req_pool_idx, prefix_lens, extend_lens,
        extend_start, scale * _LOG2E, q.stride(0), q.stride(1), kv_new.stride(0),
        kv_pool.stride(0), out.stride(0), out.stride(1), req_to_token.stride(0), latent_dim,
        rope_dim, HEADS=heads, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_L=block_l,
        BLOCK_R=block_r, IEEE_DOT=q.dtype == torch.float32, num_warps=4 if block_l <= 64 else 8,
    )  # fmt: skip
    return out
