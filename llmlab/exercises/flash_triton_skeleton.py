"""A FlashAttention forward kernel in Triton whose inner loop the student writes
(notebook 03b, stretch exercise ``nb03.flash_triton_inner_loop``).

The skeleton kernel does everything around the online softmax: from its program ids it
finds its block of ``BLOCK_M`` query rows and its (sequence, query head), computes the
pointers of that head's Q rows and of the KV head it reads (grouped-query: query head h
reads KV head h // (heads // kv_heads)), loads the Q tile, starts the running state
(m = −inf, l = 0, acc = 0), calls ``inner_loop`` and stores acc / l. ``inner_loop`` is a
``@triton.jit`` function passed to the kernel as a compile-time constant; it receives the
state and returns it updated after visiting keys [0, hi) in blocks of ``BLOCK_N``, loaded
with :func:`load_k_block` and :func:`load_v_block` (which read zeros past the last key).

Shapes (as notebook 03's ``flash_forward``): q [batch, heads, n_q, d], k/v
[batch, kv_heads, n_k, d], float32; causal aligned bottom-right. On a machine without CUDA
the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set by
:mod:`llmlab.device`): every program runs as NumPy, exact but slow, so the checks use small
sizes. Importing this module needs Triton (Linux wheels).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from ..device import triton_interpreted


@triton.jit
def load_k_block(K, stride_kn, offs_n, offs_d, n_k):
    """The keys at positions ``offs_n`` [BLOCK_N], transposed: [HEAD_DIM, BLOCK_N] (0 past n_k)."""
    return tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None],
                   mask=(offs_n < n_k)[None, :], other=0.0)


@triton.jit
def load_v_block(V, stride_vn, offs_n, offs_d, n_k):
    """The values at positions ``offs_n``: [BLOCK_N, HEAD_DIM] (0 past n_k)."""
    return tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :],
                   mask=(offs_n < n_k)[:, None], other=0.0)


@triton.jit
def _skeleton_kernel(Q, K, V, O,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                     heads, groups, n_q, n_k, qk_scale,
                     inner_loop: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)              # which block of BLOCK_M query rows
    bh = tl.program_id(1)                   # which (sequence, query head)
    b = bh // heads
    h = bh % heads
    kv_h = h // groups                      # the KV head this query head reads
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_head = K + b * stride_kb + kv_h * stride_kh
    v_head = V + b * stride_vb + kv_h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    causal_offset = n_k - n_q               # query i sees key j when j <= i + causal_offset
    hi = n_k
    if CAUSAL:                              # blocks past the last row's diagonal: never loaded
        hi = tl.minimum(n_k, (start_m + 1) * BLOCK_M + causal_offset)
    acc, l_i, m_i = inner_loop(acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_vn, offs_m,
                               offs_d, n_k, hi, causal_offset, qk_scale, BLOCK_N, CAUSAL)
    out = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out, mask=row_ok[:, None])


def flash_forward_with(inner_loop: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       block_m: int = 16, block_n: int = 16, causal: bool = True) -> torch.Tensor:
    """Run the skeleton kernel with ``inner_loop``: q [batch, heads, n_q, d], k/v
    [batch, kv_heads, n_k, d] float32 (d a power of two >= 16) -> [batch, heads, n_q, d]."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [b, h, n_q, d] and k, v [b, kv_heads, n_k, d]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    if h % kv_heads:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kv_heads}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two >= 16")
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name}={blk} must be a power of two >= 16")
    q, k, v = (t.contiguous().float() for t in (q, k, v))
    out = torch.empty_like(q)
    grid = (triton.cdiv(n_q, block_m), b * h)
    _skeleton_kernel[grid](q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                           *out.stride()[:3], h, h // kv_heads, n_q, n_k, 1.0 / math.sqrt(d),
                           inner_loop=inner_loop, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                           CAUSAL=causal)
    return out


# ---- the reference inner loop and realistic mistakes ------------------------------------------

