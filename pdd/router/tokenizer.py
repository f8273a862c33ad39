"""The router's own tokenizer, for the OpenAI endpoints: the router turns text and chat messages
into input ids itself, so every server of a request sees identical ids and the router can hash
prompts (cache sync). Loaded once, offline, from a local directory; transformers is imported
only when a tokenizer is configured."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pdd.router.body import Limits

# Files that make a directory loadable by AutoTokenizer (fast, slow or sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULT_MAX_PROMPT_TOKENS = 32768


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded, or cannot do what a request asks (no chat template)."""


def check_tokenizer_dir(path: Path) -> None:
    """Fails early (at argument parsing) with a clear message instead of a transformers trace."""
    if not path.is_dir():
        raise TokenizerError(f"--tokenizer {path}: not a directory (give a local model directory)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"--tokenizer {path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})"
        )


def default_model_name(path: Path) -> str:
    return path.resolve().name


def _config_int(path: Path, key: str) -> int | None:
    """A positive integer from the model directory's config.json, or None."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get(key) if isinstance(config, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def default_max_prompt_tokens(path: Path) -> int:
    """The model's context length (max_position_embeddings in config.json), else 32768."""
    return _config_int(path, "max_position_embeddings") or DEFAULT_MAX_PROMPT_TOKENS


def model_limits(path: Path) -> Limits:
    """The vocabulary and context window of the model whose directory `path` is; each None
    where its config.json does not say."""
    return Limits(_config_int(path, "vocab_size"), _config_int(path, "max_position_embeddings"))


def to_token_ids(value: Any) -> list[int]:
    """A plain list of ints from what a tokenizer returns: a list, a dict or BatchEncoding with
    `input_ids` (transformers 5 returns one from apply_chat_template), a batch of one, or an
    array."""
    if isinstance(value, Mapping) or hasattr(value, "input_ids"):
        value = value["input_ids"] if isinstance(value, Mapping) else value.input_ids
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, Sequence) and len(value) == 1 and isinstance(value[0], Sequence):
        value = value[0]
    if not isinstance(value, Sequence) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise TokenizerError(f"the tokenizer returned {type(value).__name__}, not token ids")
    return list(value)


@dataclass(frozen=True)
class RouterTokenizer:
    path: Path
    hf: Any  # a transformers PreTrainedTokenizerBase

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        # Special tokens as SGLang adds them to a /v1/completions text prompt (the tokenizer's
        # default, add_special_tokens=True), so ids equal what an SGLang server would make.
        return to_token_ids(self.hf.encode(text))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode_rendered(self.render_chat(messages))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The conversation through the chat template, ready for the assistant's answer."""
        if not self.has_chat_template:
            raise TokenizerError(
                f"the tokenizer at {self.path.name} has no chat template: "
                "use /v1/completions with a prompt instead"
            )
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if not isinstance(out, str):
            raise TokenizerError(f"the chat template rendered {type(out).__name__}, not text")
        return out

    def encode_rendered(self, text: str) -> list[int]:
        # As apply_chat_template(tokenize=True) does: the template writes the special tokens.
        return to_token_ids(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(t) for t in getattr(self.hf, "all_special_ids", ()) or ())


def load_tokenizer(path: Path) -> RouterTokenizer:
    check_tokenizer_dir(path)
    from transformers import AutoTokenizer  # lazily: only routers with --tokenizer need it

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types; all mean "unusable here"
        raise TokenizerError(f"--tokenizer {path}: cannot load a tokenizer: {err}") from err
    return RouterTokenizer(path, hf)
