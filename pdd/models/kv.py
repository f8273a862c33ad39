"""KV-cache size of a model: what crosses the WAN per prompt token."""

from __future__ import annotations

import json
from pathlib import Path

# Bytes per element of the KV cache for SGLang's --dtype values (its KV follows the model's).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """The KV of every layer for one token (bf16 by default): K and V of each KV head, or, for
    multi-head latent attention (MLA, DeepSeek-V3 class), one latent plus its rope part."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("kv_lora_rank"):
        latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        return cfg["num_hidden_layers"] * latent * dtype_bytes
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return cfg["num_hidden_layers"] * kv_heads * head_dim * 2 * dtype_bytes
