"""A radix prefix cache: a token-level tree over the paged block pool (SGLang's RadixAttention).

The hash prefix cache of :mod:`llmlab.cache.block_manager` finds *full blocks* whose tokens
(and every token before them) equal a new prompt's. A radix tree finds the longest shared
prefix *token by token*: each edge holds a run of tokens and the physical blocks where their
K/V live, and a prompt walks down from the root comparing tokens (Zheng et al., *SGLang:
Efficient Execution of Structured Language Model Programs*, NeurIPS 2024,
https://arxiv.org/abs/2312.07104; their ``radix_cache.py``).

Layout. A node covers token positions ``start .. end - 1`` of every sequence whose prefix
runs through it (``end = start + len(tokens)``) and holds ``blocks``: the physical blocks of
the logical blocks ``start // bs .. (end - 1) // bs``. When a node starts mid-block its first
block holds the same K/V as its parent's last block in the slots before ``start`` (it *is*
that block, or a copy of it), so the block table of a path takes each logical block from
the deepest node that covers it (:meth:`RadixCache.block_table`).

References. The tree holds one allocator reference per (node, block) it lists, so a block
is free only when no table and no node lists it. A node is *locked* (``lock_ref > 0``) while
a live sequence's prefix runs through it; unlocked leaves are evicted least recently used
first, tail blocks first, when the pool needs blocks (:meth:`RadixCache.evict`).

Partial blocks. A match may end inside a block. The new sequence shares the full blocks
before it, and the block of the match's end is *copied on write*: its prompt will write the
slots after the match, which the tree's copy must keep, so the block manager gives it a
fresh block and a ``(src, dst)`` copy for the runner (``BlockManager.take_copies``). While a
sequence runs, only its full blocks enter the tree (its last block is still being written);
its computed tail joins when it is freed.

The two operations a student writes in notebook 13, :func:`radix_match` and
:func:`radix_insert`, use the tree's public helpers (:meth:`RadixCache.split`,
:meth:`RadixCache.add_leaf`, :meth:`RadixCache.touch`); ``RadixCache(..., match=,
insert=)`` takes replacements with the same signatures.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree and the node below it.

    ``tokens``: the run of token ids on the edge (empty only at the root); ``start``: the
    position of ``tokens[0]``; ``blocks``: physical blocks of logical blocks ``start // bs ..
    (end - 1) // bs``; ``children``: by their first token.
    """

    tokens: list[int]
    start: int
    blocks: list[int]
    parent: "RadixNode | None" = None
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def end(self) -> int:
        """Position after the node's last token (its depth in tokens)."""
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"RadixNode(tokens {self.start}..{self.end - 1}, blocks {self.blocks}, "
                f"lock {self.lock_ref}, {len(self.children)} children)")


def radix_match(tree: "RadixCache", tokens: Sequence[int]) -> tuple[RadixNode, int]:
    """The longest prefix of ``tokens`` the tree holds: ``(node, length)`` with
    ``node.end == length`` (a match that stops inside an edge splits it there).

    Walks from the root: the child keyed by the next token, then how many of its edge's
    tokens agree; a whole edge descends, part of one splits it and stops. Every node on the
    path is touched (most recently used).
    """
    node, pos = tree.root, 0
    tokens = list(tokens)
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        edge = child.tokens
        n = 0
        limit = min(len(edge), len(tokens) - pos)
        while n < limit and edge[n] == tokens[pos + n]:
            n += 1
        if n < len(edge):
            child = tree.split(child, n)
        node, pos = child, pos + n
        if n < len(edge):
            break
    tree.touch(node)
    return node, pos


def radix_insert(tree: "RadixCache", tokens: Sequence[int], blocks: Sequence[int]) -> RadixNode:
    """Put ``tokens`` (whose K/V are in ``blocks``, a sequence's block table covering them)
    into the tree; returns the node that ends at ``len(tokens)``.

    The part already in the tree keeps its blocks; where the tokens leave the tree (inside an
    edge: split it) the rest becomes one new leaf with the table's blocks from there on.
    """
    node, pos = radix_match(tree, tokens)
    if pos < len(tokens):
        node = tree.add_leaf(node, list(tokens[pos:]), blocks)
        tree.touch(node)
    return node


