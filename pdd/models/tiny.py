"""A tiny random Qwen2 model: deterministic byte for byte, a few MB, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from pdd.models.tokenizer import ENDOFTEXT, IM_END, save_tokenizer, train_tokenizer

VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
SEED = 0
# The default init (0.02) makes greedy output one repeated token; 0.2 gives varied output.
INIT_RANGE = 0.2


def make_tiny(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(VOCAB_SIZE)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id(ENDOFTEXT),
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).bfloat16()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=False
    )
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out, MAX_POSITIONS)
    return out
