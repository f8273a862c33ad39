"""Chained hashes of fixed-size token blocks: the unit of cache sync between MD and the router.

Block j of a token sequence is held when MD's tree holds all of tokens[: (j + 1) * block]; its
hash chains over every earlier block, so one 8-byte value names a whole prefix. MD and the
router compute it from the same token ids, so equal hashes mean equal prefixes (up to a 2**-64
collision). A partial last block has no hash: the router's view is at block granularity.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Container, Sequence

HASH_BYTES = 8
SEED = b"pdd-block-v1"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    if isinstance(tokens, array) and tokens.typecode == "q":
        return tokens.tobytes()
    return array("q", tokens).tobytes()


def block_hashes(
    tokens: Sequence[int], block: int, *, start_block: int = 0, namespace: str | None = None
) -> list[int]:
    """Hashes of the full blocks of `tokens`, from block `start_block` on (earlier blocks are
    hashed for the chain but not returned)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    data = _token_bytes(tokens)
    width = block * 8
    prev = hashlib.blake2b(SEED + (namespace or "").encode(), digest_size=HASH_BYTES).digest()
    out: list[int] = []
    for j in range(len(tokens) // block):
        prev = hashlib.blake2b(prev + data[j * width : (j + 1) * width], digest_size=8).digest()
        if j >= start_block:
            out.append(int.from_bytes(prev, "little"))
    return out


def pack(hashes: Sequence[int]) -> bytes:
    return array("Q", hashes).tobytes()


def unpack(data: bytes) -> list[int]:
    if len(data) % HASH_BYTES:
        raise ValueError(f"hash bytes must be a multiple of {HASH_BYTES}, got {len(data)}")
    return array("Q", data).tolist()


class PromptHashes:
    """A prompt's block hashes, computed once per block size however many caches look it up
    (every P's index, every MD's mirror) on the request's way through the router."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self._by_block: dict[int, list[int]] = {}

    def of(self, block: int) -> list[int]:
        hashes = self._by_block.get(block)
        if hashes is None:
            hashes = self._by_block[block] = block_hashes(self.tokens, block)
        return hashes


def as_hashes(prompt: Sequence[int] | PromptHashes) -> PromptHashes:
    return prompt if isinstance(prompt, PromptHashes) else PromptHashes(prompt)


def held_prefix(prompt: Sequence[int] | PromptHashes, block: int, held: Container[int]) -> int:
    """Tokens of the prompt's leading blocks that are all in `held`."""
    n = 0
    for h in as_hashes(prompt).of(block):
        if h not in held:
            break
        n += 1
    return n * block
