"""FlashAttention: exact attention without the N×N score matrix (taught in notebook 03).

Standard attention writes the [batch, heads, N, N] scores to main memory (HBM on a GPU),
reads them back for the softmax, writes the probabilities and reads them again for ·V.
FlashAttention cuts Q into row blocks of ``block_q`` (Br) queries and K/V into column
blocks of ``block_k`` (Bc) keys, and keeps one [Br, Bc] tile of scores in fast on-chip
memory at a time. The softmax over a whole row is assembled block by block with an
*online softmax*: a running row maximum ``m``, a running sum of exponentials ``l`` and an
output accumulator ``acc`` that is rescaled by exp(m_old − m_new) whenever the maximum
grows. The result is the same softmax(QKᵀ·scale)V up to rounding.

Two backends are registered here:

``flash``
    the tiled algorithm in plain PyTorch (:func:`flash_attention`), the reference the
    kernel is checked against and the version the notebook steps through.
``flash_triton``
    the Triton kernel in :mod:`llmlab.kernels.flash_attn` (FlashAttention-2 style). On a
    machine without CUDA it runs in the Triton interpreter: correct but slow.

Both also register a varlen form shaped like ``flash_attn_varlen_func``.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from . import register
from .reference import _check, attend_each_sequence, check_varlen

CAUSAL_SKIPPED, FULL_BLOCK, MASKED_BLOCK = 0, 1, 2


def _check_block(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a positive power of two (1, 2, 4, ..., 64, 128, ...)")


def kv_blocks(q_start: int, q_end: int, seq_q: int, seq_k: int, block_k: int,
              causal: bool) -> Iterator[tuple[int, int, bool]]:
    """The key blocks that query rows [q_start, q_end) must visit: (k_start, k_end, needs_mask).

    Key blocks are aligned to multiples of ``block_k``. With ``causal`` (bottom-right:
    query i sees key j when j <= i + seq_k - seq_q) blocks wholly to the right of the
    last row's diagonal are skipped, and blocks that cross the diagonal need a mask;
    blocks wholly left of the first row's diagonal need none.
    """
    offset = seq_k - seq_q
    end = min(seq_k, q_end + offset) if causal else seq_k
    for k_start in range(0, max(end, 0), block_k):
        k_end = min(k_start + block_k, seq_k)
        yield k_start, k_end, causal and k_end > q_start + offset + 1


def block_schedule(seq_q: int, seq_k: int, block_q: int, block_k: int,
                   causal: bool = True) -> torch.Tensor:
    """Which (query block, key block) tiles the tiled loop computes.

    Returns int [ceil(seq_q/block_q), ceil(seq_k/block_k)]: ``FULL_BLOCK`` (1) computed
    without a mask, ``MASKED_BLOCK`` (2) computed with the causal mask, ``CAUSAL_SKIPPED``
    (0) never loaded. The same rule drives :func:`flash_attention` and the Triton kernel.
    """
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    grid = torch.zeros(math.ceil(seq_q / block_q), math.ceil(seq_k / block_k), dtype=torch.int64)
    for bi, q_start in enumerate(range(0, seq_q, block_q)):
        q_end = min(q_start + block_q, seq_q)
        for k_start, _, masked in kv_blocks(q_start, q_end, seq_q, seq_k, block_k, causal):
            grid[bi, k_start // block_k] = MASKED_BLOCK if masked else FULL_BLOCK
    return grid


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor,
                          scores: torch.Tensor, v_block: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of scores into the running softmax state.

    m [..., rows] running row max; l [..., rows] running sum of exp(score − m);
    acc [..., rows, head_dim] running Σ exp(score − m)·v; scores [..., rows, cols] with
    masked entries = −inf; v_block [..., cols, head_dim]. Returns the new (m, l, acc).

    When the max grows from m to m_new, everything summed so far was exponentiated
    against the old max, so l and acc are multiplied by exp(m − m_new) before the new
    block is added. A row that has seen only masked keys keeps m = −inf, l = 0, acc = 0.
    """
    m_new = torch.maximum(m, scores.amax(dim=-1))
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_safe)                    # rescales what was summed before
    p = torch.exp(scores - m_safe[..., None])
    l_new = alpha * l + p.sum(dim=-1)
    acc_new = alpha[..., None] * acc + torch.matmul(p, v_block)
    return m_new, l_new, acc_new


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    softmax_scale: float | None = None,
                    key_padding_mask: torch.Tensor | None = None,
                    block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """Block-tiled attention with an online softmax, in plain PyTorch.

    q [batch, seq_q, heads, head_dim]; k, v [batch, seq_k, kv_heads, head_dim];
    key_padding_mask [batch, seq_k] bool (True = real token) -> [batch, seq_q, heads, head_dim].
    ``block_q`` (Br) and ``block_k`` (Bc) are the tile sizes (powers of two). Grouped KV
    heads are broadcast, never copied. Works in float32 (float64 for float64 inputs);
    the largest temporary is one [batch, heads, Br, Bc] tile. Query rows that see no key
    at all (left-padding rows) return zeros.
    """
    _check(q, k, v)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    b, seq_q, h, d = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    groups = h // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    # [b, kv_heads, groups, seq, d]: query heads that share a KV head sit side by side
    qg = q.permute(0, 2, 1, 3).reshape(b, kv_heads, groups, seq_q, d).to(work)
    kg = k.permute(0, 2, 1, 3)[:, :, None].to(work)     # [b, kv_heads, 1, seq_k, d]
    vg = v.permute(0, 2, 1, 3)[:, :, None].to(work)
    pad = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, seq_k):
            raise ValueError(f"key_padding_mask must be [batch, seq_k] = {(b, seq_k)}; "
                             f"got {tuple(key_padding_mask.shape)}")
        pad = key_padding_mask.to(device=q.device, dtype=torch.bool)[:, None, None, None, :]
    offset = seq_k - seq_q
    out = torch.empty(b, kv_heads, groups, seq_q, d, dtype=work, device=q.device)
    for q_start in range(0, seq_q, block_q):
        q_end = min(q_start + block_q, seq_q)
        q_blk = qg[..., q_start:q_end, :] * scale
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=work, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_blk)
        for k_start, k_end, needs_mask in kv_blocks(q_start, q_end, seq_q, seq_k, block_k, causal):
            s = torch.matmul(q_blk, kg[..., k_start:k_end, :].transpose(-1, -2))
            allowed = None
            if needs_mask:
                rows = torch.arange(q_start, q_end, device=q.device)[:, None]
                cols = torch.arange(k_start, k_end, device=q.device)[None, :]
                allowed = cols <= rows + offset
            if pad is not None:
                blk = pad[..., k_start:k_end]
                allowed = blk if allowed is None else allowed & blk
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf"))
            m, l, acc = online_softmax_update(m, l, acc, s, vg[..., k_start:k_end, :])
        out[..., q_start:q_end, :] = acc / torch.where(l == 0, torch.ones_like(l), l)[..., None]
    return out.reshape(b, h, seq_q, d).transpose(1, 2).to(q.dtype)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """Packed sequences, as ``flash_attn_varlen_func``: q [total_q, heads, head_dim],
    k/v [total_k, kv_heads, head_dim], cu_seqlens_q/k int32 [batch + 1] -> [total_q, heads, head_dim].

    Sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]; ``causal`` aligns each pair
    bottom-right. Runs :func:`flash_attention` on each sequence.
    """
    return attend_each_sequence(flash_attention, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                causal=causal, softmax_scale=softmax_scale,
                                block_q=block_q, block_k=block_k)


