"""Paged KV blocks with prefix caching, as vLLM's KV cache manager keeps them.

- `num_blocks` blocks of `block_size` token slots (the count comes from the performance
  model's memory plan).
- A full block is identified by a chained hash: hash(parent block's hash, its token ids), so
  equal hashes mean equal prefixes. `cached` maps a hash to the block holding it.
- Blocks are ref-counted; a block whose count drops to 0 goes to the tail of the free queue but
  keeps its hash, so a later request with the same prefix can take it back (a cache hit).
  Allocation pops from the head: the least recently freed block is evicted first. A request's
  blocks are freed tail first, so a prefix outlives its suffixes.
- The free queue (flexpipe.engine.free_queue): O(1) append, O(1) pop of the oldest, O(1)
  removal from the middle when a cached free block is hit.

Pure bookkeeping: no clock, no I/O. The scheduler owns the policy (who gets blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flexpipe.engine.free_queue import FreeQueue


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The chained hash of one full block (Python's tuple hash is stable for ints)."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True)
class KVState:
    """What the block manager keeps per request (the request object holds one)."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # one per full block of tokens
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries_tokens: int = 0
    num_hit_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # block id -> its hash while registered; block_hash[b] == h exactly when cached[h] == b
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free_queue = FreeQueue(num_blocks)
        self.stats = PrefixCacheStats()

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, kv: KVState, token_ids: Sequence[int]) -> None:
        """Extend `kv.block_hashes` over every full block of `token_ids`."""
        bs = self.block_size
        n_full = len(token_ids) // bs
        hashes = kv.block_hashes
        i = len(hashes)
        if i >= n_full:
            return
        # `hash_block` over each next full block, its tuple cut by zip (once per prompt block
        # of every request: the simulator's most frequent hashing)
        h = hashes[-1] if hashes else None
        append = hashes.append
        it = iter(token_ids[i * bs : n_full * bs])
        for block in zip(*[it] * bs, strict=False):
            h = hash((h, block))
            append(h)

    def computed_blocks(self, kv: KVState, num_tokens: int) -> list[int]:
        """The longest run of cached blocks matching the request's prefix. At least one token
        is always left to compute (the last one: its logits are needed), as vLLM does."""
        if not self.enable_caching:
            return []
        max_blocks = (num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in kv.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.stats.num_queries_tokens += num_tokens
        self.stats.num_hit_tokens += len(hits) * self.block_size
        return hits

    # --- changes -------------------------------------------------------------------------
    def allocate(
        self,
        kv: KVState,
        num_total_tokens: int,
        computed: Sequence[int] = (),
        num_watermark_blocks: int = 0,
    ) -> bool:
        """Give `kv` blocks for its first `num_total_tokens` tokens, taking `computed` (cache
        hits from `computed_blocks`) first. False, and nothing changed, when there are too few
        free blocks (keeping `num_watermark_blocks` free). Runs once per request per step, so each
        case (cache hits; no new block; new blocks) is tested once, inline."""
        block_ids = kv.block_ids
        free = self.free_queue
        need = -(-num_total_tokens // self.block_size) - len(block_ids)
        if computed:
            refs = self.ref_counts
            num_hit_free = sum(1 for b in computed if refs[b] == 0)
            if len(free) - num_hit_free - max(need - len(computed), 0) < num_watermark_blocks:
                return False
            for b in computed:
                if refs[b] == 0:
                    free.remove(b)
                refs[b] += 1
                block_ids.append(b)
            need -= len(computed)
        elif need <= 0:  # a decode step within the blocks it holds: the common case
            if len(free) < num_watermark_blocks:
                return False
            if kv.num_cached_blocks < len(block_ids):
                kv.num_cached_blocks = len(block_ids)
            return True
        elif len(free) - need < num_watermark_blocks:
            return False
        if kv.num_cached_blocks < len(block_ids):
            kv.num_cached_blocks = len(block_ids)
        if need <= 0:
            return True
        refs = self.ref_counts
        block_hash = self.block_hash
        cached = self.cached
        new = free.pop(need)
        for b in new:
            old = block_hash[b]
            if old is not None:  # evict the least recently freed cached block
                del cached[old]  # (a block's hash maps to it: cache_full_blocks)
                block_hash[b] = None
            refs[b] = 1
        block_ids += new
        return True

    def append_blocks(self, kvs: Sequence[KVState]) -> bool:
        """One more block for each of `kvs`, in order (decodes that filled their last block):
        `allocate`'s new-block case for one block each, without the token counts. False, and
        nothing changed, if too few are free."""
        free = self.free_queue
        if len(free) < len(kvs):
            return False
        block_hash = self.block_hash
        cached = self.cached
        refs = self.ref_counts
        for kv, b in zip(kvs, free.pop(len(kvs)), strict=True):
            old = block_hash[b]
            if old is not None:  # evict the least recently freed cached block
                del cached[old]
                block_hash[b] = None
            refs[b] = 1
            kv.block_ids.append(b)
        return True

    def cache_full_blocks(self, kv: KVState, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_caching:
            return
        n_full = min(num_computed_tokens // self.block_size, len(kv.block_hashes))
        start = kv.num_cached_blocks
        if n_full <= start:
            return
        block_hash = self.block_hash
        cached = self.cached
        for b, h in zip(kv.block_ids[start:n_full], kv.block_hashes[start:n_full], strict=True):
            if block_hash[b] is None and h not in cached:
                block_hash[b] = h
                cached[h] = b
        kv.num_cached_blocks = n_full

    def free(self, kv: KVState) -> None:
        """Drop the request's references, tail first (so prefixes are evicted last)."""
        refs = self.ref_counts
        append = self.free_queue.append
        for b in reversed(kv.block_ids):
            n = refs[b] - 1
            refs[b] = n
            if not n:
                append(b)
        kv.block_ids.clear()
        kv.num_cached_blocks = 0

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.ref_counts[b] == 0:
                del self.cached[h]
                self.block_hash[b] = None
