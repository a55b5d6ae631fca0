"""An approximate per-instance index of the prompt blocks each instance has likely cached.

A producer of state, apart from the scorers that read it: the gateway inserts the blocks of every
prompt it routes and asks for the matched prefix length per instance; the `prefix` scorer and the
`prefix_affinity` policy only read the numbers. Pure data structure, no clock, no I/O, so the
simulator uses it too.

Blocks are character blocks of the prompt text (no tokenizer needed, engine-agnostic), hashed
in a chain with CRC-32 (`zlib.crc32(block, previous)`): a block's hash depends on everything
before it, so a hit on block i implies the whole prefix up to i matches (up to collisions;
the block index is folded into the upper bits to make them rarer, and it makes a hash name
its depth). CRC-32 is a single C call per block: a 4 KiB prompt hashes in a few microseconds.

Each instance's blocks form a radix tree of runs, as SGLang's radix cache keeps its tokens: a
node holds a run of consecutive blocks of one chain (a tuple of their hashes), its children
are keyed by their first block's hash. A prompt nobody shares is one node: inserting,
matching and evicting it are a few dict operations whatever its length (a per-block index
did ~30 dict insertions and deletions a request, on dicts past the CPU caches).

The bound (`max_blocks_per_instance`, standing in for the engine's finite KV cache) evicts
least recently used blocks, where an insertion uses its blocks deepest first: a prefix is
always more recently used than its suffixes, so eviction takes the tails of the least
recently used leaves, as an engine frees a request's blocks tail first, and what is left is
always a set of whole prefixes (a block whose prefix went could never match again). This is
exactly a per-block LRU with that use order (tests/policies/test_routing_policies.py checks it
against one): nodes sit in an `OrderedDict` in use order, each inserted prompt touches the
nodes on its path deepest first, and a run that a prompt ends inside is split so that only
its used head moves.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable
from itertools import chain, count


def prompt_block_hashes(text: bytes, block_chars: int = 64) -> tuple[int, ...]:
    """Chained hashes of the full `block_chars`-sized blocks of `text` (a partial tail is
    not hashed: engines only cache full blocks)."""
    bc = block_chars
    return chain_block_hashes([text[i : i + bc] for i in range(0, len(text) // bc * bc, bc)])


# i << 32 for the first blocks of a prompt: a block's index in its hash's upper bits, made
# once (each a 2-digit int a prompt's every block would otherwise allocate)
_SHIFTED = tuple(range(0, 4096 << 32, 1 << 32))


def chain_block_hashes(blocks: Iterable[bytes]) -> tuple[int, ...]:
    """The chained hashes of a text's full blocks, given the blocks (`prompt_block_hashes`;
    the simulator's prompts are runs of equal blocks, given without building the text).
    (One comprehension over precomputed shifted indices: the Python work per block is about
    twice the CRC's, and a new int per index was part of it.)"""
    crc = zlib.crc32
    h = 0
    shifted = chain(_SHIFTED, count(len(_SHIFTED) << 32, 1 << 32))  # (endless)
    return tuple([(h := crc(block, h)) | i for block, i in zip(blocks, shifted, strict=False)])


class _Node:
    """A run of consecutive blocks of one chain, under the node holding the block before
    its first (None: the first block of a prompt)."""

    __slots__ = ("children", "hashes", "parent")

    def __init__(self, hashes: tuple[int, ...], parent: _Node | None) -> None:
        self.hashes = hashes
        self.parent = parent
        self.children: dict[int, _Node] | None = None  # first block's hash -> node


class _Tree:
    """One instance's blocks."""

    __slots__ = ("lru", "num_blocks", "roots")

    def __init__(self) -> None:
        self.roots: dict[int, _Node] = {}  # first block's hash -> node
        # every node, least recently used first; a node is used more recently than its children
        self.lru: OrderedDict[_Node, None] = OrderedDict()
        self.num_blocks = 0


def _num_common(run: tuple[int, ...], hashes: tuple[int, ...], start: int) -> int:
    """How many leading blocks of `run` equal `hashes[start:]`, given that the first does.
    Chained hashes are equal up to the first difference and differ after it, so the edge is
    found by bisection."""
    lo, hi = 1, min(len(run), len(hashes) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if run[mid - 1] == hashes[start + mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    def __init__(self, max_blocks_per_instance: int = 50_000) -> None:
        if max_blocks_per_instance < 1:
            raise ValueError("max_blocks_per_instance must be >= 1")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._trees: dict[str, _Tree] = {}  # instance -> its blocks

    def instances(self) -> list[str]:
        return list(self._trees)

    def num_blocks(self, instance: str) -> int:
        tree = self._trees.get(instance)
        return tree.num_blocks if tree is not None else 0

    def match(self, instance: str, hashes: tuple[int, ...]) -> int:
        """How many leading blocks of `hashes` the instance likely holds."""
        tree = self._trees.get(instance)
        if tree is None or not hashes:
            return 0
        node = tree.roots.get(hashes[0])
        n = 0
        while node is not None:
            run = node.hashes
            end = n + len(run)
            if hashes[n:end] != run:
                return n + _num_common(run, hashes, n)
            n = end
            if n == len(hashes) or node.children is None:
                return n
            node = node.children.get(hashes[n])
        return n

    def insert(self, instance: str, hashes: tuple[int, ...]) -> None:
        """Record that `instance` now caches these blocks (most recently used)."""
        tree = self._trees.get(instance)
        if tree is None:
            tree = self._trees[instance] = _Tree()
        if hashes and hashes[0] not in tree.roots:  # a prompt it has no block of: one leaf
            leaf = _Node(hashes, None)
            tree.roots[hashes[0]] = leaf
            tree.lru[leaf] = None  # (most recently used: a new key goes last)
            tree.num_blocks += len(hashes)
            if tree.num_blocks > self.max_blocks_per_instance:
                self._evict(tree)
            return
        path: list[_Node] = []  # the nodes holding the prompt's blocks, first block's first
        parent: _Node | None = None
        siblings = tree.roots
        n = 0
        while n < len(hashes):
            node = siblings.get(hashes[n])
            if node is None:  # the rest is new: one leaf
                leaf = _Node(hashes[n:] if n else hashes, parent)
                siblings[hashes[n]] = leaf
                path.append(leaf)
                tree.num_blocks += len(hashes) - n
                break
            run = node.hashes
            end = n + len(run)
            if hashes[n:end] != run:  # the prompt leaves (or ends in) the run: split it
                k = min(_num_common(run, hashes, n), len(run) - 1)  # (a collision's bisection)
                head = _Node(run[:k], parent)  # the used head; the tail keeps its place
                siblings[run[0]] = head
                node.hashes = run[k:]
                node.parent = head
                head.children = {run[k]: node}
                node = head
                end = n + k
            path.append(node)
            n = end
            if n == len(hashes):
                break
            parent = node
            children = node.children
            if children is None:
                children = node.children = {}
            siblings = children
        lru = tree.lru
        for node in reversed(path):  # deepest first: each prefix is used after its suffixes
            lru[node] = None
            lru.move_to_end(node)
        if tree.num_blocks > self.max_blocks_per_instance:
            self._evict(tree)

    def _evict(self, tree: _Tree) -> None:
        """Drop least recently used blocks down to the bound: the tails of the least recently
        used leaves (the least recently used node is always a leaf: see `_Tree.lru`)."""
        lru = tree.lru
        excess = tree.num_blocks - self.max_blocks_per_instance
        while excess > 0:
            node = next(iter(lru))
            run = node.hashes
            if len(run) > excess:
                node.hashes = run[: len(run) - excess]
                tree.num_blocks -= excess
                return
            del lru[node]
            parent = node.parent
            siblings = tree.roots if parent is None else parent.children
            assert siblings is not None and not node.children
            del siblings[run[0]]
            tree.num_blocks -= len(run)
            excess -= len(run)

    def remove_instance(self, instance: str) -> None:
        self._trees.pop(instance, None)
