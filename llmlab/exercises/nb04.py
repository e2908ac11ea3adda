"""Exercises of notebook 04 (PagedAttention): the slot of a token, a block allocator with
reference counts, copy-on-write, and the paged attention read itself.

The main build is ``nb04.paged_attention``: decode attention that walks a sequence's block
table one block at a time with an online softmax, with the with-KV-cache signature of the
library's paged backends. The checker compares it with llmlab's paged reference on ragged
lengths over shuffled pools, then registers it as an attention backend
(``llmlab.attention.register``, removed again with ``attention.unregister``) and serves
SmolLM2 with it through the engine (``LLM(..., paged_attention=...)``): every decode of
every layer reads the pool through the student's function, and the greedy tokens must equal
those of llmlab's ``paged`` backend (itself tested against HF transformers).

``nb04.append_slot`` is the block-table side: give a sequence's next token its slot, with a
new block at a block boundary and a copy-on-write when the last block is shared. It runs
under llmlab's block manager (``LLM(..., append_slot=...)``), forks and beam search included.
``nb04.block_allocator`` (the free list and reference counts under the tables) is the
warm-up; both builds are judged in stages, cheapest first: direct calls with precise
messages, :func:`random_block_ops` (random allocate / append / fork / free operations against
a model of what every sequence wrote), then the engine on SmolLM2.

Each build's checker calls the student's code inside :func:`~llmlab.exercises.forbid` (and,
for attention, with torch's fused ``scaled_dot_product_attention`` replaced by a raiser), so
a wrapper around llmlab's own implementation fails and is told so.

``nb04.wasted_slots`` (the unfilled tail of the last blocks) and ``nb04.explain_preemptions``
belong to the optional appendix, notebook 04b (``NB_FINE``).
"""
from __future__ import annotations

import contextlib
import functools
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..cache.block_manager import BlockAllocator, BlockManager, NoFreeBlocksError
from . import (choice_verdict, compare_tensors, exercise, first_token_difference, forbid,
               number_verdict, right, wrong)

NB = "04_paged_attention"
NB_FINE = "04b_paging_fine_print"     # the optional appendix: the tail, the cap, preemptions


# ---- 1. the slot of a token (compute) ------------------------------------------------------