class RadixCache:
    """The radix tree over one allocator's blocks (see the module docstring).

    ``allocator``: the pool (``incref``, ``decref``, ``ref_counts``, ``num_free``), a
    :class:`~llmlab.cache.block_manager.BlockAllocator`. ``match`` and ``insert``: the two
    operations, :func:`radix_match` and :func:`radix_insert` by default.
    """

    def __init__(self, allocator, block_size: int, match: Callable | None = None,
                 insert: Callable | None = None):
        for name, fn in (("match", match), ("insert", insert)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a function; got {type(fn).__name__}")
        self.allocator = allocator
        self.block_size = block_size
        self.root = RadixNode([], 0, [])
        self._match = radix_match if match is None else match
        self._insert = radix_insert if insert is None else insert
        self._clock = itertools.count(1)
        self.evictions = 0           # blocks returned to the pool by evicting leaves

    # -- helpers the operations use -------------------------------------------------------
    def first_block(self, position: int) -> int:
        """Logical block index of a token position."""
        return position // self.block_size

    def touch(self, node: RadixNode) -> None:
        """Mark ``node`` and its ancestors most recently used."""
        t = next(self._clock)
        while node is not None:
            node.last_access = t
            node = node.parent

    def split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node``'s edge after its first ``n`` tokens (0 < n < len); returns the new
        upper node, which takes the first ``n`` tokens and is the parent of ``node``."""
        if not 0 < n < len(node.tokens):
            raise ValueError(f"split at {n}: allowed 1..{len(node.tokens) - 1} for an edge of "
                             f"{len(node.tokens)} tokens")
        bs, cut = self.block_size, node.start + n
        first = node.start // bs
        upper = RadixNode(node.tokens[:n], node.start,
                          node.blocks[:(cut - 1) // bs - first + 1], node.parent,
                          lock_ref=node.lock_ref, last_access=node.last_access)
        node.parent.children[node.tokens[0]] = upper
        node.blocks = node.blocks[cut // bs - first:]
        if cut % bs:                  # the block of the cut is now listed by both nodes
            self.allocator.incref(node.blocks[0])
        node.tokens = node.tokens[n:]
        node.start = cut
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def add_leaf(self, parent: RadixNode, tokens: list[int], table: Sequence[int]) -> RadixNode:
        """A new child of ``parent`` holding ``tokens`` (positions ``parent.end`` on), whose
        blocks are taken from ``table`` (a block table covering them); the tree takes a
        reference to each."""
        if not tokens:
            raise ValueError("a leaf needs at least one token")
        if tokens[0] in parent.children:
            raise ValueError(f"the node already has a child starting with token {tokens[0]}; "
                             "split that child where the tokens stop agreeing instead")
        bs, start = self.block_size, parent.end
        end = start + len(tokens)
        if len(table) < -(-end // bs):
            raise ValueError(f"a table of {len(table)} blocks cannot hold {end} tokens")
        blocks = list(table[start // bs:(end - 1) // bs + 1])
        for b in blocks:
            self.allocator.incref(b)
        if start % bs and parent.blocks[-1] != blocks[0]:
            # the leaf's first block is a copy of the parent's last one (same K/V before
            # ``start``): the parent takes the copy too, so the tree keeps one block there
            self.allocator.incref(blocks[0])
            if self.allocator.decref(parent.blocks[-1]) == 0:
                self.evictions += 1
            parent.blocks[-1] = blocks[0]
        leaf = RadixNode(list(tokens), start, blocks, parent)
        parent.children[tokens[0]] = leaf
        return leaf

    # -- what the block manager calls ----------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> tuple[RadixNode, int]:
        node, length = self._match(self, tokens)
        if not isinstance(length, int) or node.end != length:
            raise ValueError(f"match returned length {length!r} for a node ending at "
                             f"{node.end}; it must return (node, node.end)")
        return node, length

    def insert(self, tokens: Sequence[int], table: Sequence[int]) -> RadixNode:
        node = self._insert(self, tokens, table)
        if node.end != len(tokens):
            raise ValueError(f"insert of {len(tokens)} tokens returned a node ending at "
                             f"{node.end}")
        return node

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the tree holds; changes nothing (the scheduler's probe)."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            edge = child.tokens[:len(tokens) - pos]
            if list(tokens[pos:pos + len(edge)]) == edge:
                node, pos = child, pos + len(edge)
                continue
            n = 0
            while edge[n] == tokens[pos + n]:
                n += 1
            return pos + n
        return pos

    def path(self, node: RadixNode) -> list[RadixNode]:
        """Nodes from the root's child down to ``node``."""
        out = []
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def block_table(self, node: RadixNode) -> list[int]:
        """Blocks of positions ``0 .. node.end - 1``, each from the deepest node covering it."""
        table: list[int] = []
        for n in self.path(node):
            first = n.start // self.block_size
            del table[first:]
            table += n.blocks
        return table

    def lock(self, node: RadixNode) -> None:
        """A live sequence's prefix runs through ``node``: it and its ancestors stay."""
        for n in self.path(node):
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        for n in self.path(node):
            if n.lock_ref <= 0:
                raise ValueError(f"unlock of {n}, which is not locked")
            n.lock_ref -= 1

    # -- eviction ---------------------------------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evictable_blocks(self, keep: set[int] = frozenset()) -> int:
        """Blocks that evicting every unlocked node would return to the pool: those whose
        every reference comes from unlocked nodes, less the blocks in ``keep``."""
        count: dict[int, int] = {}
        for n in self.nodes():
            if n.lock_ref == 0:
                for b in n.blocks:
                    count[b] = count.get(b, 0) + 1
        refs = self.allocator.ref_counts
        return sum(1 for b, c in count.items() if c == refs[b] and b not in keep)

    def prefix_blocks(self, tokens: Sequence[int]) -> set[int]:
        """Every block a match of ``tokens`` (all held by the tree) would keep locked: the
        blocks of the nodes it runs through, and of the last one only up to its end."""
        node, pos, out = self.root, 0, set()
        while pos < len(tokens):
            node = node.children[tokens[pos]]
            n = min(len(node.tokens), len(tokens) - pos)
            first = node.start // self.block_size
            out.update(node.blocks[:(node.start + n - 1) // self.block_size - first + 1])
            pos += n
        return out

    def evict(self, num_free: int) -> None:
        """Evict from unlocked leaves, least recently used first, until the pool has
        ``num_free`` free blocks (or nothing is left to evict). A leaf gives up its last
        blocks first (its tail is the part least likely to be shared), and goes when it
        has none left."""
        while self.allocator.num_free < num_free:
            leaves = [n for n in self.nodes() if n.is_leaf and n.lock_ref == 0]
            if not leaves:
                return
            self.trim(min(leaves, key=lambda n: n.last_access),
                      num_free - self.allocator.num_free)

    def trim(self, leaf: RadixNode, num_blocks: int) -> None:
        """Drop the last ``num_blocks`` blocks of an unlocked leaf (and its tokens there);
        the whole leaf when that leaves it no token."""
        if not leaf.is_leaf or leaf.lock_ref or leaf is self.root:
            raise ValueError(f"only an unlocked leaf can be trimmed; got {leaf}")
        keep = len(leaf.blocks) - num_blocks
        end = (leaf.start // self.block_size + keep) * self.block_size
        if keep <= 0 or end <= leaf.start:
            self.remove(leaf)
            return
        dropped, leaf.blocks = leaf.blocks[keep:], leaf.blocks[:keep]
        del leaf.tokens[end - leaf.start:]
        for b in dropped:
            if self.allocator.decref(b) == 0:
                self.evictions += 1

    def remove(self, leaf: RadixNode) -> None:
        """Drop an unlocked leaf and its references."""
        if not leaf.is_leaf or leaf.lock_ref or leaf is self.root:
            raise ValueError(f"only an unlocked leaf can be removed; got {leaf}")
        del leaf.parent.children[leaf.tokens[0]]
        for b in leaf.blocks:
            if self.allocator.decref(b) == 0:
                self.evictions += 1

    @property
    def num_nodes(self) -> int:
        return len(self.nodes())

    @property
    def num_tokens(self) -> int:
        """Tokens the tree holds (the sum of its edges)."""
        return sum(len(n.tokens) for n in self.nodes())

    def references(self) -> list[int]:
        """Per block, how many nodes list it (what the tree adds to the ref counts)."""
        refs = [0] * len(self.allocator.ref_counts)
        for n in self.nodes():
            for b in n.blocks:
                refs[b] += 1
        return refs

    def check_invariants(self, locks: dict[int, int] | None = None) -> None:
        """Raise AssertionError when the tree's shape is broken; ``locks`` (node id -> how
        many live sequences run through it) is compared with the lock counts."""
        bs = self.block_size
        for n in self.nodes():
            assert n.tokens, "an edge without tokens"
            assert n.parent.children.get(n.tokens[0]) is n, "a child under the wrong key"
            assert n.start == n.parent.end, "a node does not start where its parent ends"
            assert len(n.blocks) == (n.end - 1) // bs - n.start // bs + 1, "blocks per node"
            assert n.lock_ref >= 0, "a negative lock count"
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), \
                "a child is locked more than its parent"
            if locks is not None:
                assert n.lock_ref == locks.get(id(n), 0), "lock count differs from sequences"
            for b in n.blocks:
                assert self.allocator.ref_counts[b] > 0, "the tree lists a free block"


__all__ = ["RadixCache", "RadixNode", "radix_match", "radix_insert"]
