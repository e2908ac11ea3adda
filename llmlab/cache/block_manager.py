"""The block manager behind PagedAttention: KV memory handed out in fixed-size blocks.

The KV cache is cut into ``num_blocks`` physical blocks of ``block_size`` token slots,
like pages of virtual memory. Each sequence owns a *block table*: logical block i of the
sequence (tokens ``i*block_size .. (i+1)*block_size - 1``) lives in physical block
``table[i]``, and token ``pos`` is stored at slot ``table[pos // bs] * bs + pos % bs``.
Blocks are allocated one at a time as a sequence grows, so a sequence never holds more
than ``block_size - 1`` unused slots, and the physical blocks need not be contiguous.

Sharing:

* ``fork(parent, child)`` gives the child the parent's table and bumps the blocks'
  reference counts (parallel sampling, beam search). The first write into a shared,
  partly filled last block triggers *copy-on-write*: ``append_slot`` gives the writer a
  fresh block and returns ``(src, dst)`` so the caller copies the K/V already there.
* Prefix caching: a *full* block is identified by a hash of its tokens chained with the
  hash of the block before it (so equal blocks at equal depths after equal prefixes
  match). A block becomes findable only once its K/V is written: the caller reports
  that with :meth:`BlockManager.mark_computed` after the forward pass succeeds, never
  at ``allocate`` / ``append_slot`` time (a forward that fails part-way must not leave
  blocks of garbage K/V for the next prompt to reuse). ``allocate`` reuses cached
  blocks for the longest matching prefix, comparing the tokens on a hash hit. Blocks
  whose reference count drops to zero keep their content and stay findable until the
  pool needs them; they are evicted least recently used first. The last prompt token
  is always recomputed (its logits are needed), so the block that holds it is never
  taken from the cache.

Running out of blocks raises :class:`NoFreeBlocksError` *before* anything changes, and
``can_allocate`` / ``can_append`` answer whether an operation would succeed, so a
scheduler can preempt a sequence (free it and recompute later) instead of crashing.

The pool itself is a :class:`BlockAllocator`; ``BlockManager(..., allocator=obj)``
takes any object with the same interface instead (see :class:`BlockManager`), so a
hand-written allocator can be dropped in under the same block tables.

``prefix_cache`` chooses the prefix cache: ``"hash"`` (the full-block hashes above, the
default), ``"radix"`` (a token-level radix tree over the same pool, with partial-block
matches that copy on write and LRU eviction of unlocked leaves:
:mod:`llmlab.cache.radix`, notebook 13) or None. ``enable_prefix_caching=False`` is the
older spelling of ``prefix_cache=None``.

Taught in notebook 04 (PagedAttention).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from .radix import RadixCache, RadixNode

PREFIX_CACHES = ("hash", "radix", None)


class NoFreeBlocksError(RuntimeError):
    """The block pool cannot satisfy a request; nothing was changed.

    ``needed`` blocks were asked for and ``free`` were available. A scheduler catches
    this (or asks ``can_allocate`` / ``can_append`` first) and preempts a sequence.
    """

    def __init__(self, needed: int, free: int, what: str = "allocate"):
        self.needed, self.free = needed, free
        super().__init__(f"{what}: needs {needed} free KV block(s) but only {free} are free; "
                         "free or preempt a sequence first")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size!r} must be a power of two "
                         "(1, 2, 4, ..., 256)")


def hash_block(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full block: its tokens chained with the hash of the block before it.

    Python's hash of a tuple of ints is deterministic across runs (no salt for ints).
    """
    return hash((parent_hash, tuple(tokens)))


