"""The router's guess of what each P's radix cache holds: the block hashes of the prompts it
sent there, least recently used dropped first. P does not report its tree (it sits next to the
router, where a wrong guess costs a recompute, not a WAN transfer), so this is approximate."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdd.cache.blocks import PromptHashes, as_hashes, held_prefix

BLOCK = 16


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def cached_prefix(self, prompt: Sequence[int] | PromptHashes) -> int:
        return held_prefix(prompt, BLOCK, self.blocks)

    def add(self, prompt: Sequence[int] | PromptHashes) -> None:
        for h in as_hashes(prompt).of(BLOCK):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
