"""Upcycling: turn a dense model into a mixture-of-experts model by copying its MLP.

Every layer's SwiGLU MLP becomes ``num_experts`` experts that start as copies of it, and a
new router (``gate``, [experts, hidden]) is drawn from a seeded normal distribution. This
is how sparse upcycling (Komatsuzaki et al., 2022) starts training a MoE from a dense
checkpoint; here it gives a real-sized MoE to run dispatch on without downloading one.

* With identical experts (``expert_noise=0``, the default) the experts share the dense
  weights' storage (a stride-0 expert dimension, no copy), and because the top-k routing
  weights sum to one, the MoE computes exactly the dense function: its greedy output must
  be the dense model's. That checks dispatch on a real model.
* ``expert_noise=σ`` (seeded by ``noise_seed``) makes the experts differ: expert e scales
  intermediate neuron j of the dense MLP by (1 + σ·ε[e, j]), ε ~ N(0, 1) drawn per layer,
  i.e. row j of its ``w_up`` is multiplied by that factor. Routing then changes the output.
  Only ``w_up`` is materialized per expert (smollm2-135m-moe8: about 0.85 GB in float32);
  ``w_gate`` and ``w_down`` stay shared.

``load_model("smollm2-135m-moe8")`` builds it from smollm2-135m's files at load time
(:func:`llmlab.models.loader.load_upcycled`; this module does not import the loader).
Taught in notebook 06.
"""
from __future__ import annotations

import dataclasses

import torch

from .llama import CausalLM, empty_model

# name -> (base model, experts, top-k) for the registry kind "derived"
UPCYCLED = {"smollm2-135m-moe8": ("smollm2-135m", 8, 2)}


def upcycle(dense: CausalLM, num_experts: int = 8, top_k: int = 2, router_seed: int = 0,
            router_std: float | None = None, expert_noise: float = 0.0,
            noise_seed: int = 0) -> CausalLM:
    """A MoE copy of ``dense``: each MLP becomes ``num_experts`` experts, top-``top_k`` routing.

    The router of each layer is N(0, router_std²) with ``router_std`` defaulting to
    1/√hidden (router logits then have about the spread of the normalized hidden state).
    Non-MLP weights (embeddings, attention, norms) are shared with ``dense``, not copied.
    """
    config = dense.config
    if config.is_moe:
        raise ValueError("upcycle() takes a dense model; this one is already a MoE "
                         f"({config.num_experts} experts)")
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need num_experts >= 1 and 1 <= top_k <= num_experts; "
                         f"got num_experts={num_experts}, top_k={top_k}")
    if expert_noise < 0:
        raise ValueError(f"expert_noise={expert_noise} must be >= 0")
    moe_config = dataclasses.replace(config, num_experts=num_experts,
                                     num_experts_per_tok=top_k, model_type="mixtral")
    std = router_std if router_std is not None else config.hidden_size ** -0.5
    router_gen = torch.Generator().manual_seed(router_seed)
    noise_gen = torch.Generator().manual_seed(noise_seed)

    sd = {}
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name:
            sd[name] = tensor
    for i, layer in enumerate(dense.layers):
        mlp = layer.mlp
        p = f"layers.{i}.mlp."
        sd[p + "gate.weight"] = (torch.randn(num_experts, config.hidden_size, generator=router_gen)
                                 * std).to(device=dense.device, dtype=dense.dtype)
        for ours, theirs in (("w_gate", mlp.gate_proj.weight), ("w_up", mlp.up_proj.weight),
                             ("w_down", mlp.down_proj.weight)):
            w = theirs.detach()
            sd[p + ours] = w.unsqueeze(0).expand(num_experts, *w.shape)  # shared storage
        if expert_noise > 0:
            inter = config.intermediate_size
            factor = 1 + expert_noise * torch.randn(num_experts, inter, 1, generator=noise_gen)
            sd[p + "w_up"] = sd[p + "w_up"] * factor.to(device=dense.device, dtype=dense.dtype)

    moe = empty_model(moe_config, dense.attention)
    moe.load_state_dict(sd, strict=True, assign=True)
    if moe_config.tie_word_embeddings:
        moe.lm_head.weight = moe.embed_tokens.weight
    moe.reset_rotary(dense.device)  # RoPE frequencies were built on meta
    moe.name = f"{dense.name}-moe{num_experts}"
    return moe.eval()
