"""Rotary position embedding (RoPE), the half-split ("rotate_half") convention of HF Llama.

Position p rotates each pair (x[i], x[i + d/2]) by angle p · theta^(-2i/d). Because the
rotation depends only on the absolute position, a cached K never needs recomputing.
"""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]; cos/sin [batch, seq, head_dim]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


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

    def reset_frequencies(self, device=None) -> None:
        """Recompute the float32 frequencies (after a meta-device build or a dtype cast)."""
        self.inv_freq = inverse_frequencies(self.head_dim, self.theta, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [batch, seq] int -> cos, sin [batch, seq, head_dim] in ``dtype``."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q, k, positions):
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
