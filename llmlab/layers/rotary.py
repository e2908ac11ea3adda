"""Rotary position embedding (RoPE), the half-split ("rotate_half") convention of HF Llama.

Position p rotates each pair (x[i], x[i + d/2]) by angle p · theta^(-2i/d). Because the
rotation depends only on the absolute position, a cached K never needs recomputing.

Every layer rotates by the same angles (same positions, same frequencies), so the cos/sin
tables are computed once per forward pass: :meth:`RotaryEmbedding.tables` remembers the
last ``positions`` tensor it saw (by identity) with the frequency tensor it used, and the
next layer reuses them. The models share one frequency tensor between layers
(:meth:`llmlab.models.llama.CausalLM.reset_rotary`) and clear the memo at the start of
each forward.
"""
from __future__ import annotations

import torch
from torch import nn

# (positions, inv_freq, dtype, cos, signed sin) of the last tables built: see tables()
_LAST: list = [None]


def clear_tables() -> None:
    """Forget the remembered cos/sin tables (called at the start of each model forward)."""
    _LAST[0] = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]; cos/sin [batch, seq, head_dim]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` in four ops, bit for bit: rotate_half(x)·sin is x with its
    halves swapped (a roll by d/2) times sin with its first half negated."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, float32 [head_dim // 2]."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exps)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embedding")
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta), persistent=False)

    def reset_frequencies(self, device=None, inv_freq: torch.Tensor | None = None) -> None:
        """Recompute the float32 frequencies (after a meta-device build or a dtype cast);
        ``inv_freq``: use this tensor instead (layers with equal frequencies share one)."""
        self.inv_freq = inv_freq if inv_freq is not None else \
            inverse_frequencies(self.head_dim, self.theta, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [batch, seq] int -> cos, sin [batch, seq, head_dim] in ``dtype``."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and signed sin [batch, seq, 1, head_dim] for :func:`_rotate`, built once per
        (positions tensor, frequency tensor, dtype) and reused by the next layers."""
        last = _LAST[0]
        if last is not None and last[0] is positions and last[1] is self.inv_freq \
                and last[2] == dtype:
            return last[3], last[4]
        cos, sin = self.cos_sin(positions, dtype)
        half = self.head_dim // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, signed = cos[:, :, None, :], signed[:, :, None, :]
        _LAST[0] = (positions, self.inv_freq, dtype, cos, signed)
        return cos, signed

    def forward(self, q, k, positions):
        cos, signed_sin = self.tables(positions, q.dtype)
        return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)
