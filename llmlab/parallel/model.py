"""Assemble a tensor-parallel Llama from the ordinary one.

The normal :class:`llmlab.models.llama.CausalLM` is built on the meta device (no memory),
then :func:`parallelize` swaps its projections and embeddings for the parallel layers of
:mod:`llmlab.layers.linear`, Megatron-style:

    attention   q_proj, k_proj, v_proj -> ColumnParallelLinear (split by heads)
                o_proj                 -> RowParallelLinear    (all-reduce #1)
    MLP         gate_proj, up_proj     -> ColumnParallelLinear
                down_proj              -> RowParallelLinear    (all-reduce #2)
    embed_tokens                       -> VocabParallelEmbedding (one all-reduce per pass)
    lm_head                            -> ParallelLMHead (logits all-gathered)

Each rank keeps num_heads/tp query heads and num_kv_heads/tp KV heads, so grouped-query
attention stays grouped on every rank (query head j still reads KV head j // group).
RMSNorm, rotary embedding and the attention backends are the ordinary ones, and the
forward pass is CausalLM's own: nothing in it knows about ranks. Taught in notebook 07.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..layers.linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                             VocabParallelEmbedding)
from ..models.llama import CausalLM, empty_model


def valid_tp_degrees(config: ModelConfig, up_to: int | None = None) -> list[int]:
    """Degrees that split query heads, KV heads, the MLP width and the vocabulary evenly."""
    g = math.gcd(config.num_heads, config.num_kv_heads)
    g = math.gcd(g, math.gcd(config.intermediate_size, config.vocab_size))
    top = g if up_to is None else min(g, up_to)
    return [d for d in range(1, top + 1) if g % d == 0]


def check_tp_degree(config: ModelConfig, tp: int) -> None:
    """ValueError naming the valid degrees unless ``tp`` splits the model evenly."""
    if config.is_moe:
        raise ValueError(f"tensor parallelism here covers dense models; model_type="
                         f"{config.model_type!r} has {config.num_experts} experts")
    valid = valid_tp_degrees(config)
    if not isinstance(tp, int) or tp not in valid:
        raise ValueError(f"tensor-parallel degree tp={tp!r} does not divide the model evenly "
                         f"(num_heads={config.num_heads}, num_kv_heads={config.num_kv_heads}, "
                         f"intermediate_size={config.intermediate_size}, "
                         f"vocab_size={config.vocab_size}); valid degrees: {valid}")


def parallelize(model: CausalLM, tp_rank: int, tp_size: int, group=None) -> CausalLM:
    """Replace ``model``'s linear and embedding modules by rank ``tp_rank``'s parallel ones.

    Works in place on a model built on the meta device (the new parameters are empty on
    meta too; load them with :func:`llmlab.parallel.loader.load_tp_model`). Returns ``model``.
    """
    cfg = model.config
    check_tp_degree(cfg, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in 0..{tp_size - 1}")
    h, d = cfg.hidden_size, cfg.head_dim
    kw = dict(tp_rank=tp_rank, tp_size=tp_size, group=group, device="meta")
    for layer in model.layers:
        attn = layer.self_attn
        bias = cfg.attention_bias
        attn.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, bias=bias, **kw)
        attn.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, bias=bias, **kw)
        attn.v_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, bias=bias, **kw)
        attn.o_proj = RowParallelLinear(cfg.num_heads * d, h, bias=False, **kw)
        attn.num_heads = cfg.num_heads // tp_size  # the forward reshapes with these
        attn.num_kv_heads = cfg.num_kv_heads // tp_size
        mlp = layer.mlp
        mlp.gate_proj = ColumnParallelLinear(h, cfg.intermediate_size, **kw)
        mlp.up_proj = ColumnParallelLinear(h, cfg.intermediate_size, **kw)
        mlp.down_proj = RowParallelLinear(cfg.intermediate_size, h, **kw)
    model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, **kw)
    model.lm_head = ParallelLMHead(h, cfg.vocab_size, **kw)
    if cfg.tie_word_embeddings:  # same vocabulary rows on this rank, so one tensor serves both
        model.lm_head.weight = model.embed_tokens.weight
    model.tp_rank, model.tp_size = tp_rank, tp_size
    return model


def build_tp_model(config: ModelConfig, tp_rank: int, tp_size: int, attention: str = "naive",
                   group=None) -> CausalLM:
    """A CausalLM on the meta device with rank ``tp_rank``'s parallel layers (no weights yet)."""
    check_tp_degree(config, tp_size)
    model = empty_model(config, attention)
    return parallelize(model, tp_rank, tp_size, group)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
