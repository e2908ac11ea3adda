"""Exercises of notebook 04 (PagedAttention): slot mapping, internal fragmentation, a block
allocator with reference counts, copy-on-write, and the paged kernel's block loop.

The build exercise is ``nb04.block_allocator``: the student writes the pool of physical KV
blocks (free list + reference counts) with the interface of
:class:`llmlab.cache.block_manager.BlockAllocator`, and the library's block tables run on
top of it (``BlockManager(..., allocator=...)``). It is judged in three stages, cheapest
first: a few direct calls (precise messages), :func:`random_block_ops` (10,000 random
allocate / append / fork / free operations checked against a model of what every sequence
holds), and the serving engine on SmolLM2 with the student's allocator under its block
tables, which must give the tokens of the library's allocator, forks and preemptions included.
"""
from __future__ import annotations

import functools
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..cache.block_manager import BlockManager, NoFreeBlocksError
from . import choice_verdict, compare_tensors, exercise, first_token_difference, right, wrong

NB = "04_paged_attention"


def _returns_none(fn, cases) -> tuple[list, int | None]:
    """``fn(*args)`` per case (its exceptions propagate: the verdict then names them);
    -> (results, index of the first None or None)."""
    got = [fn(*args) for args in cases]
    return got, next((i for i, g in enumerate(got) if g is None), None)


# ---- 1. slot mapping ---------------------------------------------------------------------

