"""A block manager that keeps one entry per block, with block ids: vLLM's KV cache manager
written plainly, as the oracle `flexpipe.engine.block_manager` (kept in runs) must match state
for state (tests/engine/test_engine_block_manager.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RefKV:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0


class RefBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    def lookup(self, kv: RefKV, num_tokens: int) -> list[int]:
        hits: list[int] = []
        for h in kv.block_hashes[: (num_tokens - 1) // self.block_size]:
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        return hits

    def _take_new(self, kv: RefKV, num: int) -> None:
        for _ in range(num):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:
                del self.cached[old]
                self.block_hash[b] = None
            self.refs[b] = 1
            kv.block_ids.append(b)

    def allocate(
        self, kv: RefKV, num_total_tokens: int, hits: Sequence[int] = (), watermark: int = 0
    ) -> bool:
        need = -(-num_total_tokens // self.block_size) - len(kv.block_ids)
        num_hit_free = sum(1 for b in hits if self.refs[b] == 0)
        if len(self.free) - num_hit_free - max(need - len(hits), 0) < watermark:
            return False
        for b in hits:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
            kv.block_ids.append(b)
        need -= len(hits)
        kv.num_cached_blocks = max(kv.num_cached_blocks, len(kv.block_ids))
        if need > 0:
            self._take_new(kv, need)
        return True

    def append_blocks(self, kvs: Sequence[RefKV]) -> bool:
        if len(self.free) < len(kvs):
            return False
        for kv in kvs:
            self._take_new(kv, 1)
        return True

    def cache_full_blocks(self, kv: RefKV, num_computed_tokens: int) -> None:
        n_full = min(num_computed_tokens // self.block_size, len(kv.block_hashes))
        for i in range(kv.num_cached_blocks, n_full):
            b, h = kv.block_ids[i], kv.block_hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
        kv.num_cached_blocks = max(kv.num_cached_blocks, n_full)

    def release(self, kv: RefKV) -> None:
        for b in reversed(kv.block_ids):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
        kv.block_ids.clear()
        kv.num_cached_blocks = 0

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.refs[b] == 0:
                del self.cached[h]
                self.block_hash[b] = None

    # what the engine can observe, without block ids
    def cached_refs(self) -> dict[int, int]:
        return {h: self.refs[b] for h, b in self.cached.items()}

    def free_entries(self) -> list[int | None]:
        return [self.block_hash[b] for b in self.free]
