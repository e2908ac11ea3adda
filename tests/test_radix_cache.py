"""The radix prefix cache (llmlab.cache.radix) under the block manager: token-level matches,
partial blocks copied on write, LRU eviction of unlocked leaves, and a random-operation
property test that follows every slot's content (hash and radix)."""
import random

import pytest

from llmlab.cache.block_manager import BlockManager, NoFreeBlocksError
from llmlab.cache.radix import RadixCache, radix_insert, radix_match


def test_a_match_ends_inside_a_block_and_copies_it():
    bm = BlockManager(16, 4, prefix_cache="radix")
    a = list(range(100, 110))
    assert bm.allocate("a", a) == 0
    bm.mark_computed("a", 10)
    bm.free("a")                                   # all 10 tokens join the tree
    assert bm.radix.num_tokens == 10 and bm.num_free_blocks == 16
    # 6 shared tokens: block 0 shared, block 1 (positions 4..7) copied, the rest fresh
    assert bm.allocate("b", a[:6] + [7, 8, 9]) == 6
    table = bm.block_table("b")
    assert table[0] == 0 and table[1] not in (0, 1, 2)
    assert bm.take_copies() == [(1, table[1])] and bm.take_copies() == []
    bm.check_invariants()
    # the whole prompt cached: the last token is still recomputed
    assert bm.allocate("c", a) == 9
    assert bm.cached_prefix_length(a) == 9 and bm.cached_prefix_length([1, 2]) == 0
    bm.check_invariants()


def test_hash_cache_matches_only_full_blocks_where_radix_matches_tokens():
    prompt = list(range(50, 70))
    follow = prompt[:13] + [1, 2, 3]
    got = {}
    for mode in ("hash", "radix"):
        bm = BlockManager(16, 4, prefix_cache=mode)
        bm.allocate("a", prompt)
        bm.mark_computed("a", len(prompt))
        got[mode] = bm.allocate("b", follow)
        bm.check_invariants()
    assert got == {"hash": 12, "radix": 13}


def test_unlocked_leaves_are_evicted_least_recently_used_first():
    bm = BlockManager(6, 4, prefix_cache="radix")
    for sid, first in (("a", 10), ("b", 20)):
        bm.allocate(sid, [first] * 8 + [1])          # 3 blocks each, 8 tokens cached on free
        bm.mark_computed(sid, 9)
    bm.free("a")
    bm.free("b")
    assert bm.allocator.num_free == 0 and bm.num_free_blocks == 6
    assert bm.allocate("c", [10] * 8 + [2]) == 8      # takes a's head; b's tail block goes
    assert bm.cached_prefix_length([20] * 8 + [1]) == 8
    assert bm.allocate("d", [30] * 4 + [3]) == 0      # 2 more: a's tail, then b's last block
    assert bm.cached_prefix_length([20] * 8 + [1]) == 4
    assert bm.cached_prefix_length([10] * 8 + [1]) == 8 and bm.radix.evictions == 3
    bm.check_invariants()
    # a locked path is never evicted: nothing fits now
    assert not bm.can_allocate([40] * 12)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("e", [40] * 12)
    bm.check_invariants()


def test_bad_prefix_cache_is_refused():
    with pytest.raises(ValueError, match="prefix_cache='lru'; allowed"):
        BlockManager(4, 4, prefix_cache="lru")
    with pytest.raises(ValueError, match="contradicts prefix_cache='radix'"):
        BlockManager(4, 4, enable_prefix_caching=False, prefix_cache="radix")
    assert BlockManager(4, 4, enable_prefix_caching=False).prefix_cache is None
    with pytest.raises(ValueError, match="match must be a function"):
        RadixCache(None, 4, match=3)


def _library_tree(allocator, block_size):
    return RadixCache(allocator, block_size, match=radix_match, insert=radix_insert)


