"""Triton kernels for the batched extend attention MainDecode runs at a handoff.

Each request has a long cached prefix already in SGLang's paged KV pool (page size 1) and a
short run of new tokens. ``extend_attention`` stores the new K/V into the pool, then runs a
flash-attention pass: the prefix is gathered from the pool through ``req_to_token`` and the new
tokens are read straight from ``k_new``/``v_new`` with a causal mask, so the attention does not
depend on the order of the two launches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdd.kernels.reference import extend_start_locs

_LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    K_new,
    V_new,
    K_pool,
    V_pool,
    Req_to_token,
    Req_pool_idx,
    Prefix_lens,
    Extend_lens,
    Extend_start,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    stride_r2t,
    head_dim,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (request, block of new tokens, kv head); the last dim is unit-stride.
    req = tl.program_id(0)
    blk = tl.program_id(1)
    head = tl.program_id(2)
    ext_len = tl.load(Extend_lens + req)
    if blk * BLOCK_T >= ext_len:
        return
    start = tl.load(Extend_start + req).to(tl.int64)
    prefix = tl.load(Prefix_lens + req).to(tl.int64)
    row = tl.load(Req_pool_idx + req).to(tl.int64)

    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < ext_len
    mask = t_ok[:, None] & (d < head_dim)[None, :]
    slot = tl.load(Req_to_token + row * stride_r2t + prefix + t, mask=t_ok, other=0).to(tl.int64)
    tok = start + t
    k = tl.load(K_new + tok[:, None] * stride_knt + head * stride_knh + d[None, :], mask=mask)
    v = tl.load(V_new + tok[:, None] * stride_vnt + head * stride_vnh + d[None, :], mask=mask)
    tl.store(K_pool + slot[:, None] * stride_kpt + head * stride_kph + d[None, :], k, mask=mask)
    tl.store(V_pool + slot[:, None] * stride_vpt + head * stride_vph + d[None, :], v, mask=mask)


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    # fp32 dots would default to TF32 on NVIDIA GPUs; 16-bit inputs keep the backend default.
    if IEEE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, IEEE_DOT: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row whose keys are all masked so far keeps m = -inf; a 0 pivot avoids (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
    return m_new, l_i, acc


@triton.jit
def _extend_attention_kernel(
    Q,
    K_new,
    V_new,
    K_pool,
    V_pool,
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
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kpt,
    stride_kph,
    stride_vpt,
    stride_vph,
    stride_ot,
    stride_oh,
    stride_r2t,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    # One program per (request, block of new tokens, kv head). The GROUP query heads sharing
    # the kv head are folded into the rows, so each K/V tile is loaded once per group:
    # row r is new token r // GROUP of the block, query head kv_head * GROUP + r % GROUP.
    req = tl.program_id(0)
    blk = tl.program_id(1)
    kv_head = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    ext_len = tl.load(Extend_lens + req)
    tok_lo = blk * TOKENS
    if tok_lo >= ext_len:
        return
    start = tl.load(Extend_start + req).to(tl.int64)
    prefix = tl.load(Prefix_lens + req)
    row = tl.load(Req_pool_idx + req).to(tl.int64)

    r = tl.arange(0, BLOCK_M)
    tok = tok_lo + r // GROUP  # index among this request's new tokens
    q_head = kv_head * GROUP + r % GROUP
    tok_ok = tok < ext_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = (start + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
        mask=tok_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)

    # Cached prefix: paged gather through req_to_token; every new token sees all of it.
    for n0 in range(0, prefix, BLOCK_N):
        pos = n0 + n
        pos_ok = pos < prefix
        slot = tl.load(Req_to_token + row * stride_r2t + pos, mask=pos_ok, other=0).to(tl.int64)
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K_pool + slot[:, None] * stride_kpt + kv_head * stride_kph + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        qk = _dot(q, tl.trans(k), IEEE_DOT) * qk_scale
        qk = tl.where(pos_ok[None, :], qk, float("-inf"))
        v = tl.load(
            V_pool + slot[:, None] * stride_vpt + kv_head * stride_vph + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE_DOT)

    # New tokens, causal: keys up to the block's last token, read from k_new/v_new.
    key_hi = tl.minimum(ext_len, tok_lo + TOKENS)
    for j0 in range(0, key_hi, BLOCK_N):
        j = j0 + n
        j_ok = j < ext_len
        kv_rows = (start + j).to(tl.int64)
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            K_new + kv_rows[:, None] * stride_knt + kv_head * stride_knh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        qk = _dot(q, tl.trans(k), IEEE_DOT) * qk_scale
        qk = tl.where(j_ok[None, :] & (j[None, :] <= tok[:, None]), qk, float("-inf"))
        v = tl.load(
            V_new + kv_rows[:, None] * stride_vnt + kv_head * stride_vnh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE_DOT)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=tok_ok[:, None] & d_ok[None, :],
    )


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() != 3 or t.stride(2) != 1:
        raise ValueError(f"{name} must be 3-D with a unit-stride last dim, got {tuple(t.shape)}")


def extend_attention(
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
    out: torch.Tensor | None = None,
    *,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Stores the new K/V into the paged pool, then attends over prefix + new tokens.

    Shapes follow SGLang (page size 1): q [T, Hq, D]; k_new, v_new [T, Hkv, D], with
    T = sum(extend_lens) tokens packed in batch order; k_pool, v_pool [slots, Hkv, D] for one
    layer, written in place at req_to_token[req_pool_idx[i], prefix_lens[i] + j];
    req_to_token [rows, max_context] int32/int64; req_pool_idx, prefix_lens, extend_lens
    [batch]. Query head h reads kv head h // (Hq // Hkv). New token j of request i attends to
    positions 0 .. prefix_lens[i] + j. Softmax and accumulation are fp32; the result has
    q.dtype and goes to ``out`` (allocated if None; every element is written).

    dtypes: fp16 and bf16 for GPUs; fp32 too (its dots use IEEE precision, not TF32).
    Under Triton's CPU interpreter (TRITON_INTERPRET=1) use fp32 or fp16: the interpreter's
    bf16 ``tl.dot`` gives wrong results (triton-lang/triton#11584), this kernel does not work
    around it. ``max_extend_len`` sizes the grid; if None it is read from extend_lens, which
    synchronises with the device.
    """
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        _check_last_dim_contiguous(name, t)
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        _check_last_dim_contiguous(name, t)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    if k_new.shape != (num_tokens, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new shapes {k_new.shape}/{v_new.shape} do not match q")
    if k_pool.shape[1:] != (num_kv_heads, head_dim) or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool/v_pool shapes {k_pool.shape}/{v_pool.shape} do not match")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads is not a multiple of {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if group & (group - 1):
        raise ValueError(f"GQA group size must be a power of two, got {group}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    for name, t in (("k_new", k_new), ("v_new", v_new), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype}, q is {q.dtype}: dtypes must match")
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have a unit-stride last dim")

    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out is {out.dtype}{tuple(out.shape)}, expected {q.dtype}{q.shape}")
    else:
        _check_last_dim_contiguous("out", out)
    batch = extend_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return out

    device = q.device
    req_pool_idx = req_pool_idx.to(device)
    prefix_lens = prefix_lens.to(device)
    extend_lens = extend_lens.to(device)
    extend_start = extend_start_locs(extend_lens)
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    if max_extend_len <= 0:
        return out

    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    block_t = 32
    _store_kv_kernel[(batch, triton.cdiv(max_extend_len, block_t), num_kv_heads)](
        k_new,
        v_new,
        k_pool,
        v_pool,
        req_to_token,
        req_pool_idx,
        prefix_lens,
        extend_lens,
        extend_start,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        req_to_token.stride(0),
        head_dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )

    # 64 rows (tokens x group heads) and 64 keys per tile; wide heads halve the key tile to
    # keep the fp32 accumulator and the K/V tiles within registers/shared memory.
    block_m = max(64, group)
    block_n = 64 if block_d <= 128 else 32
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    grid = (batch, triton.cdiv(max_extend_len, block_m // group), num_kv_heads)
    _extend_attention_kernel[grid](
        q,
        k_new,
        v_new,
        k_pool,
        v_pool,
        out,
        req_to_token,
        req_pool_idx,
        prefix_lens,
        extend_lens,
        extend_start,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=4 if block_d <= 64 else 8,
    )
    return out
