"""An approximate per-instance index of the prompt blocks each instance has likely cached.

A producer of state (STYLE 3): the gateway inserts the blocks of every prompt it routes and
asks for the matched prefix length per instance; the `prefix` scorer and the
`prefix_affinity` policy only read the numbers. Pure data structure, no clock, no I/O, so the
simulator uses it too.

Blocks are character blocks of the prompt text (no tokenizer needed, engine-agnostic), hashed
in a chain with CRC-32 (`zlib.crc32(block, previous)`): a block's hash depends on everything
before it, so a hit on block i implies the whole prefix up to i matches (up to collisions;
the block index is folded into the upper bits to make them rarer). CRC-32 is a single C call
per block: a 4 KiB prompt hashes in a few microseconds.

Each instance's set is an `OrderedDict` used as an LRU (O(1) touch and eviction), bounded by
`max_blocks_per_instance`, standing in for the engine's finite KV cache.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable


def prompt_block_hashes(text: bytes, block_chars: int = 64) -> tuple[int, ...]:
    """Chained hashes of the full `block_chars`-sized blocks of `text` (a partial tail is
    not hashed: engines only cache full blocks)."""
    bc = block_chars
    return chain_block_hashes([text[i : i + bc] for i in range(0, len(text) // bc * bc, bc)])


def chain_block_hashes(blocks: Iterable[bytes]) -> tuple[int, ...]:
    """The chained hashes of a text's full blocks, given the blocks (`prompt_block_hashes`;
    the simulator's prompts are runs of equal blocks, given without building the text)."""
    crc = zlib.crc32
    hashes: list[int] = []
    append = hashes.append
    h = 0
    for i, block in enumerate(blocks):
        h = crc(block, h)
        append((i << 32) | h)
    return tuple(hashes)


class PrefixIndex:
    def __init__(self, max_blocks_per_instance: int = 50_000) -> None:
        if max_blocks_per_instance < 1:
            raise ValueError("max_blocks_per_instance must be >= 1")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # instance -> LRU of block hashes

    def instances(self) -> list[str]:
        return list(self._blocks)

    def num_blocks(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))

    def match(self, instance: str, hashes: tuple[int, ...]) -> int:
        """How many leading blocks of `hashes` the instance likely holds."""
        lru = self._blocks.get(instance)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def insert(self, instance: str, hashes: tuple[int, ...]) -> None:
        """Record that `instance` now caches these blocks (most recently used)."""
        lru = self._blocks.setdefault(instance, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.max_blocks_per_instance:
            lru.popitem(last=False)

    def remove_instance(self, instance: str) -> None:
        self._blocks.pop(instance, None)
