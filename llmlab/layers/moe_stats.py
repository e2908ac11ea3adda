"""Routing statistics and compute accounting for mixture-of-experts models.

* expert load: how many (token, expert) assignments each expert got, per layer;
* the Switch Transformer load-balancing loss  α · N · Σᵢ fᵢ · Pᵢ  (fᵢ the fraction of
  assignments routed to expert i, Pᵢ the mean router probability of expert i; equal to α
  when routing is perfectly uniform, up to α · N when one expert takes everything);
* a capacity factor: each expert accepts at most ⌈cf · tokens · k / E⌉ assignments per
  batch, the rest are dropped (the token keeps only its residual path for that expert);
* total against active parameters and FLOPs per token, for any config, including the
  Mixtral 8x7B figures of its paper (Jiang et al. 2024: 47B parameters, 13B active);
* :func:`moe_layer_gpu_model`: a roofline **model** (not a measurement) of one MoE layer
  on a GPU, dense against grouped dispatch.

Everything here reads the routing a :class:`~llmlab.layers.moe.SparseMoE` recorded in its
last forward pass, or takes routing tensors directly. Taught in notebook 06.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..profiling.flops import linear_flops, model_flops_per_token
from ..profiling.hbm import H100, ChipSpec
from .moe import moe_layers

# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): Mistral-7B's attention, 8 SwiGLU
# experts per layer, top-2.
MIXTRAL_8X7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=32768,
                           num_experts=8, num_experts_per_tok=2, model_type="mixtral")
# Jiang et al., "Mixtral of Experts", 2024 (arXiv:2401.04088), section 2: each token can
# reach 47B parameters but uses 13B active parameters during inference.
MIXTRAL_PAPER_TOTAL_PARAMS = 47e9
MIXTRAL_PAPER_ACTIVE_PARAMS = 13e9


# -- load -----------------------------------------------------------------------------------
def expert_load(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """experts [tokens, k] -> assignments per expert [num_experts] (int64, sums to tokens·k)."""
    if experts.numel() and int(experts.max()) >= num_experts:
        raise ValueError(f"expert id {int(experts.max())} is out of range for num_experts={num_experts}")
    return torch.bincount(experts.reshape(-1).long().cpu(), minlength=num_experts)


def layer_loads(model: nn.Module) -> torch.Tensor:
    """Expert load of every MoE layer from the model's last forward pass: [layers, experts]."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("this model has no MoE layers")
    if any(m.last_routing is None for m in layers):
        raise ValueError("run a forward pass first: the MoE layers have not routed anything yet")
    return torch.stack([expert_load(m.last_routing[1], m.num_experts) for m in layers])


def load_balancing_loss(router_logits: torch.Tensor, experts: torch.Tensor,
                        alpha: float = 0.01) -> float:
    """Switch Transformer auxiliary loss α · N · Σᵢ fᵢ · Pᵢ.

    router_logits [tokens, N]; experts [tokens, k]. fᵢ is the fraction of the tokens·k
    assignments that went to expert i (sums to 1), Pᵢ the router probability of expert i
    averaged over tokens. Uniform routing gives α. (HF's Mixtral counts fᵢ per slot and sums
    over the k slots, so its value is k times this one divided by α.)
    """
    n = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)
    f = expert_load(experts, n).float() / max(experts.numel(), 1)
    p = probs.mean(dim=0).cpu()
    return float(alpha * n * (f * p).sum())


# -- capacity ---------------------------------------------------------------------------------
def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ⌈capacity_factor · tokens · top_k / num_experts⌉."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


@dataclass
class CapacityResult:
    """What a capacity limit does to one batch's routing."""

    capacity: int          # slots per expert
    load: torch.Tensor     # [experts] assignments the router asked for
    kept: torch.Tensor     # [tokens, k] bool: this assignment fits in its expert's slots
    dropped: torch.Tensor  # [experts] assignments over capacity

    @property
    def drop_fraction(self) -> float:
        """Share of all assignments that were dropped."""
        return float(self.dropped.sum()) / max(self.kept.numel(), 1)

    @property
    def tokens_fully_dropped(self) -> int:
        """Tokens that lost every one of their k experts (they pass through on the residual)."""
        return int((~self.kept).all(dim=1).sum())


def simulate_capacity(experts: torch.Tensor, num_experts: int,
                      capacity_factor: float) -> CapacityResult:
    """Apply a capacity limit to routing ``experts`` [tokens, k].

    Slots are filled first by every token's first choice (in token order), then by the
    second choices, and so on (first choices get priority, as in GShard); an assignment that
    finds its expert full is dropped.
    """
    tokens, k = experts.shape
    cap = expert_capacity(tokens, num_experts, k, capacity_factor)
    slot_major = experts.t().reshape(-1).long()  # all first choices, then all second choices
    onehot = torch.nn.functional.one_hot(slot_major, num_experts)
    rank = (onehot.cumsum(0) * onehot).sum(1) - 1  # position in its expert's queue
    kept = (rank < cap).reshape(k, tokens).t().contiguous()
    load = expert_load(experts, num_experts)
    return CapacityResult(capacity=cap, load=load, kept=kept, dropped=(load - cap).clamp_min(0))


