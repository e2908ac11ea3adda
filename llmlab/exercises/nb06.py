"""Check functions for the exercises of notebook 06 (mixture of experts)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from . import say
from ..layers.moe_stats import MIXTRAL_8X7B, expert_capacity


def _call(fn, *args):
    """Run the student's function; returns (result, error message or None)."""
    if fn is None or fn is ...:
        return None, "fill in the function first"
    try:
        return fn(*args), None
    except Exception as exc:  # the student's code raised
        return None, f"your function raised {type(exc).__name__}: {exc}"


def check_active_params(fn) -> bool:
    """``fn(config) -> int``: parameters one token uses (embeddings, attention, norms, the
    router and top-k experts), as ``ModelConfig.num_parameters(active=True)`` counts them."""
    import dataclasses

    configs = [MIXTRAL_8X7B,
               dataclasses.replace(MIXTRAL_8X7B, num_experts=16, num_experts_per_tok=4),
               ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                           num_experts=8, num_experts_per_tok=2, model_type="mixtral")]
    for c in configs:
        got, err = _call(fn, c)
        if err:
            return say(False, "", err)
        want = c.num_parameters(active=True)
        if got is None or not isinstance(got, (int, float)):
            return say(False, "", "return a number of parameters (an int)")
        if abs(got - want) > 1e-3 * want:
            return say(False, "", f"for {c.num_experts} experts, top-{c.num_experts_per_tok}, "
                                   f"hidden {c.hidden_size}: got {got:,.0f}, expected {want:,}. Hint: "
                                   "per layer q,k,v,o + k experts × 3·hidden·intermediate + the "
                                   "router (hidden·E) + 2 norms; then embedding(s) and the final norm")
    m = MIXTRAL_8X7B
    return say(True, f"Mixtral 8x7B uses {m.num_parameters(active=True) / 1e9:.1f}B of "
                      f"{m.num_parameters() / 1e9:.1f}B parameters per token", "")


def check_capacity(fn) -> bool:
    """``fn(tokens, num_experts, top_k, capacity_factor) -> int`` slots per expert."""
    cases = [(512, 8, 2, 1.0), (512, 8, 2, 1.25), (100, 8, 2, 1.0), (7, 4, 1, 2.0), (4096, 64, 6, 1.1)]
    for case in cases:
        got, err = _call(fn, *case)
        if err:
            return say(False, "", err)
        want = expert_capacity(*case)
        if got != want:
            return say(False, "", f"capacity{case} = {got}, expected {want}. Hint: a perfectly "
                                   "balanced expert gets tokens·top_k/num_experts assignments; the "
                                   "capacity factor scales that, rounded up (math.ceil)")
    return say(True, "512 tokens, 8 experts, top-2 at cf 1.25: 160 slots per expert", "")


def check_group_by_expert(fn) -> bool:
    """``fn(experts [tokens, k], num_experts) -> (order, offsets)``: a permutation of the
    flattened pairs that sorts them by expert, and offsets [num_experts + 1]."""
    g = torch.Generator().manual_seed(6)
    cases = [torch.tensor([[3, 0], [0, 1], [3, 1], [2, 0]]),
             torch.randint(0, 6, (37, 2), generator=g)]
    cases[1][cases[1] == 4] = 5  # expert 4 is empty
    for experts in cases:
        got, err = _call(fn, experts, 6)
        if err:
            return say(False, "", err)
        if not isinstance(got, tuple) or len(got) != 2 or not all(torch.is_tensor(t) for t in got):
            return say(False, "", "return a tuple of two tensors: (order, offsets)")
        order, offsets = got
        flat = experts.reshape(-1)
        if sorted(order.tolist()) != list(range(flat.numel())):
            return say(False, "", "order must be a permutation of 0..tokens·k-1 (the flattened pairs)")
        sorted_ids = flat[order]
        if not bool((sorted_ids[1:] >= sorted_ids[:-1]).all()):
            return say(False, "", "experts.reshape(-1)[order] is not sorted. Hint: torch.argsort")
        want = [0] + torch.cumsum(torch.bincount(flat, minlength=6), 0).tolist()
        if offsets.tolist() != want:
            return say(False, "", f"offsets {offsets.tolist()} should be {want} (expert e owns "
                                   "rows offsets[e]:offsets[e+1]; count with torch.bincount(..., "
                                   "minlength=num_experts), then a cumulative sum with a leading 0)")
    return say(True, "each expert's rows are now one contiguous slice: one GEMM per expert", "")
