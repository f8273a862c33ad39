"""A simulator `Model` from a model's own config (Hugging Face `config.json`): its parameters,
active parameters, attention FLOPs and KV bytes per token, for standard attention (GQA) and for
multi-head latent attention (MLA: DeepSeek-V3 and Kimi-K2 class, whose KV is one compressed
latent plus a rope part per layer, not K and V per head)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdd.eval.sim.hardware import MODELS, Model

# DeepSeek-V3's published config (the fields the sizes depend on). With bf16 KV, as SGLang keeps
# it by default: 61 x (512 + 64) x 2 = 70,272 bytes per token.
DEEPSEEK_V3: dict[str, Any] = {
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "vocab_size": 129280, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
}  # fmt: skip
# Stored weights: DeepSeek-V3 ships 8-bit (1 byte per parameter).
DEEPSEEK_V3_WEIGHT_BYTES = 1.0


def kv_bytes_per_token(cfg: dict[str, Any], kv_dtype_bytes: float = 2) -> float:
    layers = cfg["num_hidden_layers"]
    if cfg.get("kv_lora_rank"):
        return layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * kv_dtype_bytes
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return layers * (cfg.get("num_key_value_heads") or heads) * head_dim * 2 * kv_dtype_bytes


def _attention_params(cfg: dict[str, Any]) -> tuple[float, float]:
    """Attention weights per layer, and FLOPs per (query, context) pair per layer."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):
        latent, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        qk = cfg["qk_nope_head_dim"] + rope
        q_lora = cfg.get("q_lora_rank")
        q = h * q_lora + q_lora * heads * qk if q_lora else h * heads * qk
        params = q + h * (latent + rope) + latent * heads * (cfg["qk_nope_head_dim"] +
                 cfg["v_head_dim"]) + heads * cfg["v_head_dim"] * h  # fmt: skip
        # Absorbed attention (decode): each head scores the latent + rope and reads the latent.
        return params, 2 * heads * (2 * latent + rope)
    head_dim = cfg.get("head_dim") or h // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    params = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    return params, 4 * heads * head_dim


def model_from_config(name: str, cfg: dict[str, Any], weight_bytes_per_param: float = 2,
                      kv_dtype_bytes: float = 2) -> Model:  # fmt: skip
    """Dense or MoE (routed experts plus shared ones, the first layers dense), GQA or MLA."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    attn, attn_flops = _attention_params(cfg)
    dense_mlp = 3 * h * cfg["intermediate_size"]
    experts = cfg.get("n_routed_experts") or 0
    if experts:
        expert = 3 * h * cfg["moe_intermediate_size"]
        dense_layers = cfg.get("first_k_dense_replace", 0)
        moe_layers = layers - dense_layers
        shared = cfg.get("n_shared_experts") or 0
        mlp_total = dense_layers * dense_mlp + moe_layers * (experts + shared) * expert
        mlp_active = dense_layers * dense_mlp + moe_layers * (
            cfg["num_experts_per_tok"] + shared) * expert  # fmt: skip
    else:
        mlp_total = mlp_active = layers * dense_mlp
    embed = 2 * cfg["vocab_size"] * h
    total = layers * attn + mlp_total + embed
    active = layers * attn + mlp_active + embed
    return Model(
        name,
        params_b=active / 1e9,
        weight_bytes=total * weight_bytes_per_param,
        kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype_bytes),
        total_params_b=total / 1e9 if experts else None,
        attn_flops_per_pair=layers * attn_flops,
    )


DEEPSEEK_V3_MODEL = model_from_config("deepseek-v3", DEEPSEEK_V3, DEEPSEEK_V3_WEIGHT_BYTES)
PRESETS = {**MODELS, DEEPSEEK_V3_MODEL.name: DEEPSEEK_V3_MODEL}


def resolve_model(given: str) -> Model:
    """A preset's name, or a model directory whose config.json gives the sizes (bf16)."""
    if given in PRESETS:
        return PRESETS[given]
    path = Path(given) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {given!r}: not a preset ({', '.join(sorted(PRESETS))}) and "
                         "not a model directory with a config.json")  # fmt: skip
    try:
        return model_from_config(Path(given).name, json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"--model {given!r}: its config.json lacks what the sizes need: "
                         f"{err!r}") from err  # fmt: skip


def describe(model: Model) -> str:
    total = f" of {model.total_params_b:.4g}B (MoE)" if model.total_params_b else " (dense)"
    return (f"{model.name}: {model.params_b:.3g}B active parameters{total}, "
            f"{model.kv_bytes_per_token / 1024:.1f} KiB of KV per token")  # fmt: skip