def apply_capacity(weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Routing weights [tokens, k] with dropped assignments zeroed (not renormalized)."""
    return weights * kept.to(weights.dtype)


@dataclass
class LayerRouting:
    layer: int
    load: torch.Tensor        # [experts]
    balance_loss: float       # α · N · Σ fᵢ Pᵢ
    drop_fraction: float      # at the given capacity factor
    max_over_mean: float      # busiest expert's load / mean load (1.0 = balanced)


def routing_report(model: nn.Module, alpha: float = 0.01,
                   capacity_factor: float = 1.25) -> list[LayerRouting]:
    """Per-layer routing statistics of the model's last forward pass."""
    rows = []
    for i, m in enumerate(moe_layers(model)):
        if m.last_routing is None:
            raise ValueError("run a forward pass first: the MoE layers have not routed anything yet")
        experts = m.last_routing[1]
        load = expert_load(experts, m.num_experts)
        cap = simulate_capacity(experts, m.num_experts, capacity_factor)
        rows.append(LayerRouting(i, load, load_balancing_loss(m.last_router_logits, experts, alpha),
                                 cap.drop_fraction, float(load.max() / load.float().mean())))
    return rows


# -- compute accounting --------------------------------------------------------------------------
@dataclass
class ComputeAccount:
    """Parameters and analytic FLOPs per token (a model, not a measurement)."""

    name: str
    total_params: int
    active_params: int
    flops_per_token: int              # with top-k dispatch (what a token really needs)
    flops_per_token_all_experts: int  # if every expert ran on every token (dense dispatch)

    @property
    def active_fraction(self) -> float:
        return self.active_params / self.total_params


def compute_account(config: ModelConfig, name: str = "", context: int = 0) -> ComputeAccount:
    """Total/active parameters and FLOPs to process one token at position ``context``."""
    flops = model_flops_per_token(config, context)
    all_experts = flops
    if config.is_moe:
        h, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
        router = config.num_layers * linear_flops(1, h, e)
        per_expert = config.num_layers * 3 * linear_flops(1, h, config.intermediate_size)
        flops += router
        all_experts = flops + (e - k) * per_expert
    return ComputeAccount(name or config.model_type, config.num_parameters(active=False),
                          config.num_parameters(active=True), flops, all_experts)


# -- a GPU model ---------------------------------------------------------------------------------
@dataclass
class MoELayerEstimate:
    """One MoE layer's time on a GPU under the roofline model (seconds), dense vs grouped."""

    tokens: int
    experts_touched: float    # expected experts that receive at least one token
    dense_flops: float
    dense_bytes: float
    grouped_flops: float
    grouped_bytes: float
    dense_s: float
    grouped_s: float

    @property
    def dense_over_grouped(self) -> float:
        return self.dense_s / self.grouped_s


def moe_layer_gpu_model(tokens: int, hidden: int = 4096, inter: int = 14336, experts: int = 8,
                        top_k: int = 2, chip: ChipSpec = H100,
                        bytes_per_el: int = 2) -> MoELayerEstimate:
    """A **model**, not a measurement: one SwiGLU MoE layer on ``chip`` (default H100 SXM,
    bfloat16, Mixtral 8x7B's layer shape).

    Each kernel is assumed ideal: time = max(FLOPs / peak, bytes / HBM bandwidth), with the
    bytes being the expert weights read once plus the token activations read and written
    (launch overheads and the router are left out). Dense dispatch runs every expert on every
    token, so it reads all E experts and does E/k times the FLOPs. Grouped dispatch reads only
    the experts that got a token: with uniform routing an expert is idle with probability
    (1 - k/E)^tokens, so a handful of tokens already touch all of them.
    """
    if tokens < 1 or experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"need tokens >= 1 and 1 <= top_k <= experts; got tokens={tokens}, "
                         f"experts={experts}, top_k={top_k}")
    per_expert_bytes = 3 * hidden * inter * bytes_per_el
    per_row_flops = 2 * 3 * hidden * inter  # gate, up and down projections of one token
    touched = experts * (1 - (1 - top_k / experts) ** tokens)
    dense_flops = tokens * experts * per_row_flops
    dense_bytes = experts * per_expert_bytes + 2 * tokens * hidden * bytes_per_el
    grouped_flops = tokens * top_k * per_row_flops
    grouped_bytes = touched * per_expert_bytes + 2 * tokens * top_k * hidden * bytes_per_el
    peak, bw = chip.peak_bf16_flops, chip.hbm_bandwidth

    def t(flops, nbytes):
        return max(flops / peak, nbytes / bw)

    return MoELayerEstimate(tokens, touched, dense_flops, dense_bytes, grouped_flops, grouped_bytes,
                            t(dense_flops, dense_bytes), t(grouped_flops, grouped_bytes))
