"""MLA models (DeepSeek-V3 class) on CPU: every attention through the absorbed latent path.

SGLang's MLA attention picks, per batch, a "MHA" path for prefills with no cached prefix (keys
and values expanded per head from the latent) or the absorbed "MLA" path (queries projected into
the latent; one shared key of latent + rope, the latent as value). Its CPU backends: the AMX one
has an MLA path (sgl_kernel CPU ops, no wheel here); the portable torch-native one reads keys and
values from the KV pool, which for MLA holds the latent, so the MHA path's per-head queries do
not match them (the first prefill fails on a shape error). The absorbed path matches the pool on
every batch, extends and decodes alike, so on the torch-native backend it is always taken.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.hooks import Hook


def _around_dispatch(original: Any, attn: Any, forward_batch: Any) -> Any:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_context import get_attn_backend
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    method = original(attn, forward_batch)
    if isinstance(get_attn_backend(), TorchNativeAttnBackend) and method.name.startswith("MHA"):
        return AttnForwardMethod.MLA
    return method


HOOKS = (
    Hook("sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.dispatch_attn_forward_method",
         _around_dispatch, HookType.AROUND, "(self, forward_batch)"),
)  # fmt: skip
