"""Paged KV blocks with prefix caching, as vLLM's KV cache manager keeps them.

- `num_blocks` blocks of `block_size` token slots (the count comes from the performance
  model's memory plan).
- A full block is identified by a chained hash: hash(parent block's hash, its token ids), so
  equal hashes mean equal prefixes. A block full of computed tokens registers its hash in the
  prefix cache, unless another block holds that hash already (then it stays anonymous).
- Blocks are ref-counted; a block whose count drops to 0 goes to the tail of the free queue but
  keeps its cache entry, so a later request with the same prefix can take it back (a cache
  hit). Allocation pops from the head: the least recently freed block is evicted first (its
  entry goes). A request's blocks are freed tail first, so a prefix outlives its suffixes.

That is vLLM's per-block model, and the state here is exactly its state (the test
tests/engine/test_engine_block_manager.py checks it, operation by operation, against a block manager
that keeps one entry per block). It is kept in runs instead of blocks:

- A `Run` is the blocks one request registered in one go (a prompt's blocks after a prefill
  chunk): their hashes, and how many of them are still cached (`extent`: always a prefix,
  since a run's later blocks are freed first). Only a run's first hash is indexed (`_heads`).
- A lookup walks the request's hashes: within a run while they match, else to the run headed
  by the next hash. No hash is registered twice, so the block holding hash i + 1 is either the
  next block of the run holding hash i or the head of a run: a walk finds every cached block a
  per-block index would.
- Whoever holds a run's blocks holds a prefix of them (the owner all, a cache hit the part its
  walk matched), so its reference counts fall along the run and its free blocks are a suffix,
  from the longest held prefix (`held`) to `extent`, queued highest first.
- A request's blocks are `Piece`s: a prefix of a run, or a count of anonymous blocks (not yet
  full, decoding, or duplicates of a cached hash), in block order.
- Hashes are computed when first needed (`_hashes`), from the request's token ids: a prompt
  whose first block starts no cached chain (`_roots`: the first hash of every run's request)
  can have no block cached anywhere, so it registers its blocks as a run knowing only the
  first hash, and the rest are computed only if a later lookup walks into that run. A prompt
  nobody shares is hashed once, not once per block.

So the common cases are a few dict and list operations per request, not one per block: a
request's ~30 prompt blocks are allocated, registered, freed and evicted in one go each (per
block, that bookkeeping was the simulator's largest cost, and its dicts outgrew the CPU caches).

Pure bookkeeping: no clock, no I/O. The scheduler owns the policy (who gets blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flexpipe.engine.free_queue import Entry, FreeQueue


class Run:
    """Blocks one request registered in one go (see the module docstring)."""

    __slots__ = (
        "_block_size",
        "_hashes",
        "_parent",
        "_tokens",
        "entries",
        "extent",
        "head",
        "holders",
        "manager",
        "root",
        "start",
    )

    def __init__(self, manager: BlockManager, kv: KVState, start: int, num: int) -> None:
        """`kv`'s blocks [start, start + num), its hashes computed through `start`."""
        self.manager = manager
        hashes = kv.block_hashes
        self.head = hashes[start]  # its key in the manager's `_heads`
        self.root = hashes[0]  # its request's first hash (the manager's `_roots`)
        self._parent = hashes[start - 1] if start else None
        self._tokens = kv.token_ids
        self._block_size = kv.block_size
        self.start = start
        self._hashes: list[int] | None = None  # computed when first needed
        self.extent = num  # blocks [0, extent) are cached
        self.holders = [num]  # the prefix each holder holds (the owner: all)
        self.entries: list[Entry] = []  # its entries in the free queue, oldest first

    @property
    def hashes(self) -> list[int]:
        """The hashes of its cached blocks (at least)."""
        hashes = self._hashes
        if hashes is None:
            start = self.start
            hashes = _chain(
                self._parent, self._tokens, start, start + self.extent, self._block_size
            )
            self._hashes = hashes
        return hashes

    @property
    def held(self) -> int:
        """The longest held prefix: blocks [held, extent) are free."""
        return max(self.holders) if self.holders else 0

    def take_free(self, upto: int) -> None:
        """A cache hit took this run's free blocks below `upto`: cut them from its entries
        (the latest entries hold the lowest free offsets)."""
        for entry in self.entries:
            if entry.lo < upto:
                entry.lo = upto
        self.entries = [e for e in self.entries if e.hi > e.lo]

    def evict_to(self, extent: int) -> None:
        """Blocks [extent, self.extent) were reused or forgotten: their cache entries go
        (the whole run, once none is left)."""
        self.extent = extent
        if not extent:
            self.manager._forget(self)


