"""Prompts in, token ids out: encoding, checking, left padding, and the result record.

Shared by every generation path (``llmlab.generate``, the paged generator, the engine
and the tensor-parallel loop), so that they all accept, refuse and pad prompts the same
way. A leaf module: it imports nothing from llmlab but the sampling validator.
Taught in notebook 01.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import torch

from .sampling import check_sampling_args

if TYPE_CHECKING:  # only for the annotation: keeps this module a leaf
    from .profiling.metrics import RequestMetrics


@dataclass
class Generation:
    """One prompt's result from ``llmlab.generate``."""

    prompt: str
    text: str
    token_ids: list[int]          # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str            # "stop" (end-of-sequence token) or "length"
    metrics: RequestMetrics = field(repr=False, default=None)
    token_times_s: list[float] = field(repr=False, default_factory=list)  # since start, per token


def check_token_ids(token_ids: Iterable[int], vocab_size: int) -> None:
    """Raise ValueError unless every id is an int in ``[0, vocab_size)``.

    An id outside the vocabulary would index past the embedding table: on a CPU that is
    an IndexError deep inside the model, on a GPU a device-side assert that poisons the
    whole CUDA context. Checking up front names the id instead.
    """
    for pos, t in enumerate(token_ids):
        try:
            i = operator.index(t)   # ints, numpy and torch integer scalars; not floats
        except TypeError:
            raise ValueError(f"token id {t!r} at position {pos} is not an int") from None
        if isinstance(t, bool) or not 0 <= i < vocab_size:
            raise ValueError(f"token id {t!r} at position {pos} is out of range for a "
                             f"vocabulary of {vocab_size} tokens (allowed: 0..{vocab_size - 1})")


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt; ``chat`` wraps each as a user turn with the chat template."""
    out = []
    for p in prompts:
        if not isinstance(p, str):
            raise ValueError(f"prompts must be strings; got {type(p).__name__}")
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(p)["input_ids"]
        out.append(list(ids))
    return out


def left_pad(batch: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [batch, max_len] and attention_mask [batch, max_len] (0 on the left pads)."""
    n = max(len(s) for s in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, n - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, n - len(s):] = 1
    return ids.to(device), mask.to(device)


def prepare_prompts(tokenizer, prompts, max_new_tokens: int, temperature: float,
                    top_k: int | None, top_p: float | None, chat: bool,
                    seed: int | None = None, vocab_size: int | None = None):
    """Check the generation arguments; -> (prompt strings, token ids per prompt).

    ``prompts``: a string, a list of strings, or a list of token-id lists (used as they
    are). With ``vocab_size`` every token id is checked to lie in ``[0, vocab_size)``.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    check_sampling_args(temperature, top_k, top_p, max_new_tokens, seed,
                        max_tokens_name="max_new_tokens")
    if all(isinstance(p, (list, tuple)) for p in prompts):
        if not all(prompts):
            raise ValueError("a token-id prompt is empty")
        if vocab_size is not None:
            for p in prompts:
                check_token_ids(p, vocab_size)
        encoded = [[int(t) for t in p] for p in prompts]
        return [tokenizer.decode(p) for p in encoded], encoded
    encoded = encode_prompts(tokenizer, prompts, chat)
    if vocab_size is not None:  # a tokenizer bigger than the model's vocabulary
        for p in encoded:
            check_token_ids(p, vocab_size)
    return prompts, encoded


__all__ = ["Generation", "check_token_ids", "encode_prompts", "left_pad", "prepare_prompts"]
