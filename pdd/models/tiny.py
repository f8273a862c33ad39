"""Tiny random Qwen2 models: deterministic byte for byte, a few MB, for tests and benchmarks.

- `tiny`: the test model (512 bytes of KV per token).
- `wide`: KV-heavy (32 KB of KV per token, like a large model) with a tiny model's compute, so
  that on a CPU the WAN, not the prefill, dominates: the regime PDD is built for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pdd.models.tokenizer import ENDOFTEXT, IM_END, save_tokenizer, train_tokenizer

VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
SEED = 0
# The default init (0.02) makes greedy output one repeated token; 0.2 gives varied output.
INIT_RANGE = 0.2


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int | None = None  # None: hidden // heads
    # SGLang 0.5.23's Qwen2 on CPU ignores a separate head_dim; its Llama honours it.
    llama: bool = False


TINY = Shape(hidden=128, layers=2, heads=4, kv_heads=2)
WIDE = Shape(hidden=128, layers=2, heads=16, kv_heads=16, head_dim=256, llama=True)
SHAPES = {"tiny": TINY, "wide": WIDE}


def make_tiny(out: Path, shape: Shape = TINY) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(VOCAB_SIZE)
    extra: dict[str, Any] = {} if shape.head_dim is None else {"head_dim": shape.head_dim}
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if shape.llama else (Qwen2Config, Qwen2ForCausalLM)
    )
    config = config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        **extra,
        **common_config(tokenizer),
    )
    save_random_model(model_cls, config, out)
    save_tokenizer(tokenizer, out, MAX_POSITIONS)
    return out


def common_config(tokenizer: Any) -> dict[str, Any]:
    """What every test model's config shares: positions, init, tokens, bf16 weights."""
    return {
        "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": INIT_RANGE,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "dtype": "bfloat16",
    }


def save_random_model(model_cls: Any, config: Any, out: Path) -> None:
    """Seeded random weights in bf16, greedy by default, written to `out`."""
    torch.manual_seed(SEED)
    model = model_cls(config).bfloat16()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=False
    )
    model.save_pretrained(out)