@dataclass(slots=True)
class Piece:
    """Consecutive blocks of a request: the first `num` blocks of `run`, or (run None) `num`
    anonymous blocks."""

    run: Run | None
    num: int


@dataclass(slots=True)
class KVState:
    """What the block manager keeps per request (the request object holds one)."""

    pieces: list[Piece] = field(default_factory=list)  # its blocks, in order
    num_blocks: int = 0
    # its token ids (the request's list: it only grows) and the hashes of their full blocks
    # computed so far (`_hashes`)
    token_ids: Sequence[int] = ()
    block_size: int = 1
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache

    def describe(self) -> list[tuple[int | None, int]]:
        """Its pieces as (first hash of the run, or None; number of blocks), for inspection."""
        return [(p.run.head if p.run else None, p.num) for p in self.pieces]

    def add_anonymous(self, num: int) -> None:
        pieces = self.pieces
        if pieces and pieces[-1].run is None:
            pieces[-1].num += num
        else:
            pieces.append(Piece(None, num))
        self.num_blocks += num


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries_tokens: int = 0
    num_hit_tokens: int = 0


Hit = tuple[Run, int]  # a cached block: its run and offset


def _hashes(kv: KVState, num_blocks: int) -> list[int]:
    """`kv.block_hashes`, computed up to `num_blocks` blocks (at most its full blocks)."""
    hashes = kv.block_hashes
    i = len(hashes)
    if i < num_blocks:
        n = min(num_blocks, len(kv.token_ids) // kv.block_size)
        if i < n:
            hashes += _chain(hashes[-1] if hashes else None, kv.token_ids, i, n, kv.block_size)
    return hashes


def _chain(
    parent: int | None, tokens: Sequence[int], first: int, end: int, block_size: int
) -> list[int]:
    """The chained hashes of blocks [first, end) of `tokens`, after `parent` (the hash of
    block first - 1, None for the first block): hash((parent hash, tuple of the block's token
    ids)) for each, the tuple cut by zip (Python's hash of ints and tuples of ints is stable
    from run to run)."""
    out: list[int] = []
    append = out.append
    h = parent
    it = iter(tokens[first * block_size : end * block_size])
    for block in zip(*[it] * block_size, strict=False):
        h = hash((h, block))
        append(h)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._heads: dict[int, Run] = {}  # first hash -> its run (while any block is cached)
        self._roots: dict[int, int] = {}  # first hash of a run's request -> number of runs
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

    @property
    def cached(self) -> dict[int, int]:
        """Every cached hash and its block's reference count (0: free), built on demand."""
        out: dict[int, int] = {}
        for run in list(self._heads.values()):
            refs = [0] * run.extent
            for n in run.holders:
                for k in range(n):
                    refs[k] += 1
            out.update(zip(run.hashes[: run.extent], refs, strict=True))
        return out

    def free_entries(self) -> list[int | None]:
        """Per free block, oldest first: the hash it caches, or None."""
        out: list[int | None] = []
        for e in self.free_queue.entries():
            if e.run is None:
                out += [None] * (e.hi - e.lo)
            else:
                out += e.run.hashes[e.lo : e.hi][::-1]
        return out

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_hashes(self, kv: KVState, token_ids: Sequence[int]) -> None:
        """`kv`'s blocks hold `token_ids` (the request's list, which only grows): their
        hashes are computed from it when needed."""
        if kv.token_ids is not token_ids:
            kv.token_ids = token_ids
            kv.block_size = self.block_size
            kv.block_hashes = []

    def block_hashes(self, kv: KVState) -> list[int]:
        """The hashes of every full block of `kv`'s tokens."""
        return _hashes(kv, len(kv.token_ids) // self.block_size)

    def _walk(self, hashes: Sequence[int]) -> list[Hit]:
        """The cached blocks holding `hashes[0]`, `hashes[1]`, ... up to the first not cached
        (see the module docstring: within a run, else the run headed by the hash)."""
        hits: list[Hit] = []
        heads = self._heads
        run: Run | None = None
        k = 0
        for h in hashes:
            k += 1
            if run is None or k >= run.extent or run.hashes[k] != h:
                run = heads.get(h)
                if run is None:
                    break
                k = 0
            hits.append((run, k))
        return hits

    def computed_blocks(self, kv: KVState, num_tokens: int) -> list[Hit]:
        """The longest run of cached blocks matching the request's prefix. At least one token
        is always left to compute (the last one: its logits are needed), as vLLM does."""
        if not self.enable_caching:
            return []
        max_blocks = (num_tokens - 1) // self.block_size
        hits: list[Hit] = []
        if max_blocks and _hashes(kv, 1) and kv.block_hashes[0] in self._heads:
            hits = self._walk(_hashes(kv, max_blocks)[:max_blocks])
        self.stats.num_queries_tokens += num_tokens
        self.stats.num_hit_tokens += len(hits) * self.block_size
        return hits

    # --- changes -------------------------------------------------------------------------
    def allocate(
        self,
        kv: KVState,
        num_total_tokens: int,
        computed: Sequence[Hit] = (),
        num_watermark_blocks: int = 0,
    ) -> bool:
        """Give `kv` blocks for its first `num_total_tokens` tokens, taking `computed` (cache
        hits from `computed_blocks`) first. False, and nothing changed, when there are too few
        free blocks (keeping `num_watermark_blocks` free). Runs once per request per step, so each
        case (cache hits; no new block; new blocks) is tested once, inline."""
        free = self.free_queue
        need = -(-num_total_tokens // self.block_size) - kv.num_blocks
        if computed:
            pieces = _pieces(computed)
            num_hit_free = sum(max(0, num - run.held) for run, num in pieces)
            if len(free) - num_hit_free - max(need - len(computed), 0) < num_watermark_blocks:
                return False
            for run, num in pieces:
                held = run.held
                if num > held:
                    run.take_free(num)
                    free.taken(num - held)
                run.holders.append(num)
                kv.pieces.append(Piece(run, num))
            kv.num_blocks += len(computed)
            need -= len(computed)
        elif need <= 0:  # a decode step within the blocks it holds: the common case
            if len(free) < num_watermark_blocks:
                return False
            if kv.num_cached_blocks < kv.num_blocks:
                kv.num_cached_blocks = kv.num_blocks
            return True
        elif len(free) - need < num_watermark_blocks:
            return False
        if kv.num_cached_blocks < kv.num_blocks:
            kv.num_cached_blocks = kv.num_blocks
        if need <= 0:
            return True
        free.pop(need)
        kv.add_anonymous(need)
        return True

    def allocate_detached(self, num: int) -> None:
        """`num` new blocks for requests told of them later (`KVState.add_anonymous`):
        decodes that filled their last block, which a lazy scheduler counts instead of
        handing them out one by one (the caller checked they are free). A new block is
        anonymous, so which request gets which one does not matter."""
        self.free_queue.pop(num)

    def cache_full_blocks(self, kv: KVState, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens in the prefix cache
        (each hash once: a block whose hash another block holds stays anonymous)."""
        if not self.enable_caching:
            return
        bs = self.block_size
        n_full = min(num_computed_tokens, len(kv.token_ids)) // bs
        start = kv.num_cached_blocks
        if n_full <= start:
            return
        kv.num_cached_blocks = n_full
        # (blocks past `num_cached_blocks` are the request's own, anonymous so far)
        if _hashes(kv, start + 1)[0] not in self._roots:
            # no cached chain starts with this request's first block: none of its blocks can
            # be cached (the common case: a prompt nobody shares)
            self._register(kv, start, n_full)
            return
        hashes = _hashes(kv, n_full)
        heads = self._heads
        if heads.keys().isdisjoint(hashes[start:n_full]) and not self._continues(kv, start):
            self._register(kv, start, n_full)  # none is cached yet
            return
        # some are cached already: register the ranges between them
        run, k = self._location(kv, start - 1) if start else (None, 0)
        begin = start  # first of the range not cached
        for i in range(start, n_full):
            h = hashes[i]
            k += 1
            if run is None or k >= run.extent or run.hashes[k] != h:
                run, k = heads.get(h), 0
            if run is not None:  # cached elsewhere: a duplicate
                if begin < i:
                    self._register(kv, begin, i)
                begin = i + 1
        if begin < n_full:
            self._register(kv, begin, n_full)

    def _continues(self, kv: KVState, start: int) -> bool:
        """Whether the request's hash `start` is cached as the next block of the run caching
        its hash `start - 1`."""
        if not start:
            return False
        run, k = self._location(kv, start - 1)
        if run is None or k + 1 >= run.extent:
            return False
        return run.hashes[k + 1] == kv.block_hashes[start]

    def _location(self, kv: KVState, block: int) -> tuple[Run | None, int]:
        """Where the request's hash `block` is cached (run None: nowhere). The request's own
        block when it holds a cached one; else a scan of its hashes up to it, each found as
        the next block of the previous one's run or as a run's head (unlike a lookup, the scan
        goes on past hashes that are not cached)."""
        pos = kv.num_blocks
        for piece in reversed(kv.pieces):
            pos -= piece.num
            if pos <= block:
                if piece.run is not None:
                    return piece.run, block - pos
                break
        heads = self._heads
        run: Run | None = None
        k = 0
        for h in _hashes(kv, block + 1)[: block + 1]:
            k += 1
            if run is None or k >= run.extent or run.hashes[k] != h:
                run, k = heads.get(h), 0
        return run, k

    def _register(self, kv: KVState, begin: int, end: int) -> None:
        """The request's anonymous blocks [begin, end) become a run."""
        _hashes(kv, begin + 1)
        run = Run(self, kv, begin, end - begin)
        self._heads[run.head] = run
        root = kv.block_hashes[0]
        self._roots[root] = self._roots.get(root, 0) + 1
        pieces = kv.pieces
        pos = kv.num_blocks
        n = len(pieces)
        while pos > begin:  # the piece holding block `begin`
            n -= 1
            pos -= pieces[n].num
        piece = pieces[n]
        assert piece.run is None and pos + piece.num >= end, "registering a block not its own"
        split = [Piece(None, begin - pos)] if begin > pos else []
        split.append(Piece(run, end - begin))
        if pos + piece.num > end:
            split.append(Piece(None, pos + piece.num - end))
        pieces[n : n + 1] = split

    def _forget(self, run: Run) -> None:
        """`run` has no cached block left."""
        if self._heads.get(run.head) is run:
            del self._heads[run.head]
        root = run.root
        n = self._roots[root] - 1
        if n:
            self._roots[root] = n
        else:
            del self._roots[root]

    def free(self, kv: KVState) -> None:
        """Drop the request's references, tail first (so prefixes are evicted last)."""
        free = self.free_queue
        for piece in reversed(kv.pieces):
            run = piece.run
            if run is None:
                free.add_anonymous(piece.num)
                continue
            held = run.held
            run.holders.remove(piece.num)
            now = run.held
            if now < held:
                free.add_run(run, now, held)
        kv.pieces = []
        kv.num_blocks = 0
        kv.num_cached_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (vLLM's /reset_prefix_cache)."""
        for run in list(self._heads.values()):
            run.evict_to(run.held)
            run.entries = []
        self.free_queue.forget_runs()


def _pieces(hits: Sequence[Hit]) -> list[tuple[Run, int]]:
    """Cache hits as (run, number of its leading blocks), in order."""
    out: list[tuple[Run, int]] = []
    for run, k in hits:
        if k == 0:
            out.append((run, 1))
        else:
            out[-1] = (run, k + 1)
    return out
