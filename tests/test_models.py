"""`python -m pdd.models` is deterministic; its tokenizer survives transformers loading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pdd.models.__main__ import main

TEXT = "Hello world! def f(x):\n    return x ** 2  # 12345 <|im_end|> done"


def test_one_process_builds_each_model_as_the_shared_build(
    tiny_model: Path, wide_model: Path, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdd.models", "tiny", "wide", "--into", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for built, shared in ((tmp_path / "tiny", tiny_model), (tmp_path / "wide", wide_model)):
        for name in ("model.safetensors", "tokenizer.json", "config.json"):
            assert (built / name).read_bytes() == (shared / name).read_bytes(), (built, name)


def test_out_names_one_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["tiny", "wide", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--out takes one model, 2 named: use --into DIR" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


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
