"""Greedy generation that every tensor-parallel rank runs in lockstep.

All ranks feed the same tokens through their shard of the model; the parallel layers
exchange partial results, and after the LM head's all-gather every rank holds the same
logits. Rank 0's choice of the next token is broadcast anyway, so the ranks can never
drift apart (it also makes sampling safe to add). A minimal growing KV cache keeps each
rank's own KV heads, so decode steps cost one token's work. Taught in notebook 07.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..device import sync


class GrowingKVCache:
    """Per-layer K/V concatenated step by step: the simplest cache that serves
    ``Attention.forward``'s ``cache.attend(layer_idx, q, k, v, backend)`` call.

    Stores k, v [batch, seq_so_far, kv_heads_on_this_rank, head_dim] per layer.
    """

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend):
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k], dim=1)
            v = torch.cat([self.v[layer_idx], v], dim=1)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return backend.forward(q, k, v, causal=True)

    @property
    def seq_len(self) -> int:
        return next(iter(self.k.values())).shape[1] if self.k else 0


@dataclass
class LockstepGeneration:
    """What :func:`greedy_generate` produced; times are rank 0's wall clock."""
    tokens: list[int]
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)  # one per decode step

    @property
    def s_per_token(self) -> float:
        """Median decode-step time (seconds per output token after the first)."""
        s = sorted(self.decode_s)
        return s[len(s) // 2] if s else float("nan")


def _agree(token: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(token, src=0)
    return token


@torch.inference_mode()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> LockstepGeneration:
    """Greedy tokens for one prompt, with a KV cache; every rank must call it with the same args."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    dev = model.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    cache = GrowingKVCache()
    sync(dev)
    t0 = time.perf_counter()
    pos = torch.arange(ids.shape[1], device=dev)[None]
    logits = model(ids, positions=pos, cache=cache, last_only=True)[:, -1]
    nxt = _agree(logits.argmax(-1))
    sync(dev)
    out = LockstepGeneration(tokens=[int(nxt)], prefill_s=time.perf_counter() - t0)
    n = ids.shape[1]
    while len(out.tokens) < max_new_tokens and out.tokens[-1] != eos_token_id:
        t = time.perf_counter()
        logits = model(nxt[:, None], positions=torch.tensor([[n]], device=dev), cache=cache)[:, -1]
        nxt = _agree(logits.argmax(-1))
        out.tokens.append(int(nxt))  # .item() waits for the device: honest step times
        out.decode_s.append(time.perf_counter() - t)
        n += 1
    return out
