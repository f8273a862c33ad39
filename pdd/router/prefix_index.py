"""The router's guess of what each P's radix cache holds: the block hashes of the prompts it
sent there, least recently used dropped first. P does not report its tree (it sits next to the
router, where a wrong guess costs a recompute, not a WAN transfer), so this is approximate."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdd.cache.blocks import block_hashes

BLOCK = 16


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        held = 0
        for h in block_hashes(tokens, BLOCK):
            if h not in self.blocks:
                break
            held += BLOCK
        return held

    def add(self, tokens: Sequence[int]) -> None:
        for h in block_hashes(tokens, BLOCK):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
