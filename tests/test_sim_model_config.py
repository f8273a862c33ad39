"""The simulator's model sizes from a model's config: GQA and MLA KV per token, MoE parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdd.eval.sim.cli import main as sim_main
from pdd.eval.sim.hardware import TINY
from pdd.eval.sim.model_config import DEEPSEEK_V3_MODEL, resolve_model
from pdd.models.kv import kv_bytes_per_token


def test_deepseek_v3_is_sized_as_published_with_a_latent_kv() -> None:
    m = DEEPSEEK_V3_MODEL
    assert m.total_params_b == pytest.approx(671, rel=0.01)
    assert m.params_b == pytest.approx(37, rel=0.02)
    assert m.kv_bytes_per_token == 61 * (512 + 64) * 2  # one latent + rope per layer, bf16


@pytest.mark.parametrize("which", ["tiny_model", "mla_model"])
def test_a_model_directory_gives_the_kv_its_servers_hold(
    which: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(which)
    m = resolve_model(str(model_dir))
    assert m.kv_bytes_per_token == kv_bytes_per_token(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (m.total_params_b is not None) == bool(cfg.get("n_routed_experts"))


def test_the_tiny_preset_matches_the_tiny_models_config(tiny_model: Path) -> None:
    m = resolve_model(str(tiny_model))
    assert m.kv_bytes_per_token == TINY.kv_bytes_per_token
    assert m.params_b == pytest.approx(TINY.params_b, rel=0.01)


def test_an_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sim_main(["sim", "--model", "no-such-model", "--requests", "5"])
    assert "not a preset" in capsys.readouterr().err
