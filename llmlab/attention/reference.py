"""The two baseline attention backends: ``naive`` (the textbook formula) and ``sdpa``.

``naive`` is the reference every other backend is tested against: it builds the whole
[batch, heads, seq_q, seq_k] score matrix, which is exactly the memory FlashAttention
avoids (notebook 03). Taught in notebook 01.

Also here, shared by every backend: :func:`check_varlen` and :func:`varlen_by_sequence`,
which gives a dense backend the varlen form (packed sequences, ``cu_seqlens``) by running
it on one sequence at a time, and :func:`group_queries`, the grouped-query layout that
lets one key serve all the query heads that share it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q={tuple(q.shape)} k={tuple(k.shape)} "
                         f"v={tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat grouped KV heads so each query head has its own: [b, s, kv, d] -> [b, s, h, d]."""
    groups = num_heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, seq_q, heads, head_dim] -> [batch, kv_heads, group * seq_q, head_dim].

    The ``group = heads // kv_heads`` query heads that read the same KV head become extra
    query rows of that head (row r of KV head h is query head h·group + r // seq_q), so
    attention reads each key once per KV head instead of once per query head.
    """
    batch, seq_q, heads, head_dim = q.shape
    group = heads // kv_heads
    qg = q.view(batch, seq_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    return qg.reshape(batch, kv_heads, group * seq_q, head_dim)


def ungroup_queries(out: torch.Tensor, seq_q: int) -> torch.Tensor:
    """Undo :func:`group_queries`: [batch, kv_heads, group * seq_q, d] -> [batch, seq_q, heads, d]."""
    batch, kv_heads, rows, head_dim = out.shape
    group = rows // seq_q
    out = out.view(batch, kv_heads, group, seq_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, seq_q, kv_heads * group, head_dim)


def causal_mask(seq_q: int, seq_k: int, device=None) -> torch.Tensor:
    """Bool [seq_q, seq_k], True where query i may see key j (aligned bottom-right)."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    return j <= i + (seq_k - seq_q)


def _allowed(q, k, causal, key_padding_mask):
    """Bool mask broadcastable to [b, h, sq, sk], or None when everything is allowed."""
    allowed = None
    if causal:
        allowed = causal_mask(q.shape[1], k.shape[1], q.device)[None, None]
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, :].to(torch.bool)
        allowed = pad if allowed is None else allowed & pad
    return allowed


def naive_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
                    key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + mask) V, materializing the full score matrix.

    Shapes as in :mod:`llmlab.attention`. Softmax runs in float32 at least. A query row whose
    keys are all masked (a left-padding position) gets uniform weights, not NaN.
    """
    _check(q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    h = q.shape[2]
    qt = q.transpose(1, 2)                      # [b, h, sq, d]
    kt = expand_kv(k, h).transpose(1, 2)        # [b, h, sk, d]
    vt = expand_kv(v, h).transpose(1, 2)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale   # [b, h, sq, sk]
    allowed = _allowed(q, k, causal, key_padding_mask)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    return torch.matmul(probs, vt).transpose(1, 2)


def sdpa_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
                   key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """torch's fused scaled_dot_product_attention (it picks flash / memory-efficient / math)."""
    _check(q, k, v)
    h = q.shape[2]
    qt = q.transpose(1, 2)
    kt = expand_kv(k, h).transpose(1, 2)
    vt = expand_kv(v, h).transpose(1, 2)
    sq, sk = q.shape[1], k.shape[1]
    if key_padding_mask is None and (not causal or sq == sk):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal and sq > 1,
                                             scale=softmax_scale)
    else:
        allowed = _allowed(q, k, causal, key_padding_mask)
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=softmax_scale)
    return out.transpose(1, 2)


# -- the varlen form: packed sequences --------------------------------------------------

def check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor) -> None:
    """ValueError naming the bad shape or offsets of a varlen call (shapes in :func:`varlen_by_sequence`)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("varlen q, k, v must be [total_tokens, heads, head_dim]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"incompatible shapes q={tuple(q.shape)} k={tuple(k.shape)} "
                         f"v={tuple(v.shape)} (query heads must be a multiple of kv heads)")
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                            ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 tensor [batch + 1]; got "
                             f"{cu.dtype} {tuple(cu.shape)}")
        c = cu.tolist()
        if c[0] != 0 or c[-1] != total or any(a > b for a, b in zip(c, c[1:])):
            raise ValueError(f"{name}={c} must start at 0, never decrease and end at the "
                             f"number of tokens ({total})")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k "
                         f"has {cu_seqlens_k.numel()}; both must be batch + 1")


def attend_each_sequence(forward: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         **kwargs) -> torch.Tensor:
    """Run a dense backend ``forward`` on each packed sequence in turn (shapes as varlen).

    Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] and key rows
    cu_seqlens_k[i]:cu_seqlens_k[i+1]; it attends to its own keys only, so the cost is
    the sum of each sequence's seq_q · seq_k, never the square of the whole pack.
    Query rows of a sequence with no keys are zeros.
    """
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros_like(q)
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i] or ck[i + 1] == ck[i]:
            continue
        out[cq[i]:cq[i + 1]] = forward(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                                       v[None, ck[i]:ck[i + 1]], **kwargs)[0]
    return out


def varlen_by_sequence(forward: Callable) -> Callable:
    """The varlen form of a dense backend, shaped like FlashAttention's ``flash_attn_varlen_func``::

        varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               softmax_scale=None, causal=True) -> out
          q  [total_q, heads, head_dim]      every sequence's queries, packed
          k  [total_k, kv_heads, head_dim]   v likewise
          cu_seqlens_q/k  int32 [batch + 1]  where each sequence starts (0 first, total last)
          out [total_q, heads, head_dim]

    ``causal`` is aligned bottom-right within each sequence. It calls ``forward`` once
    per sequence (:func:`attend_each_sequence`); a backend with a real varlen kernel
    registers that instead.
    """
    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
               softmax_scale: float | None = None, causal: bool = True) -> torch.Tensor:
        return attend_each_sequence(forward, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                    causal=causal, softmax_scale=softmax_scale)

    label = getattr(forward, "__name__", type(forward).__name__)
    varlen.__name__ = f"{label}_varlen"
    varlen.__doc__ = f"The varlen form of {label}: one call per packed sequence."
    return varlen