class BlockAllocator:
    """A pool of physical block ids with reference counts and a prefix-cache index.

    A block is in exactly one of three states: *in use* (ref_count > 0), *cached*
    (ref_count == 0 but its content is still indexed by hash, evictable, least recently
    used first) or *free* (in the free list, content meaningless). Cached blocks count
    as free space: they are reclaimed on demand.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
        _check_block_size(block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # LRU first
        self._hash_to_block: dict[int, int] = {}
        self._block_key: dict[int, tuple] = {}                    # block -> (hash, parent, tokens)
        self.evictions = 0

    # -- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free + cached-but-unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks whose content is still findable by hash."""
        return len(self._evictable)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    # -- allocation ----------------------------------------------------------------
    def allocate(self) -> int:
        """A block with reference count 1; evicts the least recently used cached block
        when the free list is empty. Raises NoFreeBlocksError when neither exists."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self.evictions += 1
        else:
            raise NoFreeBlocksError(1, 0)
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is free; only blocks in use or cached can be shared")
            del self._evictable[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> int:
        """Drop one reference; at zero the block is cached (if hashed) or freed."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} has no references to drop (double free?)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self._block_key:
                self._evictable[block] = None          # most recently used at the end
            else:
                self._free.append(block)
        return self.ref_counts[block]

    # -- prefix-cache index --------------------------------------------------------
    def lookup(self, block_hash: int, parent_hash: int | None, tokens: tuple) -> int | None:
        """The cached block with this hash *and* these tokens after this parent, or None."""
        block = self._hash_to_block.get(block_hash)
        if block is None or self._block_key[block] != (block_hash, parent_hash, tokens):
            return None
        return block

    def register(self, block: int, block_hash: int, parent_hash: int | None,
                 tokens: tuple) -> None:
        """Index a full block by hash (the first block with a given hash wins)."""
        if block_hash in self._hash_to_block or block in self._block_key:
            return
        self._hash_to_block[block_hash] = block
        self._block_key[block] = (block_hash, parent_hash, tokens)

    def _forget(self, block: int) -> None:
        key = self._block_key.pop(block, None)
        if key is not None and self._hash_to_block.get(key[0]) == block:
            del self._hash_to_block[key[0]]

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list, the cache and the ref counts disagree."""
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached"
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert not used & (free | cached), "a block is both free and in use"
        assert used | free | cached == set(range(self.num_blocks)), "a block was lost"
        for b in cached:
            assert b in self._block_key, "a cached block has no hash"
        for h, b in self._hash_to_block.items():
            assert self._block_key[b][0] == h, "hash index points at the wrong block"


def append_to_table(block_table: list[int], num_tokens: int, allocator, block_size: int
                    ) -> tuple[int, tuple[int, int] | None]:
    """Give token ``num_tokens`` (the next one) of a sequence its slot; -> (slot, cow).

    ``block_table`` (the sequence's physical blocks, updated in place) gets a new block
    when the last one is full; a partly filled last block that another table shares
    (``ref_counts > 1``) is replaced by a fresh copy, and ``cow = (src, dst)`` tells the
    caller to copy the K/V already in ``src``. Raises NoFreeBlocksError, changing nothing,
    when a block is needed and ``allocator`` has none.
    """
    cow = None
    if num_tokens % block_size == 0:
        block_table.append(allocator.allocate())
    else:
        last = block_table[-1]
        if allocator.ref_counts[last] > 1:
            new = allocator.allocate()              # before the decref: a refusal changes nothing
            allocator.decref(last)
            block_table[-1] = new
            cow = (last, new)
    return block_table[num_tokens // block_size] * block_size + num_tokens % block_size, cow


_ALLOCATOR_METHODS = ("allocate", "incref", "decref", "num_free", "ref_counts")
_PREFIX_CACHE_METHODS = ("lookup", "register", "is_evictable")


def resolve_prefix_cache(prefix_cache, enable_prefix_caching: bool = True):
    """``prefix_cache`` ("hash", "radix", None, or a factory ``(allocator, block_size) ->
    RadixCache``) with the older ``enable_prefix_caching`` switch applied: False turns the
    default "hash" into None, and contradicts any other cache (ValueError)."""
    if not (prefix_cache in PREFIX_CACHES or callable(prefix_cache)):
        raise ValueError(f"prefix_cache={prefix_cache!r}; allowed: {list(PREFIX_CACHES)} or a "
                         "function (allocator, block_size) -> RadixCache")
    if not enable_prefix_caching:
        if prefix_cache not in ("hash", None):
            raise ValueError(f"enable_prefix_caching=False contradicts prefix_cache="
                             f"{prefix_cache!r}; pass prefix_cache=None alone")
        return None
    return prefix_cache


def _check_allocator(allocator, num_blocks: int, enable_prefix_caching: bool) -> None:
    """A replacement allocator must offer what :class:`BlockManager` calls."""
    missing = [m for m in _ALLOCATOR_METHODS if not hasattr(allocator, m)]
    if missing:
        raise ValueError(f"allocator {type(allocator).__name__} lacks {missing}; an allocator "
                         f"needs {list(_ALLOCATOR_METHODS)} (see BlockAllocator)")
    missing = [m for m in _PREFIX_CACHE_METHODS if not hasattr(allocator, m)]
    if enable_prefix_caching and missing:
        raise ValueError(f"allocator {type(allocator).__name__} lacks {missing}, which prefix "
                         "caching needs; pass enable_prefix_caching=False or add them")
    if len(allocator.ref_counts) != num_blocks:
        raise ValueError(f"allocator has {len(allocator.ref_counts)} blocks but "
                         f"num_blocks={num_blocks}")


@dataclass
class _SeqState:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    tokens: list[int | None] = field(default_factory=list)   # None: token id not known
    hashes: list[int] = field(default_factory=list)          # hashes of the full blocks
    node: RadixNode | None = None      # radix: the deepest tree node it holds locked
    computed: int = 0                  # tokens whose K/V are written (mark_computed)


@dataclass
class PrefixCacheStats:
    queries: int = 0          # prompt tokens looked up
    hits: int = 0             # prompt tokens served from cached blocks

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Block tables for many sequences over one :class:`BlockAllocator`.

    >>> bm = BlockManager(num_blocks=8, block_size=4)
    >>> bm.allocate("a", [1, 2, 3, 4, 5])       # 5 tokens -> 2 blocks, nothing cached yet
    0
    >>> bm.block_table("a"), bm.num_free_blocks
    ([0, 1], 6)
    >>> bm.append_slot("a", token_id=6)        # slot for token 6 (position 5), no copy
    (5, None)

    The API is what a continuous-batching scheduler needs: ``can_allocate`` and
    ``allocate`` for a waiting prompt (returns how many prompt tokens are already
    cached), ``can_append`` and ``append_slot`` for each decode step (returns the slot to
    write and an optional copy-on-write ``(src, dst)``), ``mark_computed`` once a forward
    pass has written K/V (their full blocks join the prefix cache), ``fork``, ``free``.

    ``allocator``: the pool of physical blocks, by default a :class:`BlockAllocator`.
    Any object with the same interface can replace it:

    * ``allocate() -> int``: a block id with reference count 1 (raise
      :class:`NoFreeBlocksError` when none is left);
    * ``incref(block)`` / ``decref(block) -> int``: share a block / drop one reference
      and return how many are left (at zero the block is free again);
    * ``num_free``: how many blocks ``allocate`` can still hand out;
    * ``ref_counts``: a list with the reference count of each block id;
    * with ``enable_prefix_caching`` also ``lookup(hash, parent_hash, tokens)``,
      ``register(block, hash, parent_hash, tokens)`` and ``is_evictable(block)``, as
      :class:`BlockAllocator` defines them. A ``check_invariants()`` method, if it has
      one, is called by :meth:`check_invariants`.

    ``append_slot``: the function that gives a sequence's next token its slot, called as
    ``append_slot(block_table, num_tokens, allocator, block_size) -> (slot, cow)`` with the
    sequence's own table (see :func:`append_to_table`, the default); the manager checks
    first that a block it may need is free, and keeps the token count.

    ``prefix_cache``: ``"hash"``, ``"radix"``, None, or a function ``(allocator,
    block_size) -> RadixCache`` (a radix tree with other ``match`` / ``insert``, notebook
    13). With ``"radix"``, ``allocate`` may queue block copies (a match that ends inside a
    block): the caller takes them with :meth:`take_copies` and copies before the forward.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 allocator=None, append_slot: Callable | None = None,
                 prefix_cache: str | Callable | None = "hash"):
        if append_slot is not None and not callable(append_slot):
            raise ValueError(f"append_slot must be a function (block_table, num_tokens, "
                             f"allocator, block_size) -> (slot, cow); got "
                             f"{type(append_slot).__name__}")
        self._append = append_to_table if append_slot is None else append_slot
        prefix_cache = resolve_prefix_cache(prefix_cache, enable_prefix_caching)
        if allocator is None:
            allocator = BlockAllocator(num_blocks, block_size)
        else:
            _check_block_size(block_size)
            _check_allocator(allocator, num_blocks, prefix_cache == "hash")
        self.allocator = allocator
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.radix: RadixCache | None = None
        if prefix_cache is not None and prefix_cache != "hash":
            self.radix = (RadixCache(allocator, block_size) if prefix_cache == "radix"
                          else prefix_cache(allocator, block_size))
            prefix_cache = "radix"
        self.prefix_cache = prefix_cache
        self.enable_prefix_caching = prefix_cache is not None
        self.stats = PrefixCacheStats()
        self._seqs: dict[Hashable, _SeqState] = {}
        self._copies: list[tuple[int, int]] = []

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (radix: blocks only unlocked nodes hold count)."""
        if self.radix is not None:
            return self.allocator.num_free + self.radix.evictable_blocks()
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.allocator.num_free

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of the sequence, logical order (a copy)."""
        return list(self._state(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots the sequence has reserved so far (prompt + appended)."""
        return self._state(seq_id).num_tokens

    def slot(self, seq_id: Hashable, position: int) -> int:
        """Flat slot of token ``position``: ``table[pos // bs] * bs + pos % bs``."""
        st = self._state(seq_id)
        if not 0 <= position < st.num_tokens:
            raise ValueError(f"position {position} is outside sequence {seq_id!r} "
                             f"of {st.num_tokens} tokens")
        bs = self.block_size
        return st.blocks[position // bs] * bs + position % bs

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end - 1``."""
        return [self.slot(seq_id, p) for p in range(start, end)]

    def _state(self, seq_id: Hashable) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}; known: {list(self._seqs)[:8]}") from None

    # -- prompt allocation ---------------------------------------------------------
    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) for the longest cached prefix of ``tokens``.

        Only full blocks strictly before the block holding the last token can match,
        because the last prompt token must be recomputed to get its logits. (The hash
        cache; the radix cache matches with :meth:`cached_prefix_length`.)
        """
        if self.prefix_cache != "hash":
            return [], []
        bs, parent = self.block_size, None
        blocks, hashes = [], []
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(parent, chunk)
            block = self.allocator.lookup(h, parent, chunk)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def cached_prefix_length(self, prompt_tokens: Sequence[int]) -> int:
        """How many leading tokens of this prompt ``allocate`` would take from the cache
        now (never the last one); changes nothing."""
        if self.radix is not None:
            return self.radix.longest_prefix(list(prompt_tokens)[:-1])
        return len(self.match_prefix(prompt_tokens)[0]) * self.block_size

    def num_blocks_to_allocate(self, prompt_tokens: Sequence[int]) -> int:
        """Free blocks ``allocate`` would consume (cache hits on unreferenced blocks count)."""
        if self.radix is not None:
            return self._radix_route(prompt_tokens)[1]
        hits, _ = self.match_prefix(prompt_tokens)
        fresh = self._blocks_for(len(prompt_tokens)) - len(hits)
        return fresh + sum(1 for b in hits if self.allocator.is_evictable(b))

    def can_allocate(self, prompt_tokens: Sequence[int]) -> bool:
        if self.radix is not None:
            return self._radix_route(prompt_tokens)[0] is not None
        return self.num_blocks_to_allocate(prompt_tokens) <= self.num_free_blocks

    def _radix_route(self, tokens: Sequence[int]) -> tuple[bool | None, int]:
        """Radix: (use the match?, blocks it takes from the free count); (None, blocks
        needed without a match) when neither fits. The match's nodes are locked before
        anything is evicted, so their blocks cannot be reclaimed for the prompt's fresh
        ones; when that leaves too few, the prompt may still fit without its match."""
        tokens = list(tokens)
        total = self._blocks_for(len(tokens))
        m = self.radix.longest_prefix(tokens[:-1])
        free = self.allocator.num_free
        evictable = self.radix.evictable_blocks()
        if m:
            rest = self.radix.evictable_blocks(self.radix.prefix_blocks(tokens[:m]))
            fresh = total - m // self.block_size
            if fresh <= free + rest:
                return True, fresh + evictable - rest
        if total <= free + evictable:
            return False, total
        return None, total

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies ``(src, dst)`` queued by ``allocate`` (radix: a match that ends inside
        a block); the caller copies them before the forward that writes the prompt."""
        out, self._copies = self._copies, []
        return out

    def allocate(self, seq_id: Hashable, prompt_tokens: Sequence[int]) -> int:
        """Reserve slots for a prompt; returns how many leading tokens are already cached.

        The caller computes K/V only for ``prompt_tokens[cached:]`` (at least the last
        token), then calls :meth:`mark_computed` so the new full blocks can serve later
        prompts. Raises NoFreeBlocksError (changing nothing) when the pool is too small.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks; free it first")
        tokens = [int(t) for t in prompt_tokens]
        if not tokens:
            raise ValueError("prompt_tokens is empty; a sequence needs at least one token")
        if self.radix is not None:
            return self._allocate_radix(seq_id, tokens)
        needed = self.num_blocks_to_allocate(tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(needed, self.num_free_blocks, f"allocate {seq_id!r}")
        hits, hashes = self.match_prefix(tokens)
        blocks: list[int] = []
        try:
            for block in hits:                   # claim hits before fresh blocks can evict them
                self.allocator.incref(block)
                blocks.append(block)
            for _ in range(self._blocks_for(len(tokens)) - len(hits)):
                blocks.append(self.allocator.allocate())
        except BaseException:                    # even an interrupt here must not leak blocks
            for block in reversed(blocks):
                self.allocator.decref(block)
            raise
        self._seqs[seq_id] = _SeqState(blocks=blocks, num_tokens=len(tokens), tokens=tokens,
                                       hashes=hashes)
        cached = len(hits) * self.block_size
        self.stats.queries += len(tokens)
        self.stats.hits += cached
        return cached

    def _allocate_radix(self, seq_id: Hashable, tokens: list[int]) -> int:
        use_match, needed = self._radix_route(tokens)
        if use_match is None:
            raise NoFreeBlocksError(needed, self.num_free_blocks, f"allocate {seq_id!r}")
        bs, tree = self.block_size, self.radix
        node, m = tree.match(tokens[:-1]) if use_match else (tree.root, 0)
        tree.lock(node)                      # before eviction: the match stays
        path = tree.block_table(node)
        full = m // bs
        blocks: list[int] = []
        try:
            tree.evict(self._blocks_for(len(tokens)) - full)
            for block in path[:full]:
                self.allocator.incref(block)
                blocks.append(block)
            for _ in range(self._blocks_for(len(tokens)) - full):
                blocks.append(self.allocator.allocate())
        except BaseException:
            for block in reversed(blocks):
                self.allocator.decref(block)
            tree.unlock(node)
            raise
        if m % bs:            # the prompt writes after the match in this block: copy it first
            self._copies.append((path[full], blocks[full]))
        self._seqs[seq_id] = _SeqState(blocks=blocks, num_tokens=len(tokens), tokens=tokens,
                                       node=node, computed=m)
        self.stats.queries += len(tokens)
        self.stats.hits += m
        return m

    def _radix_insert(self, st: _SeqState, upto: int) -> None:
        """Put the sequence's first ``upto`` tokens (as far as they are known) into the tree
        and hold the new path locked instead of the old one."""
        known = st.tokens[:upto]
        if None in known:
            known = known[:known.index(None)]
        if len(known) <= st.node.end:
            return
        node = self.radix.insert(known, st.blocks)
        self.radix.lock(node)
        self.radix.unlock(st.node)
        st.node = node

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """The K/V of the first ``num_tokens`` tokens are written: index their full blocks.

        Call it once the forward pass that wrote them has returned: this is the only
        place where a block enters the prefix cache.
        """
        st = self._state(seq_id)
        if not 0 <= num_tokens <= st.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} for sequence {seq_id!r} of "
                             f"{st.num_tokens} tokens; allowed: 0..{st.num_tokens}")
        st.computed = max(st.computed, num_tokens)
        if self.radix is not None:           # full blocks only: the last one is still written
            self._radix_insert(st, num_tokens // self.block_size * self.block_size)
            return
        self._register_full_blocks(st, num_tokens)

    def _register_full_blocks(self, st: _SeqState, upto: int | None = None) -> None:
        """Index every full block (of the first ``upto`` tokens) not yet hashed."""
        if self.prefix_cache != "hash":
            return
        bs = self.block_size
        upto = st.num_tokens if upto is None else upto
        while len(st.hashes) < upto // bs:
            i = len(st.hashes)
            chunk = st.tokens[i * bs:(i + 1) * bs]
            if any(t is None for t in chunk):
                return                            # unknown tokens: the chain stops here
            parent = st.hashes[-1] if st.hashes else None
            h = hash_block(parent, chunk)
            self.allocator.register(st.blocks[i], h, parent, tuple(chunk))
            st.hashes.append(h)

    # -- decode --------------------------------------------------------------------
    def num_blocks_to_append(self, seq_id: Hashable) -> int:
        """1 if the next ``append_slot`` needs a new block (block boundary or copy-on-write)."""
        st = self._state(seq_id)
        if st.num_tokens % self.block_size == 0:
            return 1
        return 1 if self.allocator.ref_counts[st.blocks[-1]] > 1 else 0

    def can_append(self, seq_id: Hashable) -> bool:
        return self.num_blocks_to_append(seq_id) <= self.num_free_blocks

    def append_slot(self, seq_id: Hashable, token_id: int | None = None
                    ) -> tuple[int, tuple[int, int] | None]:
        """Reserve the slot for the sequence's next token; -> (slot, copy-on-write or None).

        ``token_id`` is the token whose K/V will be written there (needed to hash the
        block for prefix caching once it is full and computed; None keeps it out). When
        the last block is shared with another sequence it is copied first: the return
        value then carries ``(src_block, dst_block)`` and the caller must copy the K/V of
        ``src`` to ``dst`` before writing. Raises NoFreeBlocksError (changing nothing)
        when a block is needed and none is free. The table itself is updated by the
        manager's ``append_slot`` function (:func:`append_to_table` by default).
        """
        st = self._state(seq_id)
        need = self.num_blocks_to_append(seq_id)
        if need > self.num_free_blocks:
            what = "append to" if st.num_tokens % self.block_size == 0 else "copy-on-write for"
            raise NoFreeBlocksError(1, 0, f"{what} {seq_id!r}")
        if self.radix is not None and need:
            self.radix.evict(need)
        slot, cow = self._append(st.blocks, st.num_tokens, self.allocator, self.block_size)
        st.num_tokens += 1
        st.tokens.append(None if token_id is None else int(token_id))
        return slot, cow

    # -- sharing and release -------------------------------------------------------
    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child shares all of the parent's blocks (copy-on-write on the next write)."""
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already exists; fork needs a new id")
        st = self._state(parent)
        for block in st.blocks:
            self.allocator.incref(block)
        if st.node is not None:
            self.radix.lock(st.node)
        self._seqs[child] = _SeqState(blocks=list(st.blocks), num_tokens=st.num_tokens,
                                      tokens=list(st.tokens), hashes=list(st.hashes),
                                      node=st.node, computed=st.computed)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence's references; its full blocks stay cached until evicted.

        Blocks are released last-first, so the tail of a sequence is evicted before its
        (more shareable) head. Radix: every computed token joins the tree first, the
        partly filled last block too (nobody writes it any more).
        """
        st = self._seqs.pop(seq_id, None)
        if st is None:
            raise ValueError(f"unknown sequence {seq_id!r}; known: {list(self._seqs)[:8]}")
        if self.radix is not None:
            self._radix_insert(st, st.computed)
            self.radix.unlock(st.node)
        for block in reversed(st.blocks):
            self.allocator.decref(block)

    # -- checking ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        a = self.allocator
        refs = [0] * self.num_blocks
        locks: dict[int, int] = {}
        for st in self._seqs.values():
            assert len(st.blocks) == self._blocks_for(st.num_tokens), "table length"
            assert len(st.tokens) == st.num_tokens, "token list length"
            assert len(st.hashes) <= st.num_tokens // self.block_size, "a partial block hashed"
            for b in st.blocks:
                refs[b] += 1
            if self.radix is not None:
                path = self.radix.path(st.node)
                assert [t for n in path for t in n.tokens] == st.tokens[:st.node.end], \
                    "a sequence holds a tree path that is not its prefix"
                for n in path:
                    locks[id(n)] = locks.get(id(n), 0) + 1
        if self.radix is not None:
            self.radix.check_invariants(locks)
            refs = [r + t for r, t in zip(refs, self.radix.references())]
            assert refs == list(a.ref_counts), \
                "reference counts differ from table and tree references"
        assert refs == list(a.ref_counts), "reference counts differ from table references"
        used = sum(1 for r in refs if r > 0)
        assert a.num_free == self.num_blocks - used, "free + used blocks != num_blocks"
        if hasattr(a, "check_invariants"):
            a.check_invariants()
