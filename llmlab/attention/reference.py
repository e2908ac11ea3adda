"""The two baseline attention backends: ``naive`` (the textbook formula) and ``sdpa``.

``naive`` is the reference every other backend is tested against: it builds the whole
[batch, heads, seq_q, seq_k] score matrix, which is exactly the memory FlashAttention
avoids (notebook 03). Taught in notebook 01.
"""
from __future__ import annotations

import math

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
