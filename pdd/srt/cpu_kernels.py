"""Pure-torch stand-ins for the few sgl_kernel ops SGLang's CPU engine calls.

SGLang's CPU engine imports a handful of ops from sgl_kernel at module import time, but no CPU
build of sgl_kernel is published. This module plays the part of `sgl_kernel` on machines with no
GPU and no real sgl_kernel (see cpu_support.py). Ops that are imported but never reached on our
paths resolve to a stub that fails loudly, naming the op, if it is ever called.
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request-to-token table."""
    del pool_len  # implied by req_to_token's shape
    cursor = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + n].to(req_to_token.dtype)
        cursor += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy KV rows src_loc -> tgt_loc in every layer buffer, given raw pointers and row strides."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for src, tgt in zip(src_loc.tolist(), tgt_loc.tolist(), strict=True):
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def _missing(name: str) -> Any:
    def fail(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this machine has no GPU and pdd's CPU stand-in "
            "for sgl_kernel does not implement it (see pdd/srt/cpu_kernels.py)"
        )

    fail.__name__ = name
    return fail


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
