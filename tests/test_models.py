"""`python -m pdd.models tiny` is deterministic; its tokenizer survives transformers loading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer

TEXT = "Hello world! def f(x):\n    return x ** 2  # 12345 <|im_end|> done"


def test_tiny_is_byte_identical_to_the_shared_build(tiny_model: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdd.models", "tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (tiny_model / name).read_bytes(), name


def test_tiny_tokenizer_ids_match_what_a_server_computes(tiny_model: Path) -> None:
    served = AutoTokenizer.from_pretrained(tiny_model)
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = served.encode(TEXT, add_special_tokens=False)
    assert ids == raw.encode(TEXT).ids
    assert served.decode(ids) == TEXT
    assert served.eos_token == "<|im_end|>"
    prompt = served.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