# -- the Triton kernel behind the backend signature ----------------------------------

def key_ranges(key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The run of real keys per row of a padding mask [batch, seq_k] -> (start, end) int32 [batch].

    The Triton kernel takes padding as a key range [start, end) per batch row: left
    padding before it, and tokens appended after a row finished. So the True entries of
    each row must be one contiguous run (how llmlab pads batches); anything else is
    refused. A row with no True gets an empty range.
    """
    mask = key_padding_mask.to(torch.bool)
    if mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be [batch, seq_k]; got {tuple(mask.shape)}")
    n = mask.shape[1]
    idx = torch.arange(n, device=mask.device)
    count = mask.sum(dim=1)
    start = torch.where(mask, idx, n).amin(dim=1)
    end = torch.where(mask, idx + 1, 0).amax(dim=1)
    holes = (count > 0) & ((end - start) != count)
    if bool(holes.any()):
        row = int(holes.nonzero()[0])
        raise ValueError("flash_triton supports key masks whose True entries form one run per "
                         f"row (left padding, finished rows); row {row} is "
                         f"{mask[row].int().tolist()}. Use the 'flash' or 'naive' backend for "
                         "arbitrary masks.")
    return start.to(torch.int32), torch.maximum(end, start).to(torch.int32)


def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           causal: bool = True, softmax_scale: float | None = None,
                           key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The ``flash_triton`` backend: dense signature of :mod:`llmlab.attention` on the kernel.

    A ``key_padding_mask`` becomes a key range [start, end) per row (left padding, finished
    rows); masks with holes inside the run of real keys raise ValueError. float64 inputs run in float32 and are cast back.
    """
    from llmlab.kernels.flash_attn import flash_attn_func

    _check(q, k, v)
    start = end = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (q.shape[0], k.shape[1]):
            raise ValueError(f"key_padding_mask must be [batch, seq_k] = {(q.shape[0], k.shape[1])}; "
                             f"got {tuple(key_padding_mask.shape)}")
        start, end = key_ranges(key_padding_mask)
    if q.dtype == torch.float64:
        out = flash_attn_func(q.float(), k.float(), v.float(), causal=causal,
                              softmax_scale=softmax_scale, key_start=start, key_end=end)
        return out.double()
    return flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           key_start=start, key_end=end)


def flash_triton_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, *,
                        softmax_scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """The varlen form of ``flash_triton`` (see :func:`flash_attention_varlen` for shapes)."""
    from llmlab.kernels.flash_attn import flash_attn_varlen_func

    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal)


register("flash", flash_attention, varlen=flash_attention_varlen,
         description="tiled online softmax in PyTorch; never holds more than a Br×Bc tile of scores")
register("flash_triton", flash_triton_attention, varlen=flash_triton_varlen,
         description="Triton FlashAttention-2 style kernel (interpreter on CPU)")
