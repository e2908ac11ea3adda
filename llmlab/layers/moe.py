"""Mixtral-style sparse MoE block: a router picks top-k of E SwiGLU experts per token.

Routing (as Mixtral): softmax over the router logits in float32, take the top-k, and
renormalize the k weights to sum to one. Expert weights are stacked so that dispatch
strategies can treat them as one batched operand:

    w_gate, w_up  [experts, intermediate, hidden]
    w_down        [experts, hidden, intermediate]

Dispatch strategies are plain functions chosen by name (``moe.dispatch = "grouped"``, or
``set_dispatch(model, "grouped")`` for every layer). The built-in ones live in ``DISPATCH``;
they take (x [tokens, hidden], weights [tokens, k], experts [tokens, k], w_gate, w_up,
w_down) and return [tokens, hidden]:

    dense    every expert runs on every token; unchosen experts get weight 0. The answer
             is right, but the cost is E/k times the sparse one: sparsity ignored.
    loop     per expert, find its tokens (``torch.where``), gather, run, scatter-add.
             E scans of the routing table and E small gathers.
    grouped  one stable sort of the (token, expert) pairs by expert makes each expert's rows
             contiguous; one gather, then each expert runs one GEMM per projection over
             its slice (``llmlab.kernels.moe_gemm``: a grouped-GEMM Triton kernel on CUDA,
             a per-slice loop in PyTorch on CPU), routing weights applied in the down
             projection, then one gather back through the inverse permutation and a sum
             over the k slots (no scatter-add needed).

``register_dispatch(name, fn)`` adds a dispatch that also routes: ``fn(x, router_logits
[tokens, experts], top_k, w_gate, w_up, w_down) -> [tokens, hidden]`` gets the router's raw
logits and does the softmax, top-k and renormalization itself (notebook 06's exercise
plugs the student's function in this way).

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


def dispatch_dense(x, weights, experts, w_gate, w_up, w_down):
    """Every expert on every token, combined with a dense [tokens, experts] weight matrix."""
    combine = torch.zeros(x.shape[0], w_gate.shape[0], dtype=weights.dtype, device=x.device)
    combine.scatter_(1, experts, weights)  # zero for the experts a token did not choose
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        out += expert_mlp(x, w_gate[e], w_up[e], w_down[e]) * combine[:, e, None].to(x.dtype)
    return out


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


def group_by_expert(experts: torch.Tensor, num_experts: int):
    """Sort the (token, slot) pairs by expert.

    experts [tokens, k] -> (order [tokens*k], token [tokens*k], offsets [num_experts + 1]):
    ``order`` indexes the flattened pairs so that expert ids are non-decreasing (stable, so
    tokens keep their order inside an expert), ``token = order // k`` is the source row of
    each sorted pair, and expert e owns sorted rows ``offsets[e]:offsets[e+1]``.
    """
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, order // experts.shape[1], offsets


def dispatch_grouped(x, weights, experts, w_gate, w_up, w_down, impl: str = "auto"):
    """Sort pairs by expert, one grouped GEMM per projection, one gather back and a sum.

    ``impl`` chooses the grouped GEMM: "auto" (Triton on CUDA, PyTorch on CPU), "torch", "triton".
    """
    from ..kernels.moe_gemm import grouped_swiglu

    order, token, offsets = group_by_expert(experts, w_gate.shape[0])
    xs = x[token]  # [tokens*k, hidden], each expert's rows contiguous
    y = grouped_swiglu(xs, w_gate, w_up, w_down, offsets, scale=weights.reshape(-1)[order], impl=impl)
    # Back to (token, slot) order and sum the k slots. Every token has exactly k pairs, so
    # this is a permutation (a gather through the inverse of ``order``) and a sum, which is
    # much faster on CPU than a scatter-add (index_add_) of the same rows.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse].view(x.shape[0], experts.shape[1], -1).sum(dim=1)


DISPATCH: dict[str, Callable] = {"dense": dispatch_dense, "loop": dispatch_loop,
                                 "grouped": dispatch_grouped}

# Dispatches that route for themselves: fn(x, router_logits, top_k, w_gate, w_up, w_down).
_ROUTING_DISPATCH: dict[str, Callable] = {}


def available_dispatches() -> list[str]:
    """Names a MoE layer accepts: the built-in strategies, then the registered ones."""
    return list(DISPATCH) + list(_ROUTING_DISPATCH)


def _check_name(name: str) -> None:
    if name not in DISPATCH and name not in _ROUTING_DISPATCH:
        raise ValueError(f"unknown MoE dispatch {name!r}; allowed: {available_dispatches()}")


def register_dispatch(name: str, fn: Callable) -> None:
    """Add (or replace) dispatch ``name``: ``fn(x [tokens, hidden], router_logits [tokens,
    experts], top_k, w_gate, w_up, w_down) -> [tokens, hidden]`` routes and runs the experts.

    Afterwards ``set_dispatch(model, name)`` makes every MoE layer call it. The built-in
    names cannot be replaced.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"dispatch name {name!r} must be a non-empty string")
    if name in DISPATCH:
        raise ValueError(f"{name!r} is a built-in dispatch; choose another name "
                         f"(built-in: {list(DISPATCH)})")
    if not callable(fn):
        raise ValueError(f"dispatch {name!r} must be callable; got {type(fn).__name__}")
    _ROUTING_DISPATCH[name] = fn


def unregister_dispatch(name: str) -> None:
    """Remove a dispatch added with :func:`register_dispatch` (layers using it must switch first)."""
    if name not in _ROUTING_DISPATCH:
        raise ValueError(f"no registered dispatch {name!r}; registered: {list(_ROUTING_DISPATCH)}")
    del _ROUTING_DISPATCH[name]


class SparseMoE(nn.Module):
    """Router + E stacked SwiGLU experts; ``dispatch`` names the strategy (see ``DISPATCH``).

    forward: x [..., hidden] -> [..., hidden]. After each call ``last_routing`` holds
    (weights [tokens, k], experts [tokens, k]) and ``last_router_logits`` [tokens, experts],
    which :mod:`llmlab.layers.moe_stats` turns into load histograms and losses.
    """

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
        self.last_router_logits: torch.Tensor | None = None

    @property
    def dispatch(self) -> str:
        return self._dispatch

    @dispatch.setter
    def dispatch(self, name: str) -> None:
        _check_name(name)
        self._dispatch = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        weights, experts = route(logits, self.top_k)
        self.last_routing = (weights.detach(), experts.detach())
        self.last_router_logits = logits.detach()
        if self._dispatch in DISPATCH:
            out = DISPATCH[self._dispatch](flat, weights, experts, self.w_gate, self.w_up, self.w_down)
        else:  # a registered dispatch routes for itself from the raw logits
            fn = _ROUTING_DISPATCH.get(self._dispatch)
            if fn is None:
                raise ValueError(f"MoE dispatch {self._dispatch!r} was unregistered; allowed: "
                                 f"{available_dispatches()}")
            out = fn(flat, logits, self.top_k, self.w_gate, self.w_up, self.w_down)
        return out.reshape(shape)


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The SparseMoE blocks of a model, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def set_dispatch(model: nn.Module, name: str) -> nn.Module:
    """Switch every MoE layer of ``model`` to dispatch strategy ``name``; returns the model."""
    _check_name(name)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("this model has no MoE layers (a dense model: nothing to dispatch); "
                         "try load_model('tiny-mixtral') or load_model('smollm2-135m-moe8')")
    for layer in layers:
        layer.dispatch = name
    return model
