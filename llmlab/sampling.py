"""Turn logits into next tokens: greedy, temperature, top-k, top-p (nucleus), seeded.

``temperature=0`` means greedy (argmax), as in vLLM's SamplingParams. One validator,
:func:`check_sampling_args`, serves both ``llmlab.generate`` and the engine's
``SamplingParams``, so the two accept and refuse exactly the same values. A leaf module:
it imports nothing from llmlab. Taught in notebooks 00 and 01.
"""
from __future__ import annotations

import math

import torch


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_sampling_args(temperature: float, top_k: int | None = None,
                        top_p: float | None = None, max_tokens: int | None = None,
                        seed: int | None = None, *,
                        max_tokens_name: str = "max_tokens") -> None:
    """Raise ValueError naming the first bad argument and what is allowed.

    ``temperature``: a finite number >= 0 (0 is greedy; NaN and infinity are refused).
    ``top_k``: an int >= 1, or None or -1 (no top-k filter, vLLM's spelling).
    ``top_p``: a number in (0, 1], or None (no top-p filter; 1.0 keeps every token too).
    ``max_tokens``: an int >= 1 (None skips the check); ``max_tokens_name`` is the name
    the caller's API gives it (``generate`` calls it ``max_new_tokens``).
    ``seed``: an int or None.
    """
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 "
                         "(0 means greedy)")
    if top_k is not None and not (_is_int(top_k) and (top_k >= 1 or top_k == -1)):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1, or None / -1 (no top-k filter)")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1], or None (no top-p filter)")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f"{max_tokens_name}={max_tokens!r} must be an int >= 1")
    if seed is not None and not _is_int(seed):
        raise ValueError(f"seed={seed!r} must be an int or None")


def filter_logits(logits: torch.Tensor, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Set logits outside the top-k / the top-p nucleus to -inf. logits [batch, vocab].

    ``top_k`` None or -1 and ``top_p`` None or 1.0 leave the logits as they are."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before > top_p       # never drops the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [batch, vocab] -> token ids [batch]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, temperatures: list[float], top_ks: list[int | None],
                top_ps: list[float | None],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row, each row with its own parameters and random generator.

    logits [batch, vocab]. In a serving batch every sequence belongs to a different
    request, so a row's randomness must come from its own generator: a seeded request
    then samples the same tokens whatever else shares the batch. Greedy rows
    (temperature 0) are taken together with one argmax.
    """
    out = logits.argmax(dim=-1).tolist()
    for i, t in enumerate(temperatures):
        if t > 0:
            out[i] = int(sample(logits[i:i + 1], t, top_ks[i], top_ps[i], generators[i])[0])
    return out


__all__ = ["check_sampling_args", "filter_logits", "sample", "sample_rows"]