def _solution_slot_of(block_table, position, block_size):
    return block_table[position // block_size] * block_size + position % block_size


_SLOT_CASES = [([7, 2, 9], 0, 4, 28), ([7, 2, 9], 5, 4, 9), ([7, 2, 9], 11, 4, 39),
               ([3], 15, 16, 63), ([0, 5], 16, 16, 80), ([4, 1, 6, 2], 9, 4, 25)]


@exercise("nb04.slot_of", notebook=NB, title="the flat slot of a token, through the block table",
          kind="build", solution=_solution_slot_of,
          wrong_variants={
              "ignores the table": (lambda t, p, b: p, ("block_table",)),
              "block index and offset swapped": (lambda t, p, b: t[p % b % len(t)] * b + p // b,
                                                 ("logical block",)),
              "off by one block": (lambda t, p, b: t[min(p // b + 1, len(t) - 1)] * b + p % b,
                                   ("logical block",)),
          })
def _check_slot_of(fn):
    """``fn(block_table, position, block_size)`` -> the flat slot of token ``position``."""
    got, none_at = _returns_none(fn, [c[:3] for c in _SLOT_CASES])
    if none_at is not None:
        return wrong("your function returns None.",
                     "return an int: the slot in the flattened pool.")
    for (table, pos, bs, want), g in zip(_SLOT_CASES, got):
        if g != want:
            hint = ("the logical block is position // block_size and the offset inside it "
                    "position % block_size; the block_table turns the logical block into a "
                    "physical one.")
            if g == pos:
                return wrong(f"block_table={table}, position={pos}, block_size={bs}: you returned "
                             f"the position itself ({g}); it ignores the block_table.", hint)
            return wrong(f"block_table={table}, position={pos}, block_size={bs}: got {g}, "
                         f"expected {want}: check which logical block you look up.", hint)
    return right(f"all {len(_SLOT_CASES)} cases match what BlockManager.slot computes.")


# ---- 2. internal fragmentation -----------------------------------------------------------

def _solution_wasted_slots(lengths, block_size):
    return sum(-(-n // block_size) * block_size - n for n in lengths)


_WASTE_CASES = [([1], 16, 15), ([16, 17], 16, 15), ([5, 9, 33], 8, 3 + 7 + 7), ([100], 1, 0),
                ([], 4, 0), ([32, 64], 16, 0)]


@exercise("nb04.wasted_slots", notebook=NB, title="slots held in blocks but not filled",
          kind="build", solution=_solution_wasted_slots,
          wrong_variants={
              "counts a full block as wasted": (lambda ls, b: sum(b - n % b for n in ls),
                                                ("wastes nothing",)),
              "counts the filled part": (lambda ls, b: sum(n % b for n in ls), ("ceil",)),
          })
def _check_wasted_slots(fn):
    """``fn(lengths, block_size)`` -> slots allocated but not holding a token, summed."""
    got, none_at = _returns_none(fn, [(list(ls), bs) for ls, bs, _ in _WASTE_CASES])
    if none_at is not None:
        return wrong("your function returns None.",
                     "return an int: the unused slots of all sequences together.")
    for (lengths, bs, want), g in zip(_WASTE_CASES, got):
        if g != want:
            full = any(n and n % bs == 0 for n in lengths)
            what = (" A sequence that exactly fills its blocks wastes nothing." if full else "")
            return wrong(f"lengths={lengths}, block_size={bs}: got {g}, expected {want}.{what}",
                         "a sequence of n tokens holds ceil(n / block_size) blocks.")
    return right("at most block_size - 1 slots per sequence: the only waste paging leaves.")


# ---- 3. the block allocator (the build exercise) -----------------------------------------

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
                     enable_prefix_caching: bool | None = None) -> BlockOpsReport:
    """Drive a :class:`BlockManager` through ``ops`` random operations and check it.

    ``allocator``: a class (or factory) called as ``allocator(num_blocks, block_size)`` whose
    object replaces the library's :class:`BlockAllocator`; None keeps the library's.
    ``enable_prefix_caching`` defaults to True for the library's allocator and False for a
    replacement (which then needs no prefix-cache methods).

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
                      allocator=pool_obj)
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
        if allocator is None and step % 50 == 0:
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


def _engine_allocator_run(allocator_cls, model=None, tokenizer=None):
    """Serve three prompts (one with n=2 sampled completions: a fork and copy-on-write) on a
    pool small enough to preempt; -> (token lists per completion, preemptions)."""
    from ..engine import LLM, SamplingParams

    model, tokenizer = _smollm2(model, tokenizer)
    llm = LLM(model, tokenizer, block_size=4, num_blocks=12, max_num_seqs=4,
              enable_prefix_caching=False)
    eng = llm.engine
    if allocator_cls is not None:
        bm = BlockManager(eng.cache.num_blocks, eng.cache.block_size,
                          enable_prefix_caching=False,
                          allocator=allocator_cls(eng.cache.num_blocks, eng.cache.block_size))
        eng.cache.manager = bm
        eng.scheduler.bm = bm
    prompts = ["The capital of France is", "Name three colours of the rainbow:",
               "One, two, three, four,"]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [c.token_ids for o in outs for c in o.outputs]
    if eng.cache.manager.num_used_blocks:
        raise AssertionError(f"{eng.cache.manager.num_used_blocks} blocks are still in use "
                             "after every request finished")
    return tokens, llm.stats.num_preemptions


def _smollm2(model=None, tokenizer=None):
    if model is not None and tokenizer is not None:
        return model, tokenizer
    return _load_smollm2()


@functools.lru_cache(maxsize=1)
def _load_smollm2():
    import llmlab

    return llmlab.load_model("smollm2-135m"), llmlab.load_tokenizer("smollm2-135m")


_REFERENCE_RUNS: dict[int, tuple] = {}


def _reference_tokens(model, tokenizer):
    """The engine run with llmlab's own allocator, once per model."""
    key = id(model)
    if key not in _REFERENCE_RUNS:          # the model is kept in the value: its id stays unique
        _REFERENCE_RUNS[key] = (model, _engine_allocator_run(None, model, tokenizer))
    return _REFERENCE_RUNS[key][1]


@exercise("nb04.block_allocator", notebook=NB,
          title="a block allocator with reference counts (runs under the engine's block tables)",
          kind="build", solution=_SolutionBlockAllocator,
          wrong_variants={
              "refcount not decremented on free": (_NoDecrement, ("not decremented",)),
              "free list reuses a block still referenced": (_FreesShared,
                                                            ("still", "free list")),
              "allocate does not raise when empty": (_NoRaiseWhenEmpty, ("NoFreeBlocksError",)),
              "off-by-one block id": (_OffByOne, ("off-by-one",)),
          })
def _check_block_allocator(cls, model=None, tokenizer=None):
    """``cls(num_blocks, block_size)``: allocate / incref / decref / num_free / ref_counts.

    Pass ``model=`` and ``tokenizer=`` (SmolLM2) to reuse the notebook's loaded model.
    """
    if not callable(cls):
        return wrong(f"pass your allocator class itself, got {type(cls).__name__}.",
                     "exercises.check(\"nb04.block_allocator\", MyBlockAllocator)")
    verdict = _unit_checks(cls)
    if verdict is not None:
        return verdict
    try:
        report = random_block_ops(cls, ops=10_000)
    except BlockInvariantError as exc:
        return wrong(f"the random-operation test broke an invariant {exc}",
                     "the block tables are the library's; the counts and the free list are "
                     "yours. Replay the operation on a small pool by hand.")
    model, tokenizer = _smollm2(model, tokenizer)
    want, _ = _reference_tokens(model, tokenizer)
    got, pre = _engine_allocator_run(cls, model, tokenizer)
    for i, (g, w) in enumerate(zip(got, want)):
        diff = first_token_difference(g, w)
        if diff:
            return wrong(f"the engine with your allocator generates different tokens in "
                         f"completion {i}: {diff}", "some sequence read K/V that another one "
                         "overwrote; check when a block may return to the free list.")
    return right(f"{report.ops:,} random operations kept every invariant ({report.allocations:,} "
                 f"allocations, {report.forks:,} forks, {report.copies:,} copy-on-write copies, "
                 f"{report.refusals:,} refusals), and SmolLM2 served 4 completions with your "
                 f"allocator under the block tables ({pre} preemption{'s' if pre != 1 else ''}, "
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


# ---- 5. predict, then measure: the waste of reserving the maximum length -------------------

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
    frac = answer / 100 if answer > 1 else answer
    gap = frac - measured
    if abs(gap) <= 0.10:
        return right(f"you predicted {frac:.0%}, measured {measured:.0%}. The mean request "
                     "ends with about 161 + 338 tokens, but each reserves prompt + 1024, so "
                     "most of what it holds is never written.")
    side = "too low" if gap < 0 else "too high"
    return wrong(f"you predicted {frac:.0%}, measured {measured:.0%}: off by "
                 f"{abs(gap) * 100:.0f} percentage points ({side}).",
                 "compare the mean tokens a request ends with (prompt 161 + output 338) with "
                 "what it reserves (prompt + 1024); the ratio is about the share used.")


# ---- 6. explain: why paging preempts -------------------------------------------------------

_PREEMPT_CHOICES = {
    "a": "Paging admits a request once its prompt fits and gives it blocks as it grows; when "
         "the requests in flight have grown past the pool, the newest is preempted and "
         "recomputed later. Reserving prompt + cap up front never runs out mid-generation; "
         "it pays for that by holding memory that is never written.",
    "b": "block tables do not overflow: a table grows by one entry per new block, and block "
         "size changes only the tail waste (at most block_size - 1 slots per sequence).",
    "c": "paging has no external fragmentation: any free block can serve any sequence, "
         "wherever it sits in the pool.",
    "d": "preemption by recompute loses nothing: the request keeps its tokens, goes back to "
         "the front of the queue and is prefilled again; it costs compute, not correctness.",
}


@exercise("nb04.explain_preemptions", notebook=NB,
          title="why paging preempts while reserving the maximum length never does",
          kind="explain", solution="a",
          wrong_variants={"fragmentation": ("c", ("fragmentation",))})
def _check_explain_preemptions(answer):
    return choice_verdict(answer, "a", _PREEMPT_CHOICES)


# ---- 7. stretch: the paged kernel's block loop ----------------------------------------------

def _solution_paged_decode(q, k_cache, v_cache, cache_seqlens, block_table):
    """One decode query per sequence, reading K/V block by block with an online softmax.

    q [batch, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads,
    head_dim]; cache_seqlens [batch]; block_table [batch, max_blocks] -> [batch, heads, head_dim].
    """
    import torch

    batch, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(batch, heads, d, dtype=torch.float32)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qb = q[b].float().view(kv_heads, group, d)                 # [kv, g, d]
        m = torch.full((kv_heads, group), float("-inf"))
        l = torch.zeros(kv_heads, group)
        acc = torch.zeros(kv_heads, group, d)
        for i in range(-(-n // bs)):
            blk = int(block_table[b, i])
            valid = min(bs, n - i * bs)
            k = k_cache[blk, :valid].float().permute(1, 0, 2)       # [kv, valid, d]
            v = v_cache[blk, :valid].float().permute(1, 0, 2)
            s = qb @ k.transpose(1, 2) / math.sqrt(d)              # [kv, g, valid]
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v
            m = m_new
        out[b] = (acc / l[..., None]).reshape(heads, d)
    return out.to(q.dtype)


def _paged_decode_no_rescale(q, k_cache, v_cache, cache_seqlens, block_table):
    import torch

    batch, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(batch, heads, d)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qb = q[b].float().view(kv_heads, group, d)
        m = torch.full((kv_heads, group), float("-inf"))
        l = torch.zeros(kv_heads, group)
        acc = torch.zeros(kv_heads, group, d)
        for i in range(-(-n // bs)):
            blk = int(block_table[b, i])
            valid = min(bs, n - i * bs)
            k = k_cache[blk, :valid].float().permute(1, 0, 2)
            v = v_cache[blk, :valid].float().permute(1, 0, 2)
            s = qb @ k.transpose(1, 2) / math.sqrt(d)
            m = torch.maximum(m, s.amax(-1))                       # max kept, sums not rescaled
            p = torch.exp(s - m[..., None])
            l = l + p.sum(-1)
            acc = acc + p @ v
        out[b] = (acc / l[..., None]).reshape(heads, d)
    return out


def _paged_decode_whole_last_block(q, k_cache, v_cache, cache_seqlens, block_table):
    import torch

    bs = k_cache.shape[1]
    full = torch.tensor([-(-int(n) // bs) * bs for n in cache_seqlens], dtype=torch.int32)
    return _solution_paged_decode(q, k_cache, v_cache, full, block_table)


def _paged_cases():
    """(q, k_cache, v_cache, lens, table, label): ragged lengths over a shuffled pool."""
    import torch

    g = torch.Generator().manual_seed(4)
    cases = []
    for bs, lens, label in ((4, [1], "one token"), (4, [4], "one full block"),
                            (4, [13, 8, 5], "ragged, several blocks"),
                            (16, [37, 70, 16], "block 16, ragged")):
        per = max(-(-n // bs) for n in lens)
        nb = per * len(lens) + 2
        k = torch.randn(nb, bs, 3, 16, generator=g) * 3          # large scores: the max moves
        v = torch.randn(nb, bs, 3, 16, generator=g)
        table = torch.randperm(nb, generator=g)[:per * len(lens)].view(len(lens), per)
        q = torch.randn(len(lens), 9, 16, generator=g)
        cases.append((q, k, v, torch.tensor(lens, dtype=torch.int32), table.to(torch.int32),
                      label))
    return cases


@exercise("nb04.paged_block_loop", notebook=NB,
          title="stretch: decode attention that walks the block table block by block",
          kind="build", solution=_solution_paged_decode, stretch=True,
          wrong_variants={
              "no running-max rescale": (_paged_decode_no_rescale, ("rescale",)),
              "reads the whole last block": (_paged_decode_whole_last_block,
                                             ("cache_seqlens",)),
          })
def _check_paged_block_loop(fn):
    """``fn(q [batch, heads, d], k_cache, v_cache, cache_seqlens, block_table)``."""
    from ..attention.paged import paged_attention_reference

    results = []
    for q, k, v, lens, table, label in _paged_cases():
        want = paged_attention_reference(q[:, None], k, v, lens, table)[:, 0]
        got = fn(q, k, v, lens, table)
        results.append((label, compare_tensors(got, want, f"the output ({label})", 1e-4),
                        lens, k.shape[1]))
    bad = [r for r in results if r[1]]
    if not bad:
        return right("matches the paged reference at ragged lengths, block sizes 4 and 16, "
                     "GQA 9:3 heads: the loop the paged_triton kernel runs per sequence.")
    label, problem = bad[0][:2]
    if _last_block_only(fn):
        return wrong(f"{problem} Right when every block is full, wrong when the last block is "
                     "partly filled: slots past cache_seqlens are being read.",
                     "read only min(block_size, n - i * block_size) slots of block i.")
    ok = {r[0] for r in results if not r[1]}
    if {"one token", "one full block"} <= ok:
        return wrong(f"{problem} Right with one block, wrong with several: the running max "
                     "and sum must rescale when a later block raises the max.",
                     "alpha = exp(m_old - m_new); multiply l and the accumulator by alpha.")
    return wrong(problem, "start from one sequence and one block: softmax(q·Kᵀ/√d)·V with "
                 "query head h reading KV head h // (heads // kv_heads).")


def _last_block_only(fn) -> bool:
    """True when ``fn`` is right at lengths that fill their blocks but not at ragged ones."""
    import torch

    from ..attention.paged import paged_attention_reference

    g = torch.Generator().manual_seed(9)
    k = torch.randn(6, 4, 3, 16, generator=g)
    v = torch.randn(6, 4, 3, 16, generator=g)
    q = torch.randn(1, 9, 16, generator=g)
    table = torch.tensor([[5, 2, 0]], dtype=torch.int32)
    errs = []
    for n in (12, 10):
        lens = torch.tensor([n], dtype=torch.int32)
        want = paged_attention_reference(q[:, None], k, v, lens, table)[:, 0]
        errs.append(compare_tensors(fn(q, k, v, lens, table), want, "out", 1e-4))
    return errs[0] is None and errs[1] is not None


__all__ = ["random_block_ops", "BlockOpsReport", "BlockInvariantError", "cow_scenario",
           "measured_max_len_waste"]
