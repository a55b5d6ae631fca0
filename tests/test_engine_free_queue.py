"""The block manager's free queue against an `OrderedDict` (what it replaced): the same
blocks in the same order after every pop, removal and append, and a bounded deque."""

from __future__ import annotations

import random
from collections import OrderedDict

from flexpipe.engine.free_queue import FreeQueue


def test_free_queue_matches_an_ordered_dict() -> None:
    rng = random.Random(5)
    num_blocks = 50
    q, ref = FreeQueue(num_blocks), OrderedDict.fromkeys(range(num_blocks))
    used: list[int] = []
    for _ in range(20_000):
        op = rng.random()
        if op < 0.4 and ref:  # a cache hit on a free block (more than pops: compactions)
            b = rng.choice(list(ref))
            q.remove(b)
            del ref[b]
            used.append(b)
        elif op < 0.45 and ref:  # allocation: the oldest first
            n = rng.randint(1, min(3, len(ref)))
            want = [ref.popitem(last=False)[0] for _ in range(n)]
            got = q.pop(n) if n > 1 or rng.random() < 0.5 else [q.pop_one()]
            assert got == want
            used += got
        elif used:  # a freed block goes to the tail
            b = used.pop(rng.randrange(len(used)))
            q.append(b)
            ref[b] = None
        assert len(q) == len(ref)
        assert len(q._queue) <= 2 * num_blocks + 1  # skipped entries are dropped in time
    assert list(q) == list(ref)
