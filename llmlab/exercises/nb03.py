"""Check functions for the exercises of notebook 03 (FlashAttention).

Each check prints whether the answer is right and, if not, a hint; it returns True or
False and never raises, so a notebook with an unfinished exercise still runs.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..attention.flash import CAUSAL_SKIPPED, block_schedule, online_softmax_update
from ..profiling.hbm import standard_attention_hbm, tiled_attention_hbm


def _say(ok: bool, msg: str) -> bool:
    print(("✅ right: " if ok else "❌ not yet: ") + msg)
    return ok


def _cases():
    g = torch.Generator().manual_seed(3)
    rows, cols, d = 4, 6, 5
    m = torch.randn(rows, generator=g, dtype=torch.float64)
    l = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5
    acc = torch.randn(rows, d, generator=g, dtype=torch.float64)
    s = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3
    s[0] += 10          # row 0: the max grows a lot, so the old state must shrink
    s[1] -= 10          # row 1: the max stays, the new block adds little
    v = torch.randn(cols, d, generator=g, dtype=torch.float64)
    return m, l, acc, s, v


def check_rescale(fn: Callable) -> bool:
    """Exercise 1: ``fn(m, l, acc, scores, v_block) -> (m_new, l_new, acc_new)``, one
    online-softmax step (see :func:`llmlab.attention.flash.online_softmax_update`)."""
    m, l, acc, s, v = _cases()
    try:
        got = fn(m.clone(), l.clone(), acc.clone(), s.clone(), v.clone())
    except NotImplementedError:
        return _say(False, "the function still raises NotImplementedError; fill in the step.")
    except Exception as exc:  # the student's code; report, never raise
        return _say(False, f"calling your function raised {type(exc).__name__}: {exc}")
    if not isinstance(got, (tuple, list)) or len(got) != 3 or \
            not all(isinstance(t, torch.Tensor) for t in got):
        return _say(False, f"return a tuple (m_new, l_new, acc_new) of tensors; got {type(got).__name__}"
                    + ("" if got is not None else " (None: is the placeholder still there?)"))
    want = online_softmax_update(m, l, acc, s, v)
    names = ("m_new", "l_new", "acc_new")
    for name, a, b in zip(names, got, want):
        if a.shape != b.shape:
            return _say(False, f"{name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
    if not torch.allclose(got[0].double(), want[0]):
        return _say(False, "m_new should be the larger of the old max and this block's row max.")
    if not torch.allclose(got[1].double(), want[1]):
        return _say(False, "l_new is off: the old sum was computed against the old max, so "
                    "multiply it by exp(m - m_new) before adding this block's Σ exp(s - m_new).")
    if not torch.allclose(got[2].double(), want[2]):
        return _say(False, "acc_new is off: rescale the old accumulator by exp(m - m_new) too, "
                    "then add exp(s - m_new) @ v_block.")
    return _say(True, "the running max, sum and accumulator all match; that rescaling is the "
                "whole trick that keeps the tiled softmax exact.")


def smallest_block_q_answer(n: int = 4096, d: int = 64) -> int:
    """The smallest power-of-two Br for which tiled attention moves fewer modelled HBM
    bytes than standard attention (non-causal, Bc = 64)."""
    br = 1
    while tiled_attention_hbm(n, d, br, 64).total >= standard_attention_hbm(n, d).total:
        br *= 2
    return br


def check_smallest_block_q(answer) -> bool:
    """Exercise 2: smallest power-of-two Br with tiled traffic below standard (N=4096, d=64)."""
    if answer is None or answer is ...:
        return _say(False, "set `answer` to a power of two.")
    right = smallest_block_q_answer()
    if answer == right:
        return _say(True, f"Br = {right}: K and V are read N/Br times, 2·N²·d/Br bytes, which "
                    "beats the 4·N² of the score matrix once Br > d/2.")
    if isinstance(answer, int) and answer > right:
        return _say(False, f"Br = {answer} works, but a smaller one already does; try halving.")
    return _say(False, f"with Br = {answer!r} the tiled loop still reads K and V too often; "
                "compare tiled_attention_hbm(4096, 64, Br, 64).total with "
                "standard_attention_hbm(4096, 64).total.")


def check_skipped_tiles(answer, n: int = 1024, block: int = 128) -> bool:
    """Exercise 3: how many Br×Bc tiles a causal N=1024 pass skips with Br = Bc = 128."""
    if answer is None or answer is ...:
        return _say(False, "set `answer` to a whole number of tiles.")
    right = int((block_schedule(n, n, block, block, causal=True) == CAUSAL_SKIPPED).sum())
    if answer == right:
        return _say(True, f"{right} of {(n // block) ** 2} tiles are never loaded: every tile "
                    "strictly above the diagonal.")
    return _say(False, f"{answer!r} is not it. There are {n // block} blocks per side; the tiles "
                "strictly above the diagonal are skipped (block_schedule shows them).")
