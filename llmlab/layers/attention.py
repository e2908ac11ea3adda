"""The attention module: projections, RoPE, and a swappable attention backend.

The backend (``naive``, ``sdpa``, ``flash``, ...) is looked up by name in
:mod:`llmlab.attention`; ``set_backend`` swaps it in place. When a KV cache is passed
the cache decides how to store the new K/V and which backend form to call
(``cache.attend``), so the same module serves the no-cache baseline, the contiguous
cache and the paged cache.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import attention as attn_backends
from ..config import ModelConfig
from .rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: str = "naive"):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.rotary = RotaryEmbedding(d, config.rope_theta)
        self.set_backend(backend)

    def set_backend(self, name: str) -> None:
        self.backend = attn_backends.get(name)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, hidden]; positions [batch, seq] -> [batch, seq, hidden]."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, positions)
        if cache is None:
            out = self.backend.forward(q, k, v, causal=True, key_padding_mask=key_padding_mask)
        else:
            out = cache.attend(self.layer_idx, q, k, v, self.backend)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))
