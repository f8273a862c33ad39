"""The attention of MainDecode's handoff extends: pdd.kernels' Triton paged extend attention
where it applies, SGLang's own attention backend otherwise.

A handoff extend is many requests, each a short run of new tokens over a long cached prefix.
MD runs it through SGLang's model forward inside a forward context whose backend is a
`HandoffAttention`, so only those forwards see the kernel; every other forward (decode steps,
P's prefill) keeps SGLang's backend.

`--pdd-extend-kernel`: `auto` uses the kernel on CUDA tensors and SGLang's path elsewhere (CPU);
`triton` forces the kernel (on a CPU only under Triton's interpreter, TRITON_INTERPRET=1) and
fails the extend with the reason when a layer is outside what it supports; `sglang` never uses it.

An MLA layer (DeepSeek-V3 class) reaches the backend in absorbed form: queries in latent space
plus their rope part, one K row (latent + rope) per token, the latent as V; its pool is SGLang's
MLATokenToKVPool. Those layers run pdd.kernels.mla_extend_attention.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pdd.srt.cpu_support import triton_interpreted
from pdd.srt.flags import EXTEND_KERNELS

logger = logging.getLogger(__name__)


@dataclass
class KernelStats:
    kernel_layers: int = 0  # attention-layer calls the Triton kernel served
    sglang_layers: int = 0  # ... and SGLang's backend served


def kernel_problem(
    layer: Any, q: torch.Tensor, k: Any, pool: Any, save_kv_cache: bool, extras: dict[str, Any]
) -> str | None:
    """Why the Triton kernel cannot run this layer's extend; None when it can."""
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if not q.is_cuda and not triton_interpreted():
        return "the tensors are not on a CUDA device"
    if k is None or not save_kv_cache:
        return "the layer does not store new K/V"
    if any(v is not None for v in extras.values()):
        return f"the layer passes {sorted(k for k, v in extras.items() if v is not None)}"
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        return "the layer is not causal decoder self-attention"
    mla = type(pool) is MLATokenToKVPool
    if mla and (layer.tp_k_head_num != 1 or layer.v_head_dim != pool.kv_lora_rank):
        return "an MLA layer not in absorbed form (one latent K/V head)"
    if not mla and layer.qk_head_dim != layer.v_head_dim:
        return "K and V head dims differ"
    if (layer.sliding_window_size or -1) > -1:
        return "sliding-window attention"
    if layer.logit_cap and layer.logit_cap > 0:
        return "logit soft-capping"
    if layer.k_scale is not None or layer.v_scale is not None:
        return "a scaled (quantized) KV cache"
    if not mla and type(pool) is not MHATokenToKVPool:
        return f"a {type(pool).__name__} KV pool"
    group = layer.tp_q_head_num // layer.tp_k_head_num
    if layer.tp_q_head_num % layer.tp_k_head_num or group & (group - 1):
        return f"GQA group {layer.tp_q_head_num}/{layer.tp_k_head_num} is not a power of two"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype}"
    if pool.get_key_buffer(layer.layer_id).dtype != q.dtype:
        return "the KV cache dtype differs from the model's"
    return None


class HandoffAttention:
    """Stands in for SGLang's attention backend during a handoff extend."""

    def __init__(self, backend: Any, mode: str) -> None:
        if mode not in EXTEND_KERNELS:
            raise ValueError(f"extend kernel must be one of {EXTEND_KERNELS}, got {mode!r}")
        self.backend = backend
        self.mode = mode
        self.stats = KernelStats()
        self._logged: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        # Everything but `forward` (pools, metadata, ...) is the backend's own.
        return getattr(self.backend, name)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Forwards run inside this block route their attention through this object."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        if self.mode == "sglang":
            yield
            return
        with forward_context(ForwardContext(attn_backend=self)):  # type: ignore[arg-type]
            yield

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **extras: Any,
    ) -> torch.Tensor:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if forward_batch.forward_mode == ForwardMode.EXTEND:
            pool = self.backend.token_to_kv_pool
            problem = kernel_problem(layer, q, k, pool, save_kv_cache, extras)
            if problem is None:
                self.stats.kernel_layers += 1
                self._log_once("kernel", "PDD: handoff extends use the Triton extend kernel")
                return self._kernel(q, k, v, layer, forward_batch, pool)
            if self.mode == "triton":
                raise RuntimeError(f"--pdd-extend-kernel triton cannot run this layer: {problem}")
            self._log_once(problem, f"PDD: handoff extends use SGLang's attention: {problem}")
        self.stats.sglang_layers += 1
        return self.backend.forward(q, k, v, layer, forward_batch, save_kv_cache, **extras)

    def _kernel(
        self, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any, pool: Any
    ) -> torch.Tensor:
        from pdd.kernels.extend_attention import extend_attention
        from pdd.kernels.mla_extend_attention import mla_extend_attention

        heads, dim = layer.tp_q_head_num, layer.qk_head_dim
        if layer.v_head_dim != dim:  # MLA, absorbed (kernel_problem let only that through)
            latent = layer.v_head_dim
            out = q.new_empty((q.shape[0], heads * latent))
            mla_extend_attention(
                q.view(-1, heads, dim),
                k.view(-1, 1, dim),
                pool.get_key_buffer(layer.layer_id),
                self.backend.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.extend_prefix_lens,
                forward_batch.extend_seq_lens,
                latent,
                sm_scale=layer.scaling,
                out=out.view(-1, heads, latent),
                max_extend_len=max(forward_batch.extend_seq_lens_cpu),
            )
            return out
        out = q.new_empty((q.shape[0], heads * dim))
        extend_attention(
            q.view(-1, heads, dim),
            k,
            v,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            self.backend.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens,
            sm_scale=layer.scaling,
            out=out.view(-1, heads, dim),
            max_extend_len=max(forward_batch.extend_seq_lens_cpu),
        )
        return out

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.info(message)
