"""The block manager (kept in runs of blocks) against the per-block oracle
(tests/block_manager_reference.py): the same cache hits, the same answers, and after every
operation the same cached hashes with the same reference counts and the same free queue."""

from __future__ import annotations

import random

from flexpipe.engine.block_manager import BlockManager, KVState
from tests.block_manager_reference import RefBlockManager, RefKV


class _Req:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.kv = KVState()
        self.ref = RefKV()
        self.num_computed = 0
        self.running = False


def _check(bm: BlockManager, ref: RefBlockManager) -> None:
    assert bm.num_free_blocks == len(ref.free)
    assert bm.cached == ref.cached_refs()
    assert bm.free_entries() == ref.free_entries()
    for run in bm._heads.values():  # a run's cached blocks are a prefix, its free ones a suffix
        assert 0 < run.extent <= len(run.hashes) and run.held <= run.extent


def _fuzz(seed: int, num_ops: int, num_blocks: int, bs: int) -> dict[str, int]:
    rng = random.Random(seed)
    bm, ref = BlockManager(num_blocks, bs), RefBlockManager(num_blocks, bs)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6) * bs)] for _ in range(4)]
    reqs: list[_Req] = []
    counts = {"hits": 0, "refused": 0}
    for _ in range(num_ops):
        op = rng.random()
        running = [r for r in reqs if r.running]
        if (op < 0.25 and len(running) < 10) or not running:
            # admit: a shared prefix (or none) and a tail, or another request's prompt again
            if rng.random() < 0.3 and reqs:
                tokens = list(rng.choice(reqs).tokens)  # (duplicate registrations)
            else:
                tokens = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
                tokens += [rng.randrange(1000) for _ in range(rng.randrange(1, 4 * bs))]
            req = _Req(tokens)
            bm.update_hashes(req.kv, tokens)
            req.ref.block_hashes = list(bm.block_hashes(req.kv))
            hits = bm.computed_blocks(req.kv, len(tokens))
            ref_hits = ref.lookup(req.ref, len(tokens))
            assert len(hits) == len(ref_hits)
            counts["hits"] += len(hits)
            chunk = rng.randrange(1, len(tokens) + 1)
            first = min(len(tokens), len(hits) * bs + chunk)
            wm = rng.choice([0, 0, 2])
            ok = bm.allocate(req.kv, first, hits, wm)
            assert ok == ref.allocate(req.ref, first, ref_hits, wm)
            if ok:  # its first chunk computed: its full blocks registered
                req.num_computed = first
                req.running = True
                reqs.append(req)
                bm.cache_full_blocks(req.kv, first)
                ref.cache_full_blocks(req.ref, first)
            else:
                counts["refused"] += 1
        elif op < 0.6:  # compute a chunk (or a decode), registering the full blocks
            req = rng.choice(running)
            if req.num_computed >= len(req.tokens):
                req.tokens.append(rng.randrange(1000))  # a decode step's token
                bm.update_hashes(req.kv, req.tokens)
                req.ref.block_hashes = list(bm.block_hashes(req.kv))
            target = min(len(req.tokens), req.num_computed + rng.randrange(1, 3 * bs))
            ok = bm.allocate(req.kv, target)
            assert ok == ref.allocate(req.ref, target)
            if ok:
                req.num_computed = target
                bm.cache_full_blocks(req.kv, target)
                ref.cache_full_blocks(req.ref, target)
        elif op < 0.7:  # lazy decodes: one more block each
            some = rng.sample(running, rng.randrange(1, len(running) + 1))
            ok = bm.num_free_blocks >= len(some)
            if ok:
                bm.allocate_detached(len(some))
                for r in some:
                    r.kv.add_anonymous(1)
            assert ok == ref.append_blocks([r.ref for r in some])
        elif op < 0.98:  # finish or preempt
            req = rng.choice(running)
            bm.free(req.kv)
            ref.release(req.ref)
            req.running = False
            req.kv, req.ref = KVState(), RefKV()  # (a preempted one comes back as new)
        else:
            bm.reset_prefix_cache()
            ref.reset_prefix_cache()
        _check(bm, ref)
    return counts


def test_runs_match_the_per_block_oracle() -> None:
    num_hits = num_refused = 0
    for seed in range(24):
        counts = _fuzz(seed, num_ops=600, num_blocks=24 + 8 * (seed % 8), bs=2 + seed % 3)
        num_hits += counts["hits"]
        num_refused += counts["refused"]
    assert num_hits > 1000 and num_refused > 10  # both paths were exercised
