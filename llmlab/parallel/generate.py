"""Greedy generation that every tensor-parallel rank runs in lockstep.

All ranks feed the same tokens through their shard of the model; the parallel layers
exchange partial results, and after the LM head's all-gather every rank holds the same
logits. Rank 0's choice of the next token is broadcast anyway, so the ranks can never
drift apart (it also makes sampling safe to add). The loop is ``llmlab.generate``'s own
(:func:`llmlab.generate.generate_token_ids`) over a contiguous KV cache that holds this
rank's KV heads, so a decode step costs one token's work and a prompt stops exactly
where it would in one process. Taught in notebook 07.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..generate import generate_token_ids
from ..prompts import check_token_ids


@dataclass
class LockstepGeneration:
    """What :func:`greedy_generate` produced for one prompt; times are rank 0's wall clock."""
    tokens: list[int]
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)  # one per decode step
    finish_reason: str | None = None                      # "stop" or "length"

    @property
    def s_per_token(self) -> float:
        """Median decode-step time (seconds per output token after the first)."""
        s = sorted(self.decode_s)
        return s[len(s) // 2] if s else float("nan")


def agree_on_tokens(tokens: list[int], device=None) -> list[int]:
    """Every rank takes rank 0's tokens (a no-op without a process group of two or more)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return tokens
    t = torch.tensor(tokens, dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return t.tolist()


def greedy_generate(model, prompt_ids: list[int] | list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None = None
                    ) -> LockstepGeneration | list[LockstepGeneration]:
    """Greedy tokens for one prompt (token ids), or for a batch of them (returns a list);
    every rank must call it with the same arguments. Each prompt of a batch gets the tokens
    it would get alone: up to ``max_new_tokens``, ``eos_token_id`` or the context's end."""
    single = bool(prompt_ids) and all(isinstance(t, int) for t in prompt_ids)
    batch = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]
    if not batch or not all(batch):
        raise ValueError("prompt_ids is empty (or holds an empty prompt)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    # every rank checks before any collective, so a bad id fails all ranks alike instead
    # of one embedding shard raising while the other ranks wait in an all-reduce
    for p in batch:
        check_token_ids(p, model.config.vocab_size)
    runs = generate_token_ids(model, batch, max_new_tokens, eos_token_id=eos_token_id,
                              pad_token_id=0 if eos_token_id is None else eos_token_id,
                              kv_cache="contiguous",
                              agree=lambda toks: agree_on_tokens(toks, model.device))
    out = [LockstepGeneration(tokens=r.token_ids, prefill_s=r.times_s[0],
                              decode_s=[b - a for a, b in zip(r.times_s, r.times_s[1:])],
                              finish_reason=r.finish_reason) for r in runs]
    return out[0] if single else out


def greedy_on_ranks(model_name: str, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None = None, attention: str = "sdpa") -> list[list[int]]:
    """Run under :func:`llmlab.parallel.launch`: load this rank's shard, generate greedily
    for the batch ``prompts``, then for each prompt alone; -> [batched tokens per prompt]
    followed by [alone tokens per prompt]."""
    from .group import current
    from .loader import load_tp_model

    model = load_tp_model(model_name, attention=attention, device=current().device)
    batched = greedy_generate(model, prompts, max_new_tokens, eos_token_id)
    alone = [greedy_generate(model, p, max_new_tokens, eos_token_id) for p in prompts]
    return [g.tokens for g in batched] + [g.tokens for g in alone]
