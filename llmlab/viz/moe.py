"""Figures and the widget callback for notebook 06 (mixture of experts).

``explore_routing`` is the callback of the notebook's widget over the number of experts,
top-k and capacity factor: it routes a synthetic batch through a seeded random router and
shows each expert's load against its capacity, what gets dropped, and the balance loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..layers.moe import route
from ..layers.moe_stats import ComputeAccount, load_balancing_loss, simulate_capacity


@dataclass
class RoutingExploration:
    num_experts: int
    top_k: int
    capacity_factor: float
    tokens: int
    capacity: int
    load: list[int]
    drop_fraction: float
    tokens_fully_dropped: int
    balance_loss: float
    active_fraction: float  # k / E of the expert parameters a token uses


def synthetic_routing(tokens: int, num_experts: int, top_k: int, skew: float = 1.0,
                      hidden: int = 64, seed: int = 0):
    """Route ``tokens`` random hidden states with a seeded random router.

    ``skew`` adds a bias favouring low-numbered experts (0: an unbiased router; real
    routers, untrained or trained without a balance loss, are lopsided).
    Returns (router_logits [tokens, E], weights [tokens, k], experts [tokens, k]).
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(num_experts, hidden, generator=g) / hidden ** 0.5
    bias = skew * torch.linspace(1.0, -1.0, num_experts)
    logits = x @ w.t() + bias
    weights, experts = route(logits, top_k)
    return logits, weights, experts


def explore_routing(num_experts: int = 8, top_k: int = 2, capacity_factor: float = 1.25,
                    tokens: int = 512, skew: float = 1.0, seed: int = 0, show: bool = True):
    """Widget callback: expert loads vs capacity for one synthetic batch.

    Returns (figure or None, :class:`RoutingExploration`).
    """
    logits, _, experts = synthetic_routing(tokens, num_experts, top_k, skew, seed=seed)
    cap = simulate_capacity(experts, num_experts, capacity_factor)
    stats = RoutingExploration(num_experts, top_k, capacity_factor, tokens, cap.capacity,
                               cap.load.tolist(), cap.drop_fraction, cap.tokens_fully_dropped,
                               load_balancing_loss(logits, experts, alpha=0.01), top_k / num_experts)
    if not show:
        return None, stats
    load = cap.load.numpy()
    kept = np.minimum(load, cap.capacity)
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
    idx = np.arange(num_experts)
    ax.bar(idx, kept, color="tab:blue", label="processed")
    ax.bar(idx, load - kept, bottom=kept, color="tab:red", label="dropped (over capacity)")
    ax.axhline(cap.capacity, color="k", ls="--", lw=1, label=f"capacity = {cap.capacity}")
    ax.axhline(tokens * top_k / num_experts, color="gray", ls=":", lw=1, label="perfect balance")
    ax.set(xlabel="expert", ylabel="(token, expert) assignments",
           title=f"E={num_experts}, top-{top_k}, cf={capacity_factor}: dropped "
                 f"{stats.drop_fraction:.0%}, balance loss {stats.balance_loss:.4f} "
                 f"(uniform 0.0100)")
    ax.title.set_fontsize(9)
    if num_experts <= 32:
        ax.set_xticks(idx)
        ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig, stats


def plot_layer_loads(loads: torch.Tensor, title: str = ""):
    """Heatmap of each layer's share of assignments per expert ([layers, experts] counts)."""
    share = (loads.float() / loads.sum(1, keepdim=True)).numpy()
    fig, ax = plt.subplots(figsize=(7, 3.4), dpi=80)
    im = ax.imshow(share.T, aspect="auto", cmap="viridis", origin="lower")
    ax.set(xlabel="layer", ylabel="expert", title=title or "share of routed tokens per expert")
    ax.title.set_fontsize(9)
    fig.colorbar(im, ax=ax, label=f"share (uniform = {1 / share.shape[1]:.3f})")
    fig.tight_layout()
    return fig


def plot_dispatch_times(token_rows: list[dict], expert_rows: list[dict], title: str = ""):
    """Left: ms per layer call vs tokens for each strategy; right: µs/token vs experts."""
    colors = {"dense": "tab:blue", "loop": "tab:orange", "grouped": "tab:green"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.3), dpi=80)
    toks = [r["tokens"] for r in token_rows]
    for name in ("dense", "loop", "grouped"):
        a1.loglog(toks, [r[f"{name} ms"] for r in token_rows], "o-", label=name, color=colors[name])
    a1.set(xlabel="tokens", ylabel="ms per MoE layer", title="one MoE layer, 8 experts, top-2")
    ex = [r["experts"] for r in expert_rows]
    for name in ("dense", "grouped"):
        a2.semilogx(ex, [r[f"{name} µs/token"] for r in expert_rows], "o-", label=name, base=2,
                    color=colors[name])
    a2.set(xlabel="experts (top-2)", ylabel="µs per token",
           title=f"more experts, same top-2 ({expert_rows[0]['tokens']} tokens)")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
        a.title.set_fontsize(9)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_compute_accounts(accounts: list[ComputeAccount]):
    """Total vs active parameters (log scale) for each model."""
    fig, ax = plt.subplots(figsize=(7, 3.0), dpi=80)
    idx = np.arange(len(accounts))
    ax.bar(idx - 0.2, [a.total_params for a in accounts], 0.4, label="total (reachable)")
    ax.bar(idx + 0.2, [a.active_params for a in accounts], 0.4, label="active per token")
    ax.set_yscale("log")
    ax.set_xticks(idx)
    ax.set_xticklabels([a.name for a in accounts], fontsize=8)
    ax.set_ylabel("parameters")
    for i, a in enumerate(accounts):
        ax.text(i, a.total_params * 1.3, f"{a.active_fraction:.0%} active", ha="center", fontsize=8)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(top=max(a.total_params for a in accounts) * 8)
    fig.tight_layout()
    return fig