@triton.jit
def _solution_inner_loop(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, n_k, hi,
                        causal_offset, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_k_block(K, stride_kn, offs_n, offs_d, n_k)
        v = load_v_block(V, stride_vn, offs_n, offs_d, n_k)
        s = tl.dot(q, k) * qk_scale                              # [BLOCK_M, BLOCK_N]
        ok = offs_n[None, :] < n_k                               # the ragged last block
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)                              # rescale what came before
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _no_rescale_inner_loop(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, n_k, hi,
                           causal_offset, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_k_block(K, stride_kn, offs_n, offs_d, n_k)
        v = load_v_block(V, stride_vn, offs_n, offs_d, n_k)
        s = tl.dot(q, k) * qk_scale
        ok = offs_n[None, :] < n_k
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = acc + tl.dot(p, v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _unmasked_tail_inner_loop(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, n_k,
                              hi, causal_offset, qk_scale, BLOCK_N: tl.constexpr,
                              CAUSAL: tl.constexpr):
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_k_block(K, stride_kn, offs_n, offs_d, n_k)
        v = load_v_block(V, stride_vn, offs_n, offs_d, n_k)
        s = tl.dot(q, k) * qk_scale
        if CAUSAL:
            s = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_offset, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _top_left_inner_loop(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, n_k, hi,
                         causal_offset, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_k_block(K, stride_kn, offs_n, offs_d, n_k)
        v = load_v_block(V, stride_vn, offs_n, offs_d, n_k)
        s = tl.dot(q, k) * qk_scale
        ok = offs_n[None, :] < n_k
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return acc, l_i, m_i


def wrong_inner_loops() -> dict:
    """Realistic mistakes and the words the checker's message must contain."""
    return {"no running-max rescale": (_no_rescale_inner_loop, ("rescale",)),
            "keys past n_k not masked": (_unmasked_tail_inner_loop, ("past n_k",)),
            "causal mask top-left": (_top_left_inner_loop, ("bottom-right",))}


# ---- the checker --------------------------------------------------------------------------------

# (name, n_q, n_k, causal), BLOCK_M = BLOCK_N = 16: each case adds one difficulty
_CASES = (
    ("one key block", 16, 16, False),
    ("several key blocks", 48, 48, False),
    ("ragged lengths", 40, 40, False),
    ("causal, ragged", 37, 37, True),
    ("causal, 7 new queries over 45 keys", 7, 45, True),
)


def check_inner_loop(inner_loop: Callable):
    """Run the skeleton with ``inner_loop`` on small ragged cases against the float64
    reference; the verdict names the first case that fails and the likely mistake."""
    from . import compare_tensors, right, wrong
    from .nb03 import _qkv, reference_attention

    atol = 1e-4 if triton_interpreted() else 5e-3      # compiled float32 dots may use TF32
    dev = "cpu" if triton_interpreted() or not torch.cuda.is_available() else "cuda"
    for name, n_q, n_k, causal in _CASES:
        q, k, v = _qkv(n_q, n_k, batch=1, heads=2, kv_heads=1, d=16, device=dev)
        with np.errstate(divide="ignore", invalid="ignore"):   # the interpreter's 0/0: NaN
            got = flash_forward_with(inner_loop, q, k, v, causal=causal).cpu()
        q, k, v = q.cpu(), k.cpu(), v.cpu()
        want = reference_attention(q, k, v, causal=causal)
        problem = compare_tensors(got, want, "the output", atol=atol)
        if not problem:
            continue
        where = f"case '{name}' (n_q={n_q}, n_k={n_k}, causal={causal}): {problem}"
        if bool(torch.isnan(got).all()) or not bool(got.abs().gt(0).any()):
            return wrong(f"{where} l is still 0 for every row (acc / l = 0/0), so the loop adds "
                         "nothing yet.", "inside the loop compute the scores, update m_i, l_i "
                         "and acc, and return them.")

        def matches(**kw) -> bool:
            return float((got.double() - reference_attention(q, k, v, **kw)).abs().max()) < atol

        if causal and n_q != n_k and matches(causal=True, top_left=True):
            return wrong(f"{where} Your causal mask is aligned top-left (query i sees keys "
                         "j <= i); it must be aligned bottom-right: j <= i + causal_offset.",
                         "compare offs_n with offs_m + causal_offset.")
        if causal and matches(causal=False):
            return wrong(f"{where} Your output has no causal mask.",
                         "set s to -inf where offs_n > offs_m + causal_offset when CAUSAL.")
        if name == "several key blocks":
            return wrong(f"{where} One key block is right, several are not: the state is not "
                         "rescaled when the running max grows.",
                         "multiply l_i and acc by exp(m_i - m_new) before adding the block.")
        if name == "ragged lengths":
            return wrong(f"{where} Full blocks are right, the ragged last block is not: keys at "
                         "or past n_k load as zeros and score 0, not -inf, so they still take "
                         "a share of the softmax.",
                         "mask the scores with offs_n < n_k (tl.where(ok, s, float('-inf'))).")
        return wrong(where, "compare with the online-softmax step you wrote in torch.")
    mode = "the Triton interpreter" if triton_interpreted() else "a compiled kernel"
    return right(f"all {len(_CASES)} cases match the reference (ragged lengths, causal "
                 f"bottom-right, grouped heads; max |error| < {atol:g}) in {mode}.")
