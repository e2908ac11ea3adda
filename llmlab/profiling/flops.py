"""Analytic FLOP and byte counters (models, not measurements).

Conventions: a multiply-add is 2 FLOPs; bytes count each operand read once from and
each result written once to main memory (DRAM/HBM), the ideal a kernel can reach.
"""
from __future__ import annotations

from ..config import ModelConfig


def linear_flops(tokens: int, in_features: int, out_features: int) -> int:
    """[tokens, in] @ [in, out]: 2 · tokens · in · out."""
    return 2 * tokens * in_features * out_features


def linear_bytes(tokens: int, in_features: int, out_features: int, bytes_per_el: int = 4) -> int:
    """Weights read + activations read + outputs written."""
    return bytes_per_el * (in_features * out_features + tokens * in_features + tokens * out_features)


def attention_pairs(q_len: int, kv_len: int, causal: bool = False) -> int:
    """(query, key) pairs whose score is computed, per sequence and head.

    Without a mask: q_len · kv_len. With ``causal`` the mask is aligned bottom-right (as in
    FlashAttention and a KV cache: the last query sees every key), so query i of q_len
    sees kv_len − q_len + i + 1 keys: the lower triangle *including its diagonal*. For
    q_len == kv_len == N that is N(N+1)/2, a little more than half of N².
    """
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"q_len={q_len} and kv_len={kv_len} must be >= 0")
    if not causal:
        return q_len * kv_len
    if q_len <= kv_len:
        return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2
    return kv_len * (kv_len + 1) // 2   # the first q_len - kv_len queries see no key


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                    causal: bool = False) -> int:
    """FLOPs of QKᵀ and P·V: 2 · head_dim multiply-adds (4 · head_dim FLOPs) per computed
    (query, key) pair, i.e. 4 · batch · heads · pairs · head_dim with pairs from
    :func:`attention_pairs` (all q_len · kv_len, or with ``causal`` the lower triangle
    including the diagonal, aligned bottom-right). Softmax, scaling and masking are not
    counted. The one count every notebook and benchmark uses."""
    return 4 * batch * heads * head_dim * attention_pairs(q_len, kv_len, causal)


def attention_bytes(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                    head_dim: int, bytes_per_el: int = 4, materialize_scores: bool = True) -> int:
    """Standard (naive) attention: Q, K, V read, O written, and — if materialized — the
    [q, k] score matrix written, read for softmax, written as P and read again (4 passes)."""
    io = bytes_per_el * batch * head_dim * (2 * heads * q_len + 2 * kv_heads * kv_len)
    scores = 4 * bytes_per_el * batch * heads * q_len * kv_len if materialize_scores else 0
    return io + scores


def weight_bytes(config: ModelConfig, bytes_per_el: int = 4, active: bool = True) -> int:
    """Bytes of weights read once per forward pass (embedding lookup not counted)."""
    n = config.num_parameters(active=active)
    n -= config.vocab_size * config.hidden_size  # the lookup touches only a few rows
    if config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size  # ...but the tied lm_head reads it all
    return n * bytes_per_el


def model_flops_per_token(config: ModelConfig, context: int) -> int:
    """FLOPs to process one token at position ``context`` (weights + attention over context)."""
    h, d = config.hidden_size, config.head_dim
    per_layer = (linear_flops(1, h, config.num_heads * d) + 2 * linear_flops(1, h, config.num_kv_heads * d)
                 + linear_flops(1, config.num_heads * d, h))
    k = config.num_experts_per_tok if config.is_moe else 1
    per_layer += k * 3 * linear_flops(1, h, config.intermediate_size)
    per_layer += attention_flops(1, config.num_heads, 1, context, d)
    return config.num_layers * per_layer + linear_flops(1, h, config.vocab_size)
