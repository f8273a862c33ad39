"""Requests SGLang 0.5.23 accepts and its model then dies of, refused in SGLang's own request
validation (`TokenizerManager._validate_one_request`, whose ValueError is the client's 400).

A token id outside [0, vocab) reaches the embedding and raises IndexError in the scheduler,
which takes the whole server down: every later request fails until it is restarted by hand.
An empty prompt has nothing to prefill. Both come only from `input_ids` (text tokenizes into
the vocabulary), so a server reached directly, not only through the router, refuses them.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.hooks import Hook

_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def token_ids_problem(input_ids: object, vocab_size: int) -> str | None:
    """Why `input_ids` cannot be prefilled by a model of `vocab_size` tokens, or None."""
    if not isinstance(input_ids, list):
        return None  # SGLang's own checks cover the other shapes
    if not input_ids:
        return "the prompt is empty: give at least one token"
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"input_ids[{i}] is {t!r}, not a token id"
        if not 0 <= t < vocab_size:
            return f"input_ids[{i}] is {t}, outside the vocabulary [0, {vocab_size})"
    return None


def _before_validate_one_request(
    self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any
) -> None:
    # Embedding requests (no generation) go through here too; their ids reach the same table.
    problem = token_ids_problem(input_ids, self.model_config.vocab_size)
    if problem is not None:
        raise ValueError(problem)


HOOKS = (Hook(_TARGET, _before_validate_one_request, HookType.BEFORE, "(self, obj, input_ids)"),)
