"""Mixtral-style sparse MoE block: a router picks top-k of E SwiGLU experts per token.

Routing (as Mixtral): softmax over the router logits in float32, take the top-k, and
renormalize the k weights to sum to one. Expert weights are stacked so that dispatch
strategies can treat them as one batched operand:

    w_gate, w_up  [experts, intermediate, hidden]
    w_down        [experts, hidden, intermediate]

Dispatch strategies are plain functions registered in ``DISPATCH`` and chosen by name
(``moe.dispatch = "loop"``); all take (x [tokens, hidden], weights [tokens, k],
experts [tokens, k], w_gate, w_up, w_down) and return [tokens, hidden].
Taught in notebook 06.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def route(router_logits: torch.Tensor, top_k: int):
    """router_logits [tokens, experts] -> (weights [tokens, k] float32, experts [tokens, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_mlp(x, w_gate, w_up, w_down):
    """One SwiGLU expert: x [n, hidden] with its own [inter, hidden] / [hidden, inter] weights."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def dispatch_loop(x, weights, experts, w_gate, w_up, w_down):
    """Per expert: gather its tokens, run the expert, scatter-add the weighted result."""
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        tok, slot = torch.where(experts == e)
        if tok.numel() == 0:
            continue
        y = expert_mlp(x[tok], w_gate[e], w_up[e], w_down[e])
        out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
    return out


DISPATCH: dict[str, Callable] = {"loop": dispatch_loop}


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 dispatch: str = "loop"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.dispatch = dispatch
        self.last_routing: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def dispatch(self) -> str:
        return self._dispatch

    @dispatch.setter
    def dispatch(self, name: str) -> None:
        if name not in DISPATCH:
            raise ValueError(f"unknown MoE dispatch {name!r}; allowed: {list(DISPATCH)}")
        self._dispatch = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = route(self.gate(flat), self.top_k)
        self.last_routing = (weights.detach(), experts.detach())
        out = DISPATCH[self._dispatch](flat, weights, experts, self.w_gate, self.w_up, self.w_down)
        return out.reshape(shape)
