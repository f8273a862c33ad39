"""Synthetic prompts as token ids: reproducible, and free of accidental shared prefixes."""

from __future__ import annotations

import random

FIRST_ID = 3  # ids below are special tokens in our models


def random_ids(n: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]