SLOT_TABLE, SLOT_POSITION, SLOT_BLOCK_SIZE = [7, 2, 9], 6, 4


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The flat slot of token ``position``: ``table[pos // bs] * bs + pos % bs``."""
    return block_table[position // block_size] * block_size + position % block_size


@exercise("nb04.slot_of", notebook=NB,
          title=f"the flat slot of token {SLOT_POSITION} with block table {SLOT_TABLE} and "
                f"blocks of {SLOT_BLOCK_SIZE}",
          kind="compute", solution=slot_of(SLOT_TABLE, SLOT_POSITION, SLOT_BLOCK_SIZE),
          wrong_variants={
              "ignores the table": (SLOT_POSITION, ("block table",)),
              "block index and offset swapped": (37, ("logical block",)),
              "off by one block": (38, ("logical block",)),
          })
def _check_slot_of(answer):
    t, pos, bs = SLOT_TABLE, SLOT_POSITION, SLOT_BLOCK_SIZE
    want = slot_of(t, pos, bs)
    logical, offset = pos // bs, pos % bs
    hint = ("the logical block is position // block_size, the offset inside it "
            "position % block_size; the table turns the logical block into a physical one.")
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong(f"the answer should be an integer slot, got {answer!r}.", hint)
    if answer == want:
        return right(f"slot {want}: position {pos} is offset {offset} of logical block "
                     f"{logical}, which the table maps to physical block {t[logical]}; "
                     f"{t[logical]} × {bs} + {offset} = {want}.")
    if answer == pos:
        return wrong(f"{answer} is the position itself: it ignores the block table, as if the "
                     "sequence owned the pool from slot 0.", hint)
    return wrong(f"{answer} is not it: check which logical block holds position {pos} and "
                 "which physical block the table gives for it.", hint)


# ---- 2. the unfilled tail of the last blocks (compute) -------------------------------------

WASTE_LENGTHS, WASTE_BLOCK_SIZE = [37, 70, 16, 5], 16


def wasted_slots(lengths: list[int], block_size: int) -> int:
    """Slots that sequences of these lengths hold in their blocks but do not fill."""
    return sum(-(-n // block_size) * block_size - n for n in lengths)


@exercise("nb04.wasted_slots", notebook=NB_FINE,
          title=f"slots held but not filled by sequences of {WASTE_LENGTHS} tokens in blocks "
                f"of {WASTE_BLOCK_SIZE}",
          kind="compute", solution=wasted_slots(WASTE_LENGTHS, WASTE_BLOCK_SIZE),
          wrong_variants={
              "counts a full block as wasted": (48, ("wastes nothing",)),
              "counts the filled part": (16, ("filled",)),
          })
def _check_wasted_slots(answer):
    ls, bs = WASTE_LENGTHS, WASTE_BLOCK_SIZE
    want = wasted_slots(ls, bs)
    per = [-(-n // bs) * bs - n for n in ls]
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong(f"the answer should be an integer number of slots, got {answer!r}.",
                     "a sequence of n tokens holds ceil(n / block_size) blocks.")
    if answer == want:
        return right(f"{want} slots ({' + '.join(map(str, per))}): at most block_size − 1 per "
                     "sequence, in its last block only.")
    if answer == sum(bs - n % bs for n in ls):
        return wrong(f"{answer} counts {bs} unfilled slots for the sequence of {ls[2]} tokens; "
                     "a sequence that exactly fills its blocks wastes nothing.",
                     "the tail of n tokens is ceil(n / bs) · bs − n.")
    if answer == sum(n % bs for n in ls):
        return wrong(f"{answer} counts the filled part of each last block, not the unfilled "
                     "rest.", "the tail of n tokens is ceil(n / bs) · bs − n.")
    return wrong(f"{answer} is not it.", "a sequence of n tokens holds ceil(n / block_size) "
                 "blocks; count the slots of its last block that it does not fill.")


# ---- 3. the block allocator (the warm-up build) -------------------------------------------

class _SolutionBlockAllocator:
    """A pool of ``num_blocks`` KV blocks: a free list and a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_list = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self) -> int:
        if not self.free_list:
            raise NoFreeBlocksError(1, 0)
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; it cannot be shared")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> int:
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} has no reference to drop")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)
        return self.ref_counts[block]


class _NoDecrement(_SolutionBlockAllocator):
    """Wrong: frees the block on its last reference but never lowers the count."""

    def decref(self, block):
        if self.ref_counts[block] == 1:
            self.free_list.append(block)
        return self.ref_counts[block]


class _FreesShared(_SolutionBlockAllocator):
    """Wrong: every decref puts the block back in the free list, shared or not."""

    def decref(self, block):
        self.ref_counts[block] -= 1
        self.free_list.append(block)
        return self.ref_counts[block]


class _NoRaiseWhenEmpty(_SolutionBlockAllocator):
    """Wrong: a plain list popped when empty (IndexError, not NoFreeBlocksError)."""

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_list = list(range(num_blocks - 1, -1, -1))

    def allocate(self):
        block = self.free_list.pop()
        self.ref_counts[block] = 1
        return block


class _OffByOne(_SolutionBlockAllocator):
    """Wrong: block ids counted from 1."""

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.ref_counts = [0] * (num_blocks + 1)
        self.free_list = deque(range(1, num_blocks + 1))


class BlockInvariantError(AssertionError):
    """:func:`random_block_ops` found a broken invariant; the message names the operation."""


@dataclass
class BlockOpsReport:
    """What :func:`random_block_ops` exercised (the counts show every path was taken)."""

    ops: int = 0
    allocations: int = 0
    appends: int = 0
    forks: int = 0
    frees: int = 0
    refusals: int = 0               # allocate / append refused with NoFreeBlocksError
    copies: int = 0                 # copy-on-write copies
    prefix_hits: int = 0            # prompts that found cached blocks
    evictions: int = 0


def random_block_ops(allocator: Callable | None = None, ops: int = 10_000, seed: int = 1234,
                     num_blocks: int = 48, block_size: int = 4,
                     enable_prefix_caching: bool | None = None,
                     append_slot: Callable | None = None) -> BlockOpsReport:
    """Drive a :class:`BlockManager` through ``ops`` random operations and check it.

    ``allocator``: a class (or factory) called as ``allocator(num_blocks, block_size)`` whose
    object replaces the library's :class:`BlockAllocator`; None keeps the library's.
    ``enable_prefix_caching`` defaults to True for the library's allocator and False for a
    replacement (which then needs no prefix-cache methods). ``append_slot``: a function
    that replaces the manager's block-table update (``BlockManager(..., append_slot=...)``).

    The operations are allocate (prompts built from a few shared prefixes), append a slot,
    fork and free, the way a serving engine issues them: the K/V "written" into each slot
    is the token itself, in a model of the pool, copied on copy-on-write. After every
    operation these must hold, or :class:`BlockInvariantError` names the operation and the
    broken invariant:

    * every block id in a block table is in ``0 .. num_blocks - 1``;
    * ``ref_counts[b]`` equals the number of block tables that hold ``b``;
    * ``num_free`` equals ``num_blocks`` minus the blocks some table holds;
    * a slot is written only in a block that no other sequence holds (copy-on-write);
    * reading a sequence's tokens back through its block table gives what it wrote
      (no block was handed out again while still in use);
    * a refused allocate / append raises NoFreeBlocksError and changes nothing.

    Returns a :class:`BlockOpsReport` of what was exercised.
    """
    if not isinstance(ops, int) or ops < 1:
        raise ValueError(f"ops={ops!r} must be a positive int")
    rng = random.Random(seed)
    if enable_prefix_caching is None:
        enable_prefix_caching = allocator is None
    pool_obj = None if allocator is None else allocator(num_blocks, block_size)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                      allocator=pool_obj, append_slot=append_slot)
    a = bm.allocator
    bs = block_size
    report = BlockOpsReport()
    content: dict[int, int] = {}              # slot -> token written there
    expect: dict[int, list[int]] = {}         # live sequence -> its tokens
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 9, 13]))] for _ in range(4)]
    next_id = 0
    op_name = "start"

    def fail(msg: str) -> None:
        raise BlockInvariantError(f"after operation {report.ops} ({op_name}): {msg}")

    def holders(block: int) -> list[int]:
        return [s for s in expect if block in bm.block_table(s)]

    def check_counts() -> None:
        refs = [0] * num_blocks
        for s in expect:
            for b in bm.block_table(s):
                if not 0 <= b < num_blocks:
                    fail(f"sequence {s}'s block table holds block id {b}, outside the pool's "
                         f"ids 0..{num_blocks - 1} (an off-by-one block id?).")
                refs[b] += 1
        counts = list(a.ref_counts)
        if len(counts) != num_blocks:
            fail(f"ref_counts has {len(counts)} entries for a pool of {num_blocks} blocks.")
        for b in range(num_blocks):
            if counts[b] != refs[b]:
                how = ("too high: a reference was not decremented when a sequence let go"
                       if counts[b] > refs[b] else "too low: a share (incref) was not counted")
                fail(f"ref_counts[{b}] is {counts[b]} but {refs[b]} block table(s) hold block "
                     f"{b}: {how}.")
        used = sum(1 for r in refs if r)
        if a.num_free != num_blocks - used:
            fail(f"num_free is {a.num_free} but {num_blocks - used} blocks are held by no "
                 f"sequence ({used} of {num_blocks} in use).")

    def check_tokens(seqs) -> None:
        for s in seqs:
            table = bm.block_table(s)
            for pos, tok in enumerate(expect[s]):
                slot = table[pos // bs] * bs + pos % bs
                if content.get(slot) != tok:
                    b = table[pos // bs]
                    others = [o for o in holders(b) if o != s]
                    who = f"; block {b} is also in sequence {others[0]}'s table" if others else ""
                    fail(f"sequence {s}'s token {pos} (slot {slot}, block {b}) was overwritten"
                         f"{who}: a block still in use was handed out again.")

    def write(sid: int, pos: int, tok: int) -> None:
        b = bm.block_table(sid)[pos // bs]
        others = [o for o in holders(b) if o != sid]
        if others:
            fail(f"sequence {sid} writes its token {pos} into block {b}, which sequence "
                 f"{others[0]} also holds: without a copy-on-write this corrupts sequence "
                 f"{others[0]} (ref_counts[{b}] = {a.ref_counts[b]}; a shared block must count "
                 "more than 1).")
        content[b * bs + pos % bs] = tok

    for step in range(ops):
        report.ops = step + 1
        live = list(expect)
        touched: list[int] = []         # sequences this operation wrote or created
        r = rng.random()
        if r < 0.3 or not live:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(50)
                                                   for _ in range(rng.randrange(1, 7))]
            op_name = f"allocate sequence {next_id}, {len(prompt)} tokens"
            if bm.can_allocate(prompt):
                cached = bm.allocate(next_id, prompt)
                report.allocations += 1
                report.prefix_hits += cached > 0
                expect[next_id] = list(prompt)
                touched.append(next_id)
                check_counts()
                for pos in range(cached):                       # a prefix hit: already there
                    slot = bm.slot(next_id, pos)
                    if content.get(slot) != prompt[pos]:
                        fail(f"prefix hit: slot {slot} holds {content.get(slot)}, "
                             f"the prompt's token {pos} is {prompt[pos]}.")
                for pos in range(cached, len(prompt)):
                    write(next_id, pos, prompt[pos])
                if enable_prefix_caching:
                    bm.mark_computed(next_id, len(prompt))
                next_id += 1
            else:
                report.refusals += 1
                try:
                    bm.allocate(next_id, prompt)
                except NoFreeBlocksError:
                    pass
                else:
                    fail("can_allocate said no, yet allocate succeeded.")
                if bm.has_seq(next_id):
                    fail("a refused allocate left a block table behind.")
        elif r < 0.7:
            sid = rng.choice(live)
            tok = rng.randrange(50)
            op_name = f"append a token to sequence {sid}"
            before = bm.num_tokens(sid)
            if bm.can_append(sid):
                last = bm.block_table(sid)[-1] if before % bs else None
                slot, cow = bm.append_slot(sid, tok)
                report.appends += 1
                if cow is not None:
                    report.copies += 1
                    src, dst = cow
                    if src != last or bm.block_table(sid)[-1] != dst:
                        fail(f"copy-on-write returned {cow}, but the shared block was {last} "
                             f"and the table now ends in {bm.block_table(sid)[-1]}.")
                    for off in range(bs):
                        if src * bs + off in content:
                            content[dst * bs + off] = content[src * bs + off]
                expect[sid].append(tok)
                touched.append(sid)
                held = len(bm.block_table(sid))
                if held != -(-(before + 1) // bs):
                    fail(f"after the append sequence {sid} holds {held} blocks for {before + 1} "
                         f"tokens; blocks of {bs} need {-(-(before + 1) // bs)}: a new block is "
                         "taken only when the last one is full.")
                check_counts()
                if slot != bm.slot(sid, before):
                    fail(f"append_slot returned slot {slot}, the table maps position {before} "
                         f"to {bm.slot(sid, before)}.")
                write(sid, before, tok)
                if enable_prefix_caching:
                    bm.mark_computed(sid, before + 1)
            else:
                report.refusals += 1
                try:
                    bm.append_slot(sid, tok)
                except NoFreeBlocksError:
                    pass
                else:
                    fail("can_append said no, yet append_slot succeeded.")
                if bm.num_tokens(sid) != before:
                    fail("a refused append changed the sequence.")
        elif r < 0.82:
            parent = rng.choice(live)
            op_name = f"fork sequence {parent} into {next_id}"
            bm.fork(parent, next_id)
            report.forks += 1
            expect[next_id] = list(expect[parent])
            touched += [parent, next_id]
            if bm.block_table(next_id) != bm.block_table(parent):
                fail("the child's block table differs from its parent's.")
            next_id += 1
        else:
            sid = live[rng.randrange(len(live))]
            op_name = f"free sequence {sid}"
            bm.free(sid)
            report.frees += 1
            del expect[sid]
        check_counts()
        check_tokens(expect if step % 25 == 0 else [s for s in touched if s in expect])
        if allocator is None and append_slot is None and step % 50 == 0:
            bm.check_invariants()
    check_tokens(expect)
    op_name = "free every sequence"
    for sid in list(expect):
        bm.free(sid)
        del expect[sid]
    check_counts()
    if a.num_free != num_blocks or any(a.ref_counts):
        fail(f"with every sequence freed, num_free is {a.num_free} (expected {num_blocks}) "
             f"and {sum(1 for c in a.ref_counts if c)} blocks still count references.")
    report.evictions = getattr(a, "evictions", 0)
    return report


def _unit_checks(cls):
    """Direct calls on a small pool; None when they pass, else a Verdict."""
    hint_ids = "block ids are 0 .. num_blocks - 1, the rows of the KV pool."
    pool = cls(8, 4)
    counts = list(pool.ref_counts)
    if pool.num_free != 8:
        return wrong(f"a new pool of 8 blocks has num_free = {pool.num_free}, expected 8.",
                     "every block starts free.")
    got = []
    for i in range(8):
        try:
            got.append(pool.allocate())
        except IndexError as exc:
            return wrong(f"allocate() call {i + 1} of 8 raised IndexError ({exc}) although "
                         f"{8 - i} blocks were free: an off-by-one block id?", hint_ids)
        except NoFreeBlocksError:
            return wrong(f"allocate() call {i + 1} raised NoFreeBlocksError with {8 - i} of 8 "
                         "blocks still free.", "num_free and the free list must agree.")
    bad = [b for b in got if not isinstance(b, int) or not 0 <= b < 8]
    if bad:
        return wrong(f"allocate() handed out block id {bad[0]!r}, outside the pool's ids 0..7 "
                     f"(all ids: {got}): an off-by-one block id?", hint_ids)
    if len(counts) != 8:
        return wrong(f"ref_counts has {len(counts)} entries for a pool of 8 blocks.", hint_ids)
    if sorted(got) != list(range(8)):
        return wrong(f"8 allocations returned {got}: a block was handed out twice.",
                     "take each block off the free list when you hand it out.")
    if list(pool.ref_counts) != [1] * 8 or pool.num_free != 0:
        return wrong(f"after allocating all 8 blocks ref_counts = {list(pool.ref_counts)} and "
                     f"num_free = {pool.num_free}; expected all 1 and 0.",
                     "allocate sets the new block's count to 1.")
    try:
        extra = pool.allocate()
    except NoFreeBlocksError:
        pass
    except Exception as exc:
        return wrong(f"allocate() on an empty pool raised {type(exc).__name__} ({exc}) instead "
                     "of NoFreeBlocksError: the scheduler catches NoFreeBlocksError to preempt a "
                     "sequence; any other error crashes the server.",
                     "check for an empty free list first and raise NoFreeBlocksError(1, 0).")
    else:
        return wrong(f"allocate() on an empty pool returned {extra!r} instead of raising "
                     "NoFreeBlocksError: that block already belongs to a sequence.",
                     "check for an empty free list first and raise NoFreeBlocksError(1, 0).")
    b = got[0]
    pool.incref(b)                               # a fork: two sequences share b
    if pool.ref_counts[b] != 2:
        return wrong(f"incref({b}) left ref_counts[{b}] = {pool.ref_counts[b]}, expected 2.",
                     "a fork adds one reference to each shared block.")
    left = pool.decref(b)                        # one of them finishes
    if pool.ref_counts[b] != 1:
        return wrong(f"after incref({b}) and decref({b}) ref_counts[{b}] is "
                     f"{pool.ref_counts[b]}, expected 1: the count was not decremented.",
                     "decref lowers the count by one.")
    if left != 1:
        return wrong(f"decref({b}) returned {left!r}; it should return the references left (1).",
                     "return the new count.")
    if pool.num_free != 0:
        return wrong(f"block {b} still has 1 reference, yet num_free went from 0 to "
                     f"{pool.num_free}: it is back in the free list while a sequence still "
                     "uses it, and its K/V would be overwritten by the next allocate.",
                     "put a block back in the free list only when its count reaches 0.")
    if pool.decref(b) != 0 or pool.num_free != 1:
        return wrong(f"the last decref({b}) should return 0 and make num_free 1; num_free is "
                     f"{pool.num_free}.", "at 0 references the block is free again.")
    again = pool.allocate()
    if again != b:
        return wrong(f"block {b} was the only free block, but allocate() returned {again}.",
                     "a freed block goes back to the free list.")
    return None




_PROMPTS = ["The capital of France is", "Name three colours of the rainbow:",
            "One, two, three, four,"]


def _engine_allocator_run(allocator_cls, model=None, tokenizer=None):
    """Serve three prompts (one with n=2 sampled completions: a fork and copy-on-write) on a
    pool small enough to preempt, with ``allocator_cls`` under the block tables (None:
    llmlab's); -> (token lists per completion, preemptions)."""
    from ..engine import LLM, SamplingParams

    model, tokenizer = _smollm2(model, tokenizer)
    llm = LLM(model, tokenizer, block_size=4, num_blocks=12, max_num_seqs=4,
              enable_prefix_caching=False, allocator=allocator_cls)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate(_PROMPTS, params, use_tqdm=False)
    tokens = [c.token_ids for o in outs for c in o.outputs]
    manager = llm.engine.cache.manager
    if manager.num_used_blocks:
        raise AssertionError(f"{manager.num_used_blocks} blocks are still in use after every "
                             "request finished")
    return tokens, llm.stats.num_preemptions


def _smollm2(model=None, tokenizer=None):
    if model is not None and tokenizer is not None:
        return model, tokenizer
    return _load_smollm2()


@functools.lru_cache(maxsize=1)
def _load_smollm2():
    import llmlab

    return llmlab.load_model("smollm2-135m"), llmlab.load_tokenizer("smollm2-135m")


_REFERENCE_RUNS: dict[tuple, tuple] = {}


def _reference(kind: str, model, tokenizer, run: Callable):
    """``run(model, tokenizer)`` with llmlab's own piece, once per model and kind."""
    key = (kind, id(model))
    if key not in _REFERENCE_RUNS:          # the model is kept in the value: its id stays unique
        _REFERENCE_RUNS[key] = (model, run(model, tokenizer))
    return _REFERENCE_RUNS[key][1]


def _reference_tokens(model, tokenizer):
    """The engine run with llmlab's own allocator, once per model."""
    return _reference("allocator", model, tokenizer,
                      lambda m, t: _engine_allocator_run(None, m, t))


class _WrapsLibrary(BlockAllocator):
    """Wrong: llmlab's own allocator under another name."""


@exercise("nb04.block_allocator", notebook=NB,
          title="a block allocator with reference counts (runs under the engine's block tables)",
          kind="build", solution=_SolutionBlockAllocator,
          wrong_variants={
              "refcount not decremented on free": (_NoDecrement, ("not decremented",)),
              "free list reuses a block still referenced": (_FreesShared,
                                                            ("still", "free list")),
              "allocate does not raise when empty": (_NoRaiseWhenEmpty, ("NoFreeBlocksError",)),
              "off-by-one block id": (_OffByOne, ("off-by-one",)),
              "llmlab's own allocator": (_WrapsLibrary, ("llmlab's own",)),
          })
def _check_block_allocator(cls, model=None, tokenizer=None):
    """``cls(num_blocks, block_size)``: allocate / incref / decref / num_free / ref_counts.

    Pass ``model=`` and ``tokenizer=`` (SmolLM2) to reuse the notebook's loaded model.
    """
    if not callable(cls):
        return wrong(f"pass your allocator class itself, got {type(cls).__name__}.",
                     "exercises.check(\"nb04.block_allocator\", MyBlockAllocator)")
    library = (BlockAllocator.allocate, BlockAllocator.incref, BlockAllocator.decref,
               BlockAllocator.num_free.fget)
    with forbid(*library):
        verdict = _unit_checks(cls)
        if verdict is not None:
            return verdict
        try:
            report = random_block_ops(cls, ops=10_000)
        except BlockInvariantError as exc:
            return wrong(f"the random-operation test broke an invariant {exc}",
                         "the block tables are the library's; the counts and the free list "
                         "are yours. Replay the operation on a small pool by hand.")
    model, tokenizer = _smollm2(model, tokenizer)
    want, _ = _reference_tokens(model, tokenizer)      # llmlab's allocator, outside the guard
    with forbid(*library):
        got, pre = _engine_allocator_run(cls, model, tokenizer)
    for i, (g, w) in enumerate(zip(got, want)):
        diff = first_token_difference(g, w)
        if diff:
            return wrong(f"the engine with your allocator generates different tokens in "
                         f"completion {i}: {diff}", "some sequence read K/V that another one "
                         "overwrote; check when a block may return to the free list.")
    return right(f"{report.ops:,} random operations kept every invariant ({report.allocations:,} "
                 f"allocations, {report.forks:,} forks, {report.copies:,} copy-on-write copies, "
                 f"{report.refusals:,} refusals), and SmolLM2 served 4 completions with "
                 f"LLM(allocator=your class) ({pre} preemption{'s' if pre != 1 else ''}, "
                 "one fork): the same tokens as with llmlab's.")


# ---- 4. copy-on-write, by hand -------------------------------------------------------------

def cow_scenario(block_size: int = 4, prompt_len: int = 10, children: int = 2) -> int:
    """Blocks in use after: allocate a prompt, fork it ``children`` times, then every
    sequence (parent first) appends one token."""
    bm = BlockManager(64, block_size, enable_prefix_caching=False)
    bm.allocate("parent", list(range(prompt_len)))
    names = ["parent"] + [f"child{i}" for i in range(children)]
    for n in names[1:]:
        bm.fork("parent", n)
    for n in names:
        bm.append_slot(n, 0)
    return bm.num_used_blocks


@exercise("nb04.cow_blocks", notebook=NB, title="blocks in use after a fork and three writes",
          kind="compute", solution=5,
          wrong_variants={"every sequence copies": (6, ("last",)),
                          "nothing shared": (9, ("shared",))})
def _check_cow_blocks(answer):
    want = cow_scenario(4, 10, 2)
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong(f"the answer should be an integer number of blocks, got {answer!r}.",
                     "count the physical blocks.")
    if answer == want:
        return right(f"{want} blocks: the 2 full prompt blocks stay shared; the partly filled "
                     "last block is copied once per writer except the last one to write.")
    if answer == want + 1:
        return wrong(f"{answer} counts a copy for every writer; the last writer is the block's "
                     "only owner by then and writes in place.", "follow the reference count of "
                     "block 2 as each sequence writes.")
    return wrong(f"got {answer}, expected a smaller number: full blocks stay shared by all three "
                 "sequences; only a write into a shared, partly filled block copies it.",
                 "count the prompt's blocks first (10 tokens in blocks of 4), then the copies.")




# ---- 5. append a slot, with copy-on-write (build) -------------------------------------------

def _solution_append_slot(block_table, num_tokens, allocator, block_size):
    """Reserve the slot of token ``num_tokens`` (the next one); -> (slot, cow or None).

    block_table: the sequence's physical blocks, updated in place; allocator: the pool
    (allocate, incref, decref, ref_counts, num_free).
    """
    position = num_tokens
    offset = position % block_size
    cow = None
    if offset == 0:                                   # the last block is full (or none yet)
        if allocator.num_free < 1:
            raise NoFreeBlocksError(1, 0, "append")
        block_table.append(allocator.allocate())
    else:
        last = block_table[-1]
        if allocator.ref_counts[last] > 1:            # shared with another table: copy first
            if allocator.num_free < 1:
                raise NoFreeBlocksError(1, 0, "copy-on-write")
            new = allocator.allocate()
            allocator.decref(last)                    # one table fewer points at the old block
            block_table[-1] = new
            cow = (last, new)
    block = block_table[position // block_size]
    return block * block_size + offset, cow


def _append_no_cow(block_table, num_tokens, allocator, block_size):
    """Wrong: writes into the last block whether or not another table shares it."""
    if num_tokens % block_size == 0:
        block_table.append(allocator.allocate())
    return block_table[num_tokens // block_size] * block_size + num_tokens % block_size, None


def _append_copies_always(block_table, num_tokens, allocator, block_size):
    """Wrong: copies a partly filled last block even when this table is its only owner."""
    cow = None
    if num_tokens % block_size == 0:
        block_table.append(allocator.allocate())
    else:
        last = block_table[-1]
        new = allocator.allocate()
        allocator.decref(last)
        block_table[-1] = new
        cow = (last, new)
    return block_table[num_tokens // block_size] * block_size + num_tokens % block_size, cow


def _append_decref_first(block_table, num_tokens, allocator, block_size):
    """Wrong: lets go of the shared block before it knows a new one is available."""
    cow = None
    if num_tokens % block_size == 0:
        block_table.append(allocator.allocate())
    else:
        last = block_table[-1]
        if allocator.ref_counts[last] > 1:
            allocator.decref(last)
            new = allocator.allocate()
            block_table[-1] = new
            cow = (last, new)
    return block_table[num_tokens // block_size] * block_size + num_tokens % block_size, cow


def _append_slot_before_copy(block_table, num_tokens, allocator, block_size):
    """Wrong: computes the slot from the table as it was before the copy."""
    slot = None
    if num_tokens % block_size:
        slot = block_table[-1] * block_size + num_tokens % block_size
    got, cow = _solution_append_slot(block_table, num_tokens, allocator, block_size)
    return (got if slot is None else slot), cow


def _append_wraps_library(block_table, num_tokens, allocator, block_size):
    """Wrong: llmlab's own table update."""
    from ..cache.block_manager import append_to_table

    return append_to_table(block_table, num_tokens, allocator, block_size)


def _append_unit_checks(fn) -> "Verdict | None":
    """Direct calls on a small library pool; None when they pass, else a Verdict."""
    bs = 4
    hint_cow = ("a partly filled last block whose ref_count is above 1 is shared: take a new "
                "block, drop one reference to the old one, put the new one in the table and "
                "return (old, new) so the caller copies the K/V already there.")

    def fresh(n_blocks=8):
        pool = BlockAllocator(n_blocks, bs)
        return pool, [pool.allocate(), pool.allocate()]      # a sequence of 2 blocks

    def call(table, n, pool):
        got = fn(table, n, pool, bs)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise _Bad(wrong(f"your function returned {got!r}; it should return a pair "
                             "(slot, cow), cow being None or (src_block, dst_block).",
                             "return slot, cow"))
        return got

    try:
        # 1. room left in an unshared last block: write in place, nothing allocated
        pool, table = fresh()
        free = pool.num_free
        slot, cow = call(table, 6, pool)
        if cow is not None or table != [0, 1] or pool.num_free != free:
            return wrong(f"a sequence of 6 tokens in blocks [0, 1] appends token 6; block 1 "
                         f"has room and no other table shares it (ref_count 1), yet you "
                         f"returned cow={cow}, the table became {table} and {free - pool.num_free}"
                         " block(s) were taken: copy only a shared block.",
                         "copy-on-write happens only when ref_counts[last] > 1.")
        if slot != 1 * bs + 2:
            return wrong(f"token 6 of table [0, 1] with blocks of {bs}: you returned slot "
                         f"{slot}, expected {1 * bs + 2}.", "block_table[6 // 4] * 4 + 6 % 4")
        # 2. a full last block: a new block, the token at its first slot
        pool, table = fresh()
        slot, cow = call(table, 8, pool)
        if len(table) != 3 or cow is not None:
            return wrong(f"a sequence of 8 tokens fills blocks [0, 1]; appending token 8 "
                         f"should add one block and copy nothing, but the table is {table} "
                         f"and cow={cow}.", "at position % block_size == 0 take a new block.")
        if slot != table[2] * bs:
            return wrong(f"token 8 goes to the first slot of the new block {table[2]} "
                         f"(slot {table[2] * bs}); you returned {slot}.",
                         "block_table[8 // 4] * 4 + 0")
        # 3. a shared, partly filled last block: copy-on-write
        pool, table = fresh()
        pool.incref(0), pool.incref(1)                        # a fork shares both blocks
        other = list(table)
        slot, cow = call(table, 6, pool)
        if cow is None or table[1] == 1:
            return wrong(f"blocks [0, 1] are shared with a forked sibling (ref_counts 2) and "
                         f"block 1 is partly filled; appending token 6 wrote into it in place "
                         f"(table {table}, cow={cow}): the sibling would read this sequence's "
                         "token. Without a copy-on-write the two sequences corrupt each other.",
                         hint_cow)
        if cow != (1, table[1]) or table[0] != 0:
            return wrong(f"after the copy the table is {table} and cow={cow}; expected the "
                         f"table [0, new] and cow=(1, new): block 0 is full and stays shared.",
                         hint_cow)
        if pool.ref_counts[1] != 1 or pool.ref_counts[table[1]] != 1 or pool.ref_counts[0] != 2:
            return wrong(f"after the copy ref_counts of blocks 0, 1 and the copy "
                         f"{table[1]} are {pool.ref_counts[0]}, {pool.ref_counts[1]}, "
                         f"{pool.ref_counts[table[1]]}; expected 2, 1, 1: the old block "
                         "keeps only the sibling's reference.", hint_cow)
        if slot != table[1] * bs + 2:
            return wrong(f"token 6 must go to the copy, slot {table[1] * bs + 2}; you returned "
                         f"slot {slot}, in the shared block {slot // bs}: compute the slot from "
                         "the table after the copy.", hint_cow)
        if other != [0, 1]:
            return wrong("the sibling's table changed.", "update only block_table.")
        # 4. no free block: refuse, changing nothing
        for n, shared, what in ((8, False, "a new block"), (6, True, "a copy")):
            pool = BlockAllocator(2, bs)
            table = [pool.allocate(), pool.allocate()]
            if shared:
                pool.incref(1)
            counts = list(pool.ref_counts)
            try:
                call(table, n, pool)
            except NoFreeBlocksError:
                pass
            else:
                return wrong(f"with no free block, appending token {n} needs {what} but your "
                             "function did not raise NoFreeBlocksError.",
                             "check allocator.num_free before changing anything.")
            if table != [0, 1] or list(pool.ref_counts) != counts:
                return wrong(f"with no free block, appending token {n} ({what}) raised, but "
                             f"first changed the state: table {table}, ref_counts "
                             f"{list(pool.ref_counts)} (were [0, 1] and {counts}). A refused "
                             "append must change nothing: the scheduler preempts another "
                             "sequence and retries this one.",
                             "allocate the new block before you let go of the old one.")
    except _Bad as bad:
        return bad.verdict
    return None


class _Bad(Exception):
    def __init__(self, verdict):
        super().__init__(verdict.message)
        self.verdict = verdict


def _engine_append_run(append_fn, model=None, tokenizer=None):
    """Parallel sampling (n=2: a fork) and beam search (width 3: forks every step) on
    SmolLM2 with ``append_fn`` as the block manager's table update (None: llmlab's);
    -> (token lists, copy-on-write copies made)."""
    from ..engine import LLM, SamplingParams

    model, tokenizer = _smollm2(model, tokenizer)
    copies = [0]

    def counted(table, n, pool, bs):
        slot, cow = (append_fn or _library_append())(table, n, pool, bs)
        copies[0] += cow is not None
        return slot, cow

    llm = LLM(model, tokenizer, block_size=4, num_blocks=40, max_num_seqs=4,
              enable_prefix_caching=False, append_slot=counted)
    outs = llm.generate(_PROMPTS[:2], [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6,
                                                      ignore_eos=True),
                                       SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True)], use_tqdm=False)
    tokens = [c.token_ids for o in outs for c in o.outputs]
    beams = llm.beam_search([_PROMPTS[2]], 3, 5, ignore_eos=True)
    tokens += [list(s.token_ids) for b in beams for s in b.sequences]
    if llm.engine.cache.manager.num_used_blocks:
        raise AssertionError(f"{llm.engine.cache.manager.num_used_blocks} blocks are still in "
                             "use after every request finished")
    return tokens, copies[0]


def _library_append():
    from ..cache.block_manager import append_to_table

    return append_to_table


@exercise("nb04.append_slot", notebook=NB,
          title="the slot of a sequence's next token, with copy-on-write",
          kind="build", solution=_solution_append_slot,
          wrong_variants={
              "no copy-on-write": (_append_no_cow, ("copy-on-write",)),
              "copies an unshared block": (_append_copies_always, ("only a shared block",)),
              "lets go of the old block first": (_append_decref_first, ("change nothing",)),
              "slot from the table before the copy": (_append_slot_before_copy,
                                                      ("after the copy",)),
              "llmlab's own": (_append_wraps_library, ("llmlab's own",)),
          })
def _check_append_slot(fn, model=None, tokenizer=None):
    """``fn(block_table, num_tokens, allocator, block_size) -> (slot, cow)``.

    Pass ``model=`` and ``tokenizer=`` (SmolLM2) to reuse the notebook's loaded model.
    """
    from ..cache import block_manager as bm_module

    if not callable(fn):
        return wrong(f"pass your function itself, got {type(fn).__name__}.",
                     "exercises.check(\"nb04.append_slot\", append_slot)")
    library = (bm_module.append_to_table, BlockManager.append_slot)

    def guarded(table, n, pool, bs):
        with forbid(*library):
            return fn(table, n, pool, bs)

    verdict = _append_unit_checks(guarded)
    if verdict is not None:
        return verdict
    try:
        report = random_block_ops(ops=4_000, append_slot=guarded)
    except BlockInvariantError as exc:
        return wrong(f"the random-operation test broke an invariant {exc}",
                     "the allocator and the block manager are llmlab's; the table update is "
                     "yours. Replay the operation on a small pool by hand.")
    model, tokenizer = _smollm2(model, tokenizer)
    want, want_copies = _reference("append", model, tokenizer,
                                   lambda m, t: _engine_append_run(None, m, t))
    got, copies = _engine_append_run(guarded, model, tokenizer)
    for i, (g, w) in enumerate(zip(got, want)):
        diff = first_token_difference(g, w)
        if diff:
            return wrong(f"the engine with your append_slot generates different tokens in "
                         f"{'beam' if i >= 3 else 'completion'} {i if i < 3 else i - 3}: {diff}",
                         "a sequence read K/V that a sibling wrote into a shared block.")
    return right(f"{report.ops:,} random operations ({report.appends:,} appends, "
                 f"{report.copies:,} copy-on-write copies, {report.forks:,} forks, "
                 f"{report.refusals:,} refusals) kept every invariant, and SmolLM2 ran parallel "
                 f"sampling (n=2) and a width-3 beam search with LLM(append_slot=your function): "
                 f"{copies} copy-on-write copies (llmlab's: {want_copies}), the same tokens.")


# ---- 6. the paged attention read (the main build) ------------------------------------------

def _solution_paged_attention(q, k_cache, v_cache, cache_seqlens, block_table, *,
                              softmax_scale=None, causal=True):
    """Decode attention read through the block table, one block at a time (online softmax).

    q [batch, 1, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads,
    head_dim]; cache_seqlens [batch]; block_table [batch, max_blocks] -> [batch, 1, heads,
    head_dim].
    """
    import torch

    batch, _, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads                         # query heads per KV head
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(batch, heads, d, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qb = q[b, 0].float().view(kv_heads, group, d) * scale
        m = torch.full((kv_heads, group), float("-inf"), device=q.device)   # running max
        l = torch.zeros(kv_heads, group, device=q.device)                   # running sum
        acc = torch.zeros(kv_heads, group, d, device=q.device)              # running Σ p·v
        for i in range(-(-n // block_size)):
            block = int(block_table[b, i])
            filled = min(block_size, n - i * block_size)   # the last block may be partial
            k = k_cache[block, :filled].float().transpose(0, 1)     # [kv_heads, filled, d]
            v = v_cache[block, :filled].float().transpose(0, 1)
            s = qb @ k.transpose(1, 2)                               # [kv_heads, group, filled]
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)              # rescales what was summed before
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v
            m = m_new
        if n:
            out[b] = (acc / l[..., None]).reshape(heads, d)
    return out[:, None].to(q.dtype)


def _paged_variant(q, k_cache, v_cache, cache_seqlens, block_table, *, rescale=True,
                   whole_last=False, logical=False, heads_interleaved=False):
    """The solution with one realistic mistake switched on (the wrong variants)."""
    import torch

    batch, _, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(batch, heads, d)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qh = q[b, 0].float()
        qb = (qh.view(group, kv_heads, d).transpose(0, 1) if heads_interleaved
              else qh.view(kv_heads, group, d)) / math.sqrt(d)
        m = torch.full((kv_heads, group), float("-inf"))
        l = torch.zeros(kv_heads, group)
        acc = torch.zeros(kv_heads, group, d)
        for i in range(-(-n // bs)):
            block = i if logical else int(block_table[b, i])
            filled = bs if whole_last else min(bs, n - i * bs)
            k = k_cache[block, :filled].float().transpose(0, 1)
            v = v_cache[block, :filled].float().transpose(0, 1)
            s = qb @ k.transpose(1, 2)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v
            m = m_new
        o = acc / l[..., None]
        out[b] = (o.transpose(0, 1) if heads_interleaved else o).reshape(heads, d)
    return out[:, None].to(q.dtype)


def _paged_no_rescale(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    return _paged_variant(q, k_cache, v_cache, cache_seqlens, block_table, rescale=False)


def _paged_whole_last_block(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    return _paged_variant(q, k_cache, v_cache, cache_seqlens, block_table, whole_last=True)


def _paged_logical_blocks(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    return _paged_variant(q, k_cache, v_cache, cache_seqlens, block_table, logical=True)


def _paged_heads_interleaved(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    return _paged_variant(q, k_cache, v_cache, cache_seqlens, block_table,
                          heads_interleaved=True)


def _paged_wraps_library(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    from ..attention.paged import paged_attention_sdpa

    return paged_attention_sdpa(q, k_cache, v_cache, cache_seqlens, block_table)


def _paged_wraps_fused(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    """Wrong: copies every block of each sequence out, then torch's fused attention."""
    import torch
    import torch.nn.functional as F

    out = []
    kv_heads = k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        blocks = block_table[b, :-(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)          # [kv, n, d]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
        qb = q[b, 0].view(kv_heads, -1, q.shape[-1])
        out.append(F.scaled_dot_product_attention(qb, k, v).reshape(1, -1, q.shape[-1]))
    return torch.stack(out)


class _FusedAnswer(Exception):
    """Raised when the student's attention calls torch's fused attention."""


@contextlib.contextmanager
def _no_fused_attention():
    """Inside the block, torch.nn.functional.scaled_dot_product_attention raises."""
    import torch.nn.functional as F

    saved = F.scaled_dot_product_attention

    def raiser(*args, **kwargs):
        raise _FusedAnswer("torch.nn.functional.scaled_dot_product_attention")

    F.scaled_dot_product_attention = raiser
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved


def _library_attention() -> tuple:
    """llmlab's own attention functions a paged-attention answer may not call."""
    import sys

    from ..attention import flash, paged, reference

    fns = [paged.paged_attention_reference, paged.paged_attention_sdpa,
           paged.paged_attention_triton, paged.paged_attention_blocks, paged.gather_kv,
           reference.naive_attention,
           reference.sdpa_attention, flash.flash_attention, flash.flash_attention_varlen,
           flash.online_softmax_update]
    kernel = sys.modules.get("llmlab.kernels.paged_attn")    # only if already imported
    if kernel is not None:
        fns.append(kernel.paged_attention)
    return tuple(fns)


def _guard(fn) -> Callable:
    """``fn`` called with llmlab's attention and torch's fused attention made to raise."""
    library = _library_attention()

    def guarded(*args, **kwargs):
        with forbid(*library), _no_fused_attention():
            return fn(*args, **kwargs)

    return guarded


def _attention_case(block_size, lens, *, seed, shuffle=True, heads=9, kv_heads=3, d=16):
    """(q, k_cache, v_cache, cache_seqlens, block_table) for decode: ragged ``lens`` over a
    pool of ``block_size`` blocks (shuffled or in order), rows padded with -1 past their
    blocks, large scores (the running max moves) and loud garbage past each length."""
    import torch

    g = torch.Generator().manual_seed(seed)
    per = [-(-n // block_size) for n in lens]
    num_blocks = sum(per) + 2
    k = torch.randn(num_blocks, block_size, kv_heads, d, generator=g) * 3
    v = torch.randn(num_blocks, block_size, kv_heads, d, generator=g)
    ids = (torch.randperm(num_blocks, generator=g) if shuffle
           else torch.arange(num_blocks)).tolist()
    table = torch.full((len(lens), max(per)), -1, dtype=torch.int32)
    start = 0
    for row, (n, p) in enumerate(zip(lens, per)):
        blocks = ids[start:start + p]
        start += p
        table[row, :p] = torch.tensor(blocks, dtype=torch.int32)
        tail = n - (p - 1) * block_size           # filled slots of the last block
        k[blocks[-1], tail:] = 40.0               # slots past the length: never to be read
        v[blocks[-1], tail:] = 25.0
    q = torch.randn(len(lens), 1, heads, d, generator=g)
    return q, k, v, torch.tensor(lens, dtype=torch.int32), table


# name -> (block_size, lens, shuffle, kv_heads): the diagnosis below reads which of them fail
_ATTENTION_CASES = {
    "one partly filled block": (4, [3], True, 3),
    "one full block": (4, [4], True, 3),
    "full blocks, blocks in table order": (4, [12], False, 3),
    "full blocks, shuffled pool": (4, [12, 8, 16], True, 3),
    "ragged lengths, shuffled pool": (4, [13, 6, 1], True, 3),
    "ragged, blocks of 16, shuffled": (16, [37, 70, 16], True, 3),
    "one query head per KV head": (4, [13, 6], True, 9),
}


def _check_attention_cases(fn) -> "Verdict | None":
    """The student's function against llmlab's paged reference; None when all match."""
    from ..attention.paged import paged_attention_reference

    errors = {}
    for i, (name, (bs, lens, shuffle, kv)) in enumerate(_ATTENTION_CASES.items()):
        q, k, v, lens_t, table = _attention_case(bs, lens, seed=40 + i, shuffle=shuffle,
                                                 kv_heads=kv)
        want = paged_attention_reference(q, k, v, lens_t, table)
        got = fn(q, k, v, lens_t, table)
        errors[name] = compare_tensors(got, want, f"the output ({name}: block size {bs}, "
                                       f"lengths {lens})", 1e-4)
    bad = [n for n, e in errors.items() if e]
    if not bad:
        return None
    ok = {n for n, e in errors.items() if not e}
    problem = errors[bad[0]]
    if "shape" in problem or "tensor" in problem or "NaN" in problem:
        return wrong(problem, "return [batch, 1, heads, head_dim] in q's dtype; a row's sum l "
                     "is never 0 when the sequence has at least one token.")
    if {"one partly filled block", "one full block"} <= ok and \
            "full blocks, blocks in table order" in bad:
        return wrong(f"{problem} Right with one block, wrong with several: when a later block "
                     "raises the running max, what was summed before must be rescaled.",
                     "alpha = exp(m_old − m_new); multiply the running sum and the "
                     "accumulator by alpha before adding the new block.")
    if "full blocks, blocks in table order" in ok and "full blocks, shuffled pool" in bad:
        return wrong(f"{problem} Right when the blocks lie in the pool in table order, wrong "
                     "when they are shuffled: logical block i of sequence b lives in physical "
                     "block block_table[b, i], not in block i.",
                     "read k_cache[block_table[b, i]].")
    if "full blocks, shuffled pool" in ok and "one full block" in ok and \
            "one partly filled block" in bad:
        return wrong(f"{problem} Right when every block is full, wrong when the last block is "
                     "partly filled: its slots past cache_seqlens[b] hold no token of this "
                     "sequence and must not be read.",
                     "block i holds min(block_size, n − i · block_size) filled slots.")
    if "one query head per KV head" in ok:
        return wrong(f"{problem} Right with one query head per KV head, wrong with 9 query "
                     "heads sharing 3 KV heads: query head h reads KV head "
                     "h // (heads // kv_heads).",
                     "q[b, 0].view(kv_heads, heads // kv_heads, head_dim) groups them.")
    return wrong(problem, "start from one sequence and one block: softmax(q·Kᵀ/√d)·V over "
                 "its filled slots, then add the block loop and the online softmax.")


def _engine_attention_run(backend: str, model, tokenizer):
    """Greedy decoding of three prompts on SmolLM2 through the engine, every decode of
    every layer reading the pool with ``backend``; -> token lists per prompt."""
    from ..engine import LLM, SamplingParams

    llm = LLM(model, tokenizer, block_size=4, num_blocks=48, max_num_seqs=4,
              enable_prefix_caching=False, paged_attention=backend)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_PROMPTS, params, use_tqdm=False)]


STUDENT_BACKEND = "nb04_yours"


def _dense_refused(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None):
    raise ValueError(f"the backend {STUDENT_BACKEND!r} reads K/V through a block table only")


@exercise("nb04.paged_attention", notebook=NB,
          title="decode attention that walks the block table with an online softmax, "
                "run by the engine",
          kind="build", solution=_solution_paged_attention,
          wrong_variants={
              "no rescale of the running sum": (_paged_no_rescale, ("rescale",)),
              "reads the whole last block": (_paged_whole_last_block, ("cache_seqlens",)),
              "logical block used as physical": (_paged_logical_blocks, ("block_table[b, i]",)),
              "query heads mapped to the wrong KV head": (_paged_heads_interleaved,
                                                          ("KV head",)),
              "wraps llmlab's paged attention": (_paged_wraps_library, ("llmlab's own",)),
              "wraps torch's fused attention": (_paged_wraps_fused, ("fused attention",)),
          })
def _check_paged_attention(fn, model=None, tokenizer=None):
    """``fn(q, k_cache, v_cache, cache_seqlens, block_table, *, softmax_scale=None,
    causal=True)`` (shapes in the notebook). Pass ``model=`` and ``tokenizer=`` (SmolLM2)
    to reuse the notebook's loaded model."""
    import torch

    from .. import attention
    from ..attention.paged import paged_attention_reference

    if not callable(fn):
        return wrong(f"pass your function itself, got {type(fn).__name__}.",
                     "exercises.check(\"nb04.paged_attention\", paged_attention)")
    guarded = _guard(fn)
    try:
        verdict = _check_attention_cases(guarded)
    except _FusedAnswer as exc:
        return _fused_verdict(exc)
    if verdict is not None:
        return verdict
    model, tokenizer = _smollm2(model, tokenizer)
    want = _reference("attention", model, tokenizer,
                      lambda m, t: _engine_attention_run("paged", m, t))
    calls, worst = [0], [0.0]

    def yours(q, k_cache, v_cache, cache_seqlens, block_table, *, causal=True, **_):
        ref = paged_attention_reference(q, k_cache, v_cache, cache_seqlens, block_table)
        out = guarded(q, k_cache, v_cache, cache_seqlens, block_table)
        if isinstance(out, torch.Tensor) and out.shape == ref.shape:
            worst[0] = max(worst[0], float((out.float() - ref.float()).abs().max()))
        calls[0] += 1
        return out

    attention.register(STUDENT_BACKEND, _dense_refused, with_kvcache=yours,
                       description="notebook 04: the student's paged attention")
    try:
        got = _engine_attention_run(STUDENT_BACKEND, model, tokenizer)
    except _FusedAnswer as exc:
        return _fused_verdict(exc)
    finally:
        attention.unregister(STUDENT_BACKEND)
    for i, (g, w) in enumerate(zip(got, want)):
        diff = first_token_difference(g, w)
        if diff:
            return wrong(f"SmolLM2 served by the engine with your attention generates different "
                         f"greedy tokens for prompt {i} ({_PROMPTS[i]!r}): {diff} The largest "
                         f"error against llmlab's paged reference over the run was "
                         f"{worst[0]:.2g}.", "run your function on the cases above with "
                         "float32 inputs and compare it with the formula.")
    n_tokens = sum(len(g) for g in got)
    return right(f"{len(_ATTENTION_CASES)} cases match llmlab's paged reference, and SmolLM2 "
                 f"served {len(got)} prompts through the engine with your attention in all "
                 f"{model.config.num_layers} layers ({calls[0]:,} calls, blocks of 4): "
                 f"{n_tokens} greedy tokens equal to llmlab's paged backend, max |error| "
                 f"{worst[0]:.1e} over the run.")


def _fused_verdict(exc) -> "Verdict":
    return wrong(f"your answer calls torch's fused attention ({exc}), which does the whole job "
                 "this build asks you to write.", "walk the block table yourself: one block's "
                 "scores, then the online-softmax update.")


# ---- 7. predict, then measure: the waste of reserving the maximum length -------------------

def trace_means(name: str = "sharegpt_like") -> tuple[float, float]:
    """Mean prompt and output tokens of a shipped trace (the notebook prints them)."""
    from ..cache import waste

    reqs = waste.load_trace(name)
    return (sum(r.prompt_tokens for r in reqs) / len(reqs),
            sum(r.total_tokens - r.prompt_tokens for r in reqs) / len(reqs))


def measured_max_len_waste(cap: int = 1024, budget: int = 16384) -> float:
    """Waste of the max_len policy on the ShareGPT-like trace (what notebook 04 measures)."""
    from ..cache import waste

    return waste.simulate(waste.load_trace("sharegpt_like"), "max_len", budget,
                          max_tokens=cap).waste


@exercise("nb04.predict_waste", notebook=NB,
          title="predict the share of KV memory wasted by reserving prompt + 1024 tokens",
          kind="predict", solution=0.7,
          wrong_variants={"far too low": (0.1, ("off",))})
def _check_predict_waste(answer, measured: float | None = None):
    """``answer``: a fraction (0.7) or a percentage (70). Right within 10 points."""
    if measured is None:
        measured = measured_max_len_waste()
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) \
            or not math.isfinite(answer):
        return wrong(f"the prediction should be a number, got {answer!r}.",
                     "a fraction such as 0.5, or a percentage such as 50.")
    prompt, output = trace_means()
    frac = answer / 100 if answer > 1 else answer
    gap = frac - measured
    if abs(gap) <= 0.10:
        return right(f"you predicted {frac:.0%}, measured {measured:.0%}. The trace's mean "
                     f"request ends with {prompt:.0f} + {output:.0f} tokens but reserves prompt "
                     "+ 1024, so most of what it holds is never written.")
    side = "too low" if gap < 0 else "too high"
    return wrong(f"you predicted {frac:.0%}, measured {measured:.0%}: off by "
                 f"{abs(gap) * 100:.0f} percentage points ({side}).",
                 f"compare the mean tokens a request ends with (prompt {prompt:.0f} + output "
                 f"{output:.0f}) with what it reserves (prompt + 1024); their ratio is about "
                 "the share used.")


# ---- 8. explain: why paging preempts -------------------------------------------------------

PREEMPT_CHOICES = {
    "a": "With 16-token blocks the block tables overflow, and a full table forces a preemption.",
    "b": "Paging admits a request once its prompt fits; when those running outgrow the pool, "
         "the newest is preempted.",
    "c": "Freed blocks end up scattered over the pool, and a scattered block cannot be handed to "
         "a different request.",
    "d": "A preempted request loses the tokens it had generated, so the simulation must start "
         "it over from its prompt.",
}

_PREEMPT_EXPLANATIONS = {
    "a": "block tables do not overflow: a table grows by one entry per new block, and block "
         "size changes only the tail waste (at most block_size - 1 slots per sequence).",
    "b": "paging admits on the prompt alone and hands out blocks as sequences grow; when the "
         "sequences in flight outgrow the pool, the newest is preempted and recomputed later. "
         "Reserving prompt + cap up front never runs out mid-generation; it pays for that by "
         "holding memory that is never written.",
    "c": "paging has no external fragmentation: any free block can serve any sequence, "
         "wherever it sits in the pool.",
    "d": "preemption by recompute loses nothing: the request keeps its tokens, goes back to "
         "the front of the queue and is prefilled again; it costs compute, not correctness.",
}


@exercise("nb04.explain_preemptions", notebook=NB_FINE,
          title="why does paging preempt, while reserving the maximum length never does?",
          kind="explain", solution="b", choices=PREEMPT_CHOICES,
          wrong_variants={"fragmentation": ("c", ("fragmentation",)),
                          "tables overflow": ("a", ("overflow",))})
def _check_explain_preemptions(answer):
    return choice_verdict(answer, "b", _PREEMPT_EXPLANATIONS)


__all__ = ["random_block_ops", "BlockOpsReport", "BlockInvariantError", "cow_scenario",
           "measured_max_len_waste", "trace_means", "slot_of", "wasted_slots",
           "STUDENT_BACKEND"]
