"""The block manager: allocation, copy-on-write, prefix caching, and a random-operation
property test of its invariants."""
import random

import pytest

from llmlab.cache.block_manager import BlockManager, NoFreeBlocksError, hash_block


def test_allocate_append_grows_at_block_boundaries():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", [1, 2, 3]) == 0
    assert bm.block_table("a") == [0] and bm.num_free_blocks == 5
    slot, cow = bm.append_slot("a", 4)          # position 3 fills block 0
    assert (slot, cow) == (3, None) and bm.block_table("a") == [0]
    slot, cow = bm.append_slot("a", 5)          # position 4 opens a new block
    assert (slot, cow) == (4, None) and bm.block_table("a") == [0, 1]
    assert bm.slot("a", 4) == 4 and bm.num_tokens("a") == 5
    bm.allocate("b", list(range(9)))            # 3 blocks, not contiguous with "a"'s
    assert bm.block_table("b") == [2, 3, 4]
    assert bm.slot_mapping("b", 7, 9) == [3 * 4 + 3, 4 * 4 + 0]
    bm.free("a")
    assert bm.num_free_blocks == 3
    bm.check_invariants()


def test_fork_and_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.allocate("p", [1, 2, 3, 4, 5, 6])        # blocks [0, 1], block 1 half full
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p") and bm.num_free_blocks == 6
    slot, cow = bm.append_slot("c", 7)          # shared partial block -> copy
    assert cow == (1, 2) and bm.block_table("c") == [0, 2] and slot == 2 * 4 + 2
    slot, cow = bm.append_slot("p", 9)          # now sole owner of block 1: no copy
    assert cow is None and slot == 1 * 4 + 2
    assert bm.allocator.ref_counts[0] == 2 and bm.allocator.ref_counts[1] == 1
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_out_of_blocks_is_a_clear_signal_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    bm.allocate("a", [1] * 8)
    assert not bm.can_allocate([1, 2]) and not bm.can_append("a")
    with pytest.raises(NoFreeBlocksError, match="needs 1 free KV block"):
        bm.allocate("b", [1, 2])
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot("a", 3)
    assert bm.num_tokens("a") == 8 and bm.block_table("a") == [0, 1] and not bm.has_seq("b")
    bm.check_invariants()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        BlockManager(4, 12)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="unknown sequence 'x'"):
        bm.free("x")
    bm.allocate("a", [1])
    with pytest.raises(ValueError, match="already has blocks"):
        bm.allocate("a", [1])
    with pytest.raises(ValueError, match="empty"):
        bm.allocate("b", [])


def test_prefix_cache_hits_full_blocks_and_recomputes_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))               # 3 full blocks
    assert bm.allocate("a", system + [1, 2]) == 0
    bm.mark_computed("a", 14)                    # a's K/V written: its full blocks are cacheable
    a_table = bm.block_table("a")
    # same 12-token prefix: 3 blocks hit and are shared
    assert bm.allocate("b", system + [7, 8, 9]) == 12
    assert bm.block_table("b")[:3] == a_table[:3]
    assert bm.allocator.ref_counts[a_table[0]] == 2
    # a prompt that *is* the cached prefix: the block with the last token is recomputed
    assert bm.allocate("c", system) == 8
    assert bm.block_table("c")[2] != a_table[2]
    # a different first block breaks the chain even if later blocks are equal
    assert bm.allocate("d", [0, 0, 0, 0] + system[4:] + [5]) == 0
    assert bm.stats.hits == 20 and bm.stats.queries == 14 + 15 + 12 + 13
    bm.check_invariants()


