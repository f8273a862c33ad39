"""Which SGLang model modules a server needs, read from their source (pdd.srt.model_archs)."""

import json
from pathlib import Path

import pytest

from pdd.srt import model_archs


def write_model(path: Path, archs: list[str]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": archs}))
    return path


def fake_models(path: Path) -> Path:
    path.mkdir()
    (path / "__init__.py").write_text("")
    llama = "class LlamaForCausalLM(nn.Module):\n    pass\nclass Phi3ForCausalLM(LlamaForCausalLM):"
    (path / "llama.py").write_text(llama)
    (path / "qwen2.py").write_text("from llama import LlamaForCausalLM\nclass Qwen2ForCausalLM:\n")
    (path / "gemma.py").write_text("# not a class Qwen2ForCausalLM\nclass GemmaForCausalLM:\n")
    return path


def test_only_the_modules_defining_a_models_architectures_stay_enabled(tmp_path: Path) -> None:
    models = fake_models(tmp_path / "models")
    qwen = write_model(tmp_path / "qwen", ["Qwen2ForCausalLM"])
    phi = write_model(tmp_path / "phi", ["Phi3ForCausalLM"])
    assert model_archs.disabled_modules([qwen], models) == ["gemma", "llama"]
    assert model_archs.disabled_modules([qwen, phi], models) == ["gemma"]


def test_an_architecture_no_module_defines_is_an_error_naming_it(tmp_path: Path) -> None:
    models = fake_models(tmp_path / "models")
    odd = write_model(tmp_path / "odd", ["OddForCausalLM"])
    with pytest.raises(ValueError, match="OddForCausalLM"):
        model_archs.disabled_modules([odd], models)
    with pytest.raises(ValueError, match="names no architectures"):
        model_archs.architectures(write_model(tmp_path / "none", []))


def test_the_pinned_sglang_defines_the_suites_models_where_expected() -> None:
    # An SGLang upgrade that moves these classes changes what the test command keeps enabled.
    models = model_archs.models_dir()
    archs = ["Qwen2ForCausalLM", "LlamaForCausalLM", "DeepseekV3ForCausalLM"]
    assert model_archs.defining_modules(archs, models) == {"qwen2", "llama", "deepseek_v2"}
    assert len(list(models.glob("*.py"))) > 100


def test_the_command_prints_a_comma_list_and_needs_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert model_archs.main([]) == 2
    model = write_model(tmp_path / "m", ["LlamaForCausalLM"])
    assert model_archs.main([str(model)]) == 0
    names = capsys.readouterr().out.strip().split(",")
    assert "llama" not in names and "qwen2" in names and "registry" in names