class Shadow:
    """What each slot of the pool holds: (position, token) of the K/V written there."""

    def __init__(self, bm):
        self.bm, self.slots = bm, {}

    def copy(self, pairs):
        bs = self.bm.block_size
        for src, dst in pairs:
            for o in range(bs):
                if src * bs + o in self.slots:
                    self.slots[dst * bs + o] = self.slots[src * bs + o]
                else:
                    self.slots.pop(dst * bs + o, None)

    def write(self, sid, start, tokens):
        for pos in range(start, len(tokens)):
            self.slots[self.bm.slot(sid, pos)] = (pos, tokens[pos])

    def check_tree(self):
        tree, bs = self.bm.radix, self.bm.block_size
        for node in tree.nodes():
            table = tree.block_table(node)
            for i, pos in enumerate(range(node.start, node.end)):
                want = (pos, node.tokens[i])
                assert self.slots.get(table[pos // bs] * bs + pos % bs) == want, \
                    f"the tree's K/V at position {pos} is not its token's"


@pytest.mark.parametrize("mode", ["hash", "radix", _library_tree])
def test_random_operations_keep_every_computed_token_intact(mode):
    """3,000 random allocate/append/fork/free operations over prompts that share prefixes of
    any length; after each, every live sequence's computed tokens are in its slots, the
    tree's tokens in the tree's blocks, and the bookkeeping is consistent."""
    rng = random.Random(7)
    bs = 4
    bm = BlockManager(num_blocks=40, block_size=bs, prefix_cache=mode)
    shadow = Shadow(bm)
    stems = [[rng.randrange(30) for _ in range(rng.randrange(3, 15))] for _ in range(5)]
    live, tokens, computed, next_id = [], {}, {}, 0
    partial = hits = cows = refusals = 0

    def check_seqs():
        for sid in live:
            for pos in range(computed[sid]):
                assert shadow.slots.get(bm.slot(sid, pos)) == (pos, tokens[sid][pos]), \
                    f"sequence {sid}'s K/V at position {pos} was overwritten"

    for step in range(3_000):
        op = rng.random()
        if op < 0.3 or not live:
            stem = rng.choice(stems)
            prompt = stem[:rng.randrange(1, len(stem) + 1)] + \
                [rng.randrange(30) for _ in range(rng.randrange(1, 6))]
            if bm.can_allocate(prompt):
                cached = bm.allocate(next_id, prompt)
                assert cached < len(prompt)
                hits += cached > 0
                partial += cached % bs != 0
                shadow.copy(bm.take_copies())
                tokens[next_id], computed[next_id] = list(prompt), cached
                check_seqs_for = [next_id]
                if rng.random() < 0.8:                # else: a forward that never finished
                    shadow.write(next_id, cached, prompt)
                    bm.mark_computed(next_id, len(prompt))
                    computed[next_id] = len(prompt)
                live.append(next_id)
                next_id += 1
            else:
                refusals += 1
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(next_id, prompt)
        elif op < 0.7:
            sid = rng.choice(live)
            before = bm.num_tokens(sid)
            if computed[sid] < before:                 # finish the prompt first
                shadow.write(sid, computed[sid], tokens[sid])
                bm.mark_computed(sid, before)
                computed[sid] = before
            elif bm.can_append(sid):
                tok = rng.randrange(30)
                slot, cow = bm.append_slot(sid, tok)
                if cow is not None:
                    shadow.copy([cow])
                    cows += 1
                tokens[sid].append(tok)
                shadow.write(sid, before, tokens[sid])
                bm.mark_computed(sid, before + 1)
                computed[sid] = before + 1
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.append_slot(sid, 1)
        elif op < 0.8:
            parent = rng.choice(live)
            bm.fork(parent, next_id)
            tokens[next_id], computed[next_id] = list(tokens[parent]), computed[parent]
            live.append(next_id)
            next_id += 1
        else:
            sid = live.pop(rng.randrange(len(live)))
            bm.free(sid)
        check_seqs()
        if step % 25 == 0:
            bm.check_invariants()
            if bm.radix is not None:
                shadow.check_tree()
    for sid in live:
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == 40
    assert hits > 100 and cows > 20 and refusals > 5
    if bm.radix is not None:
        shadow.check_tree()
        assert partial > 50 and bm.radix.evictions > 10


def test_a_conversation_keeps_one_block_per_position():
    """Turn 2 extends turn 1's partly filled last block (copied on write); once turn 2 fills
    it, the tree keeps the copy only: one block per logical block of the conversation."""
    bm = BlockManager(16, 4, prefix_cache="radix")
    turn1 = list(range(10))                       # blocks of 4: the last one holds 2 tokens
    bm.allocate("t1", turn1)
    bm.mark_computed("t1", 10)
    bm.free("t1")
    turn2 = turn1 + [50, 51, 52, 53, 54]
    assert bm.allocate("t2", turn2) == 10 and len(bm.take_copies()) == 1
    bm.mark_computed("t2", 15)                    # blocks 0..2 full: block 2 enters the tree
    bm.free("t2")
    held = {b for n in bm.radix.nodes() for b in n.blocks}
    assert len(held) == 4 == -(-15 // 4)          # not 5: turn 1's tail block went back
    assert bm.allocator.num_free == 16 - 4
    bm.check_invariants()
