"""The Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2; Mixtral with a MoE block).

    ids -> embed -> N × [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head -> logits

Written from the parts in :mod:`llmlab.layers`; HF transformers is used only as the
oracle in the tests. Taught in notebooks 00 and 01.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch import nn

from ..config import ModelConfig
from ..layers import MLP, Attention, RMSNorm, SparseMoE, rotary


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, attention: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe:
            self.mlp = SparseMoE(config.hidden_size, config.intermediate_size,
                                 config.num_experts, config.num_experts_per_tok)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, positions, cache=None, key_padding_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, key_padding_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """A decoder-only language model; ``model(input_ids)`` returns logits [batch, seq, vocab]."""

    def __init__(self, config: ModelConfig, attention: str = "naive"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, attention)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.attention = attention
        self.name = "custom"

    # -- knobs ---------------------------------------------------------------------
    def set_attention(self, name: str) -> "CausalLM":
        """Swap the attention backend of every layer in place (see llmlab.attention.available())."""
        for layer in self.layers:
            layer.self_attn.set_backend(name)
        self.attention = name
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def reset_rotary(self, device=None) -> None:
        """Recompute RoPE frequencies in float32 (after a meta build or a dtype cast).
        Layers with the same head size and theta share one tensor, so the cos/sin tables
        built by the first layer of a forward serve them all (:mod:`llmlab.layers.rotary`)."""
        shared: dict = {}
        for mod in self.modules():
            if isinstance(mod, rotary.RotaryEmbedding):
                key = (mod.head_dim, mod.theta)
                mod.reset_frequencies(device, shared.get(key))
                shared.setdefault(key, mod.inv_freq)

    # -- forward -------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, attention_mask: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [batch, seq] -> logits [batch, seq, vocab] (or [batch, 1, vocab]).

        attention_mask [batch, seq]: 1 for real tokens, 0 for (left) padding; positions
        then count real tokens only. With ``cache`` the cache owns masks and positions of
        earlier tokens, and ``positions`` must be given. ``last_only`` computes logits for
        the last position only (all that generation needs).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        key_padding_mask = None
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required when a KV cache is passed")
            if attention_mask is not None:
                key_padding_mask = attention_mask.to(torch.bool)
                positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            else:
                positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        elif attention_mask is not None:
            key_padding_mask = attention_mask.to(torch.bool)
        top = int(positions.max()) if positions.numel() else 0
        if top >= self.config.max_position_embeddings:
            raise ValueError(f"position {top} is past the model's context of "
                             f"{self.config.max_position_embeddings} tokens")
        return self.step(input_ids, positions, cache, key_padding_mask,
                         rows="last" if last_only else None)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache=None,
             key_padding_mask: torch.Tensor | None = None, rows=None,
             num_layers: int | None = None) -> torch.Tensor:
        """The decoder itself, with no checks and no host synchronization: the one step
        function that :meth:`forward`, the serving engine's runner, speculative decoding
        and ``compile=True`` (:mod:`llmlab.compile`) all run.

        input_ids, positions [batch, seq]; ``rows`` picks the hidden states that reach the
        vocabulary projection (the most expensive matmul per token): None, all
        (-> [batch, seq, vocab]); ``"last"``, the last position (-> [batch, 1, vocab]); a
        long tensor of indices into the seq axis of batch row 0 (the packed layout: ->
        [len(rows), vocab]). ``num_layers``: run only the first layers (an early-exit
        draft model).
        """
        rotary.clear_tables()        # positions differ from the last forward's
        x = self.embed_tokens(input_ids)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            x = layer(x, positions, cache, key_padding_mask)
        if isinstance(rows, str):
            x = x[:, -1:]
        elif rows is not None:
            x = x[0, rows]
        return self.lm_head(self.norm(x))


@contextlib.contextmanager
def meta_skeleton():
    """Build modules on the meta device (no memory) without running their initializers.

    The weights are about to be replaced by loaded ones, and a few initializers (the
    embedding's normal_, RoPE's frequency division) have Python meta kernels whose first
    call imports torch._dynamo: seconds in every fresh process, for values thrown away.
    Call :meth:`CausalLM.reset_rotary` after loading.
    """
    def no_frequencies(head_dim, theta, device=None):
        return torch.empty(head_dim // 2, device=device)

    with torch.device("meta"), \
            mock.patch.object(nn.Embedding, "reset_parameters", lambda self: None), \
            mock.patch.object(rotary, "inverse_frequencies", no_frequencies):
        yield


def empty_model(config: ModelConfig, attention: str = "naive") -> CausalLM:
    """A :class:`CausalLM` on the meta device, ready for ``load_state_dict(..., assign=True)``."""
    with meta_skeleton():
        return CausalLM(config, attention=attention)


def first_layers(model: CausalLM, num_layers: int) -> CausalLM:
    """A model made of ``model``'s embedding, its first ``num_layers`` decoder layers, its
    final norm and its head: the same weights, shared, not copied (an early-exit model).

    A whole SmolLM2 decode step takes minutes to compile on a 2-core CPU; its first few
    layers show the same graph, recompiles and fused kernels in seconds (notebook 11)."""
    import copy
    from dataclasses import replace

    if not isinstance(num_layers, int) or not 1 <= num_layers <= len(model.layers):
        raise ValueError(f"num_layers={num_layers!r} must be an int in 1..{len(model.layers)}")
    short = copy.copy(model)
    short._modules = dict(model._modules)          # the copy's own module table
    short.layers = nn.ModuleList(list(model.layers[:num_layers]))
    short.config = replace(model.config, num_layers=num_layers)
    return short