def test_only_computed_blocks_enter_the_prefix_cache():
    """Blocks serve as a prefix only once mark_computed says their K/V is written (a
    prompt prefilled in chunks, or a forward that failed before writing anything)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 114))               # 3 full blocks + 2 tokens
    assert bm.allocate("a", prompt) == 0
    assert bm.allocate("b", prompt) == 0         # nothing computed yet
    bm.free("b")                                 # never computed: nothing stays cached
    assert bm.allocator.num_cached == 0
    bm.mark_computed("a", 9)                     # first chunk written: 2 full blocks
    assert bm.allocate("c", prompt) == 8
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]
    bm.mark_computed("a", 14)
    assert bm.allocate("d", prompt) == 12
    with pytest.raises(ValueError, match="num_tokens=15"):
        bm.mark_computed("a", 15)
    # decode slots: a block filled by append_slot is cacheable only once computed
    bm.allocate("e", [1, 2, 3])
    bm.append_slot("e", 4)
    assert bm.allocate("f", [1, 2, 3, 4, 5]) == 0
    bm.mark_computed("e", 4)
    assert bm.allocate("g", [1, 2, 3, 4, 5]) == 4
    bm.check_invariants()


def test_uncomputed_blocks_are_not_cached_after_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.mark_computed("a", 2)                     # only the first block was written
    bm.free("a")
    assert bm.allocator.num_cached == 1 and bm.num_free_blocks == 4
    assert bm.allocate("b", [1, 2, 3, 4, 9]) == 2
    bm.check_invariants()


def test_prefix_cache_survives_free_and_evicts_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5])            # blocks for [1,2] [3,4] [5]
    bm.mark_computed("a", 5)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.allocator.num_cached == 2
    assert bm.allocate("b", [1, 2, 3, 4, 9]) == 4     # found again after free
    bm.free("b")
    bm.allocate("c", [7, 7, 7, 7, 7, 7, 7, 7])     # needs all 4 blocks: evicts both cached
    assert bm.allocator.evictions == 2
    bm.free("c")
    assert bm.allocate("d", [1, 2, 3, 4, 9]) == 0
    bm.check_invariants()


def test_token_comparison_guards_a_hash_collision(monkeypatch):
    import llmlab.cache.block_manager as m

    monkeypatch.setattr(m, "hash_block", lambda parent, tokens: 42)   # everything collides
    bm = m.BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.mark_computed("a", 3)
    assert bm.allocate("b", [5, 6, 7]) == 0       # same hash, other tokens: a miss
    assert bm.allocate("c", [1, 2, 7]) == 2
    bm.check_invariants()


def test_hash_chains_parent():
    assert hash_block(None, [1, 2]) == hash_block(None, (1, 2))
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(None, [3, 4])


def test_random_operations_keep_invariants():
    """10,000 random allocate/append/fork/free operations, with prefix hits."""
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=48, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 9, 13]))] for _ in range(4)]
    live, next_id, hits, cows, refusals = [], 0, 0, 0, 0
    for step in range(10_000):
        op = rng.random()
        if op < 0.3 or not live:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(50) for _ in range(rng.randrange(1, 7))]
            if bm.can_allocate(prompt):
                cached = bm.allocate(next_id, prompt)
                assert cached % 4 == 0 and cached < len(prompt)
                hits += cached > 0
                if rng.random() < 0.8:               # else: a forward that never finished
                    bm.mark_computed(next_id, len(prompt))
                live.append(next_id)
                next_id += 1
            else:
                refusals += 1
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(next_id, prompt)
        elif op < 0.7:
            sid = rng.choice(live)
            before = bm.num_tokens(sid)
            if bm.can_append(sid):
                slot, cow = bm.append_slot(sid, rng.randrange(50))
                assert slot == bm.slot(sid, before)
                bm.mark_computed(sid, before + 1)
                cows += cow is not None
                if cow is not None:
                    assert bm.block_table(sid)[-1] == cow[1]
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.append_slot(sid, 1)
                assert bm.num_tokens(sid) == before
        elif op < 0.82:
            parent = rng.choice(live)
            bm.fork(parent, next_id)
            assert bm.block_table(next_id) == bm.block_table(parent)
            live.append(next_id)
            next_id += 1
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        if step % 50 == 0:
            bm.check_invariants()
    bm.check_invariants()
    for sid in live:
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == 48 and all(r == 0 for r in bm.allocator.ref_counts)
    # the loop must really have exercised every path
    assert hits > 100 and cows > 100 and refusals > 10 and bm.allocator.evictions > 10


def test_an_interrupt_inside_allocate_leaks_no_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", list(range(9)))
    bm.mark_computed("a", 9)
    real, calls = bm.allocator.allocate, []

    def flaky():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real()

    bm.allocator.allocate = flaky
    free = bm.num_free_blocks
    with pytest.raises(KeyboardInterrupt):       # 2 prefix hits, then fresh blocks
        bm.allocate("b", list(range(8)) + [50, 51, 52, 53, 54])
    assert bm.num_free_blocks == free and not bm.has_seq("b")
    bm.check_invariants()


class ListAllocator:
    """A hand-written allocator with the interface BlockManager documents (no prefix cache)."""

    def __init__(self, num_blocks):
        self.free = list(range(num_blocks))[::-1]    # hands out 0, 1, 2, ... from the end
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self):
        return len(self.free)

    def allocate(self):
        if not self.free:
            raise NoFreeBlocksError(1, 0)
        block = self.free.pop()
        self.ref_counts[block] = 1
        return block

    def incref(self, block):
        self.ref_counts[block] += 1

    def decref(self, block):
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)
        return self.ref_counts[block]


def test_a_hand_written_allocator_drops_in():
    ops = [("allocate", "a", [1, 2, 3, 4, 5, 6]), ("fork", "a", "b"), ("append", "b", 7),
           ("append", "a", 8), ("allocate", "c", list(range(9))), ("free", "a", None),
           ("append", "b", 9), ("free", "c", None), ("free", "b", None)]
    runs = {}
    for name, alloc in (("library", None), ("hand-written", ListAllocator(8))):
        bm = BlockManager(8, 4, enable_prefix_caching=False, allocator=alloc)
        seen = []
        for op, sid, arg in ops:
            if op == "allocate":
                bm.allocate(sid, arg)
            elif op == "fork":
                bm.fork(sid, arg)
            elif op == "append":
                seen.append(bm.append_slot(sid, arg))
            else:
                bm.free(sid)
            bm.check_invariants()
            seen.append(bm.num_free_blocks)
        runs[name] = seen
    assert runs["hand-written"] == runs["library"]   # same slots, copies and free counts

    class NoDecref:                                   # forgot decref
        ref_counts, num_free = [0] * 8, 8
        allocate = incref = ListAllocator.allocate

    with pytest.raises(ValueError, match=r"lacks \['decref'\]"):
        BlockManager(8, 4, enable_prefix_caching=False, allocator=NoDecref())
    with pytest.raises(ValueError, match="prefix caching needs"):
        BlockManager(8, 4, allocator=ListAllocator(8))
    with pytest.raises(ValueError, match="allocator has 4 blocks but num_blocks=8"):
        BlockManager(8, 4, enable_prefix_caching=False, allocator=ListAllocator(4))
    leaky = BlockManager(8, 4, enable_prefix_caching=False, allocator=ListAllocator(8))
    leaky.allocate("a", [1, 2])
    leaky.allocator.free.pop()                        # a block vanishes from the pool
    with pytest.raises(AssertionError, match="free \\+ used"):
        leaky.check_invariants()
