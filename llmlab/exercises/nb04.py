"""Check functions for the exercises of notebook 04 (PagedAttention)."""
from __future__ import annotations

from ..cache.block_manager import BlockManager
from . import call_cases, say, unanswered


def check_slot(fn) -> bool:
    """``fn(block_table, position, block_size)`` -> the flat slot of token ``position``."""
    cases = [([7, 2, 9], 0, 4, 28), ([7, 2, 9], 5, 4, 9), ([7, 2, 9], 11, 4, 39),
             ([3], 15, 16, 63), ([0, 5], 16, 16, 80)]
    got, problem = call_cases(fn, [c[:3] for c in cases], "an int")
    if problem:
        return say(False, "", problem)
    bad = [(c, g) for c, g in zip(cases, got) if g != c[3]]
    if bad:
        (table, pos, bs, want), g = bad[0]
        return say(False, "", f"block_table={table}, position={pos}, block_size={bs}: got {g}, "
                    f"expected {want}. Hint: the logical block is position // block_size.")
    return say(True, "slot = block_table[pos // block_size] * block_size + pos % block_size — "
                "what BlockManager.slot computes", "")


def check_wasted_slots(fn) -> bool:
    """``fn(lengths, block_size)`` -> slots allocated but not holding a token, summed."""
    cases = [([1], 16, 15), ([16, 17], 16, 15), ([5, 9, 33], 8, 3 + 7 + 7), ([100], 1, 0),
             ([], 4, 0)]
    got, problem = call_cases(fn, [(list(lengths), bs) for lengths, bs, _ in cases], "an int")
    if problem:
        return say(False, "", problem)
    bad = [(c, g) for c, g in zip(cases, got) if g != c[2]]
    if bad:
        (lengths, bs, want), g = bad[0]
        return say(False, "", f"lengths={lengths}, block_size={bs}: got {g}, expected {want}. "
                    "Hint: a sequence of n tokens holds ceil(n / block_size) blocks.")
    return say(True, "at most block_size - 1 slots per sequence: the only waste paging leaves", "")


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


def check_cow_blocks(answer, block_size: int = 4, prompt_len: int = 10, children: int = 2) -> bool:
    """How many physical blocks are in use in :func:`cow_scenario`?"""
    if unanswered(answer):
        return say(False, "", "fill in `answer` with an integer")
    want = cow_scenario(block_size, prompt_len, children)
    full = prompt_len // block_size
    return say(answer == want,
                f"{want} blocks: the {full} full prompt blocks stay shared; the partly filled "
                f"last block is copied once per writer except the last one to write",
                f"got {answer}. Hint: full blocks stay shared; a write into a shared, partly "
                "filled block copies it first, unless the writer is its last owner.")


__all__ = ["check_slot", "check_wasted_slots", "check_cow_blocks", "cow_scenario"]
