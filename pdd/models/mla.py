"""Tiny random models of the DeepSeek-V3 architecture, the class PDD is for: multi-head latent
attention (a compressed latent KV plus a decoupled rope part, one "head" in the KV pool), a few
routed experts plus a shared one, the first layer dense. SGLang's own DeepseekV3 model class
serves them.

- `mla`: the test model (latent 64 + rope 16 per layer: 640 bytes of KV per token in float32).
- `mla-wide`: the same compute, with a latent as wide as a real MLA model's KV per token
  (DeepSeek-V3: 61 layers x (512 + 64) = 35 KB per token at 8 bits, 70 KB at 16), for WAN runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from pdd.models.tiny import MAX_POSITIONS, VOCAB_SIZE, common_config, save_random_model
from pdd.models.tokenizer import save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class MlaShape:
    hidden: int
    layers: int
    heads: int
    kv_lora_rank: int  # the latent's width
    rope_dim: int  # the decoupled rope part of each key, shared by the heads
    nope_dim: int = 32
    v_dim: int = 32
    experts: int = 4
    experts_per_token: int = 2

    def kv_floats_per_token(self) -> int:
        return self.layers * (self.kv_lora_rank + self.rope_dim)


MLA = MlaShape(hidden=128, layers=2, heads=4, kv_lora_rank=64, rope_dim=16)
# 2 x (8128 + 64) floats = 32 KB per token in bf16, like the `wide` GQA model (and half of
# DeepSeek-V3's 70 KB at 16 bits).
MLA_WIDE = MlaShape(hidden=128, layers=2, heads=4, kv_lora_rank=8128, rope_dim=64)
MLA_SHAPES = {"mla": MLA, "mla-wide": MLA_WIDE}

# What DeepSeek's own configs carry and SGLang's model class reads (transformers' config class
# leaves them out): yarn rope (SGLang's CPU rope path requires a scaling), the MoE router's kind.
SGLANG_FIELDS: dict[str, Any] = {
    "rope_scaling": {
        "type": "yarn", "rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": MAX_POSITIONS // 4,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "ep_size": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
}  # fmt: skip


def make_mla(out: Path, shape: MlaShape = MLA) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(VOCAB_SIZE)
    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        moe_intermediate_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        kv_lora_rank=shape.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=shape.rope_dim,
        qk_nope_head_dim=shape.nope_dim,
        v_head_dim=shape.v_dim,
        n_routed_experts=shape.experts,
        n_shared_experts=1,
        num_experts_per_tok=shape.experts_per_token,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        **common_config(tokenizer),
    )
    save_random_model(DeepseekV3ForCausalLM, config, out)
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved.update(SGLANG_FIELDS)
    saved["architectures"] = ["DeepseekV3ForCausalLM"]
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tokenizer, out, MAX_POSITIONS)
    return out
