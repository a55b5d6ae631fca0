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

Each instance's set is an LRU (O(1) touch and eviction), bounded by
`max_blocks_per_instance`, standing in for the engine's finite KV cache: a dict of the blocks
held and a deque of them in use order, where touching a block appends it again and counts
its earlier entry as stale (skipped when it reaches the head; a block's live entry is its
last; the deque is rebuilt when it is mostly stale). Per block it keeps a dict slot and a
deque slot, not an `OrderedDict`'s linked node too: at 50,000 blocks an instance the index
outgrows the CPU caches, and every insertion and eviction of a node was a cache miss (the
simulator inserts and evicts ~30 blocks a request).
"""

from __future__ import annotations

import zlib
from collections import deque
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


class _LRU:
    """One instance's blocks (see the module docstring)."""

    __slots__ = ("blocks", "order", "stale")

    def __init__(self) -> None:
        self.blocks: dict[int, None] = {}  # the blocks held
        self.order: deque[int] = deque()  # least recently used first, with stale entries
        self.stale: dict[int, int] = {}  # block -> its stale entries in `order`


def _compact(lru: _LRU) -> None:
    """`lru.order` without its stale entries (the same use order)."""
    stale = lru.stale
    live: deque[int] = deque()
    for h in lru.order:
        n = stale.get(h, 0)
        if n:
            stale[h] = n - 1
        else:
            live.append(h)
    lru.order = live
    lru.stale = {}


class PrefixIndex:
    def __init__(self, max_blocks_per_instance: int = 50_000) -> None:
        if max_blocks_per_instance < 1:
            raise ValueError("max_blocks_per_instance must be >= 1")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._lrus: dict[str, _LRU] = {}  # instance -> its blocks

    def instances(self) -> list[str]:
        return list(self._lrus)

    def num_blocks(self, instance: str) -> int:
        lru = self._lrus.get(instance)
        return len(lru.blocks) if lru is not None else 0

    def match(self, instance: str, hashes: tuple[int, ...]) -> int:
        """How many leading blocks of `hashes` the instance likely holds."""
        lru = self._lrus.get(instance)
        if lru is None:
            return 0
        blocks = lru.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, instance: str, hashes: tuple[int, ...]) -> None:
        """Record that `instance` now caches these blocks (most recently used)."""
        lru = self._lrus.get(instance)
        if lru is None:
            lru = self._lrus[instance] = _LRU()
        blocks, stale = lru.blocks, lru.stale
        append = lru.order.append
        for h in hashes:
            if h in blocks:  # touched: its entry so far goes stale
                stale[h] = stale.get(h, 0) + 1
            else:
                blocks[h] = None
            append(h)
        if len(blocks) > self.max_blocks_per_instance:
            self._evict(lru)
        if len(lru.order) > 2 * len(blocks) + 64:  # mostly stale (blocks touched again)
            _compact(lru)

    def _evict(self, lru: _LRU) -> None:
        """Drop least recently used blocks down to the bound."""
        blocks, stale = lru.blocks, lru.stale
        popleft = lru.order.popleft
        while len(blocks) > self.max_blocks_per_instance:
            h = popleft()
            n = stale.get(h, 0) if stale else 0
            if n == 0:
                del blocks[h]
            elif n == 1:
                del stale[h]
            else:
                stale[h] = n - 1

    def remove_instance(self, instance: str) -> None:
        self._lrus.pop(instance, None)
