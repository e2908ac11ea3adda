"""Turn logits into next tokens: greedy, temperature, top-k, top-p (nucleus), seeded;
repetition penalties before sampling, log-probabilities after.

``temperature=0`` means greedy (argmax), as in vLLM's SamplingParams. One validator,
:func:`check_sampling_args`, serves both ``llmlab.generate`` and the engine's
``SamplingParams``, so the two accept and refuse exactly the same values
(:func:`check_penalties` is the part of it that checks the penalties).

Penalties (:func:`apply_penalties`), as the OpenAI API and vLLM define them:

* ``presence_penalty`` and ``frequency_penalty`` (OpenAI, each in [-2, 2]) lower the
  logit of every token already *generated*: ``logit -= presence * [count > 0] +
  frequency * count`` (ranges: https://platform.openai.com/docs/api-reference/chat/create;
  formula: https://platform.openai.com/docs/api-reference/parameter-details);
* ``repetition_penalty`` (> 0, 1 is off) is the CTRL penalty of Keskar et al. 2019
  (https://arxiv.org/abs/1909.05858) in the form HF transformers and vLLM use: for every
  token of the prompt *or* the output, a positive logit is divided by it and a negative
  one multiplied (a penalty > 1 always makes the token less likely).

vLLM applies them in the order repetition, frequency, presence
(``apply_penalties`` in vllm/model_executor/layers/utils.py,
https://docs.vllm.ai/en/latest/api/vllm/model_executor/layers/utils/); so does llmlab.

Log-probabilities (:func:`processed_logprobs`) are those of the distribution the sampler
draws from: after the penalties and the temperature, before the top-k / top-p cut (which
would report -inf for the tokens it removes). vLLM V0 reported these; vLLM V1 reports
the raw model distribution by default and these with ``--logprobs-mode
processed_logprobs`` (https://docs.vllm.ai/en/latest/usage/v1_guide.html#logprobs).

A leaf module: it imports nothing from llmlab. Taught in notebooks 00 and 01.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Mapping, Sequence

import torch

MAX_LOGPROBS = 20          # the OpenAI API's top_logprobs limit, vLLM's default max_logprobs
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1     # a seed is a 64-bit signed int (as in vLLM's API)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_sampling_args(temperature: float, top_k: int | None = None,
                        top_p: float | None = None, max_tokens: int | None = None,
                        seed: int | None = None, *,
                        max_tokens_name: str = "max_tokens", presence_penalty: float = 0.0,
                        frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                        logprobs: int | None = None) -> None:
    """Raise ValueError naming the first bad argument and what is allowed.

    ``temperature``: a finite number >= 0 (0 is greedy; NaN and infinity are refused).
    ``top_k``: an int >= 1, or None, 0 or -1 (no top-k filter; vLLM takes both 0 and -1).
    ``top_p``: a number in (0, 1], or None (no top-p filter; 1.0 keeps every token too).
    ``max_tokens``: an int >= 1 (None skips the check); ``max_tokens_name`` is the name
    the caller's API gives it (``generate`` calls it ``max_new_tokens``).
    ``seed``: None or an int in ``SEED_MIN..SEED_MAX`` (64 bits, signed).
    The penalties: see :func:`check_penalties`. ``logprobs``: None, or an int in
    0..20, how many of the most likely tokens to report besides the chosen one.
    """
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 "
                         "(0 means greedy)")
    if top_k is not None and not (_is_int(top_k) and top_k >= -1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1, or None / 0 / -1 (no top-k "
                         "filter)")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be in (0, 1], or None (no top-p filter)")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f"{max_tokens_name}={max_tokens!r} must be an int >= 1")
    if seed is not None and not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed={seed!r} must be an int or None; an int in [-2**63, 2**63 - 1] "
                         "(64 bits, signed)")
    check_penalties(presence_penalty, frequency_penalty, repetition_penalty)
    if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs={logprobs!r} must be None or an int in 0..{MAX_LOGPROBS}")


def check_penalties(presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    repetition_penalty: float = 1.0) -> None:
    """Raise ValueError naming the first bad penalty and its allowed range.

    ``presence_penalty`` and ``frequency_penalty``: numbers in [-2, 2], 0 is off (the
    OpenAI API's range). ``repetition_penalty``: a finite number > 0, 1 is off.
    """
    for name, v in (("presence_penalty", presence_penalty),
                    ("frequency_penalty", frequency_penalty)):
        if not _is_number(v) or not -2 <= v <= 2:
            raise ValueError(f"{name}={v!r} must be a number in [-2, 2] (0 is off)")
    if (not _is_number(repetition_penalty) or not math.isfinite(repetition_penalty)
            or repetition_penalty <= 0):
        raise ValueError(f"repetition_penalty={repetition_penalty!r} must be a finite number "
                         "> 0 (1 is off)")


def has_penalties(presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float = 1.0) -> bool:
    """Whether these values change any logit (off: 0, 0 and 1)."""
    return presence_penalty != 0 or frequency_penalty != 0 or repetition_penalty != 1


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int] | Mapping[int, int]],
                    presence_penalty: float | Sequence[float] = 0.0,
                    frequency_penalty: float | Sequence[float] = 0.0,
                    repetition_penalty: float | Sequence[float] = 1.0) -> torch.Tensor:
    """Penalised logits [batch, vocab], a new tensor (see the module docstring).

    ``prompt_ids`` / ``output_ids``: per row, the prompt's tokens (or their set) and the
    tokens generated so far (or their counts, ``{token: count}``: a caller that keeps
    them up to date pays per step for the distinct tokens, not for the whole output). Each penalty is one number for every row, or one per row. Per row, in vLLM's
    order: ``repetition_penalty`` r on every token seen in the prompt or the output
    (logit / r where the logit is > 0, logit * r elsewhere); then ``logit -= frequency *
    count + presence * [count > 0]``, counting the *output* tokens only.
    """
    rows = logits.shape[0]
    pres, freq, rep = ([float(v)] * rows if _is_number(v) else [float(x) for x in v]
                       for v in (presence_penalty, frequency_penalty, repetition_penalty))
    logits, dev = logits.clone(), logits.device
    for r in range(rows):          # touches only the tokens a row has seen: O(seen), not O(vocab)
        out = output_ids[r]
        counts = out if isinstance(out, Mapping) else Counter(int(t) for t in out)
        if rep[r] != 1:
            seen = torch.tensor(sorted({int(t) for t in prompt_ids[r]} | set(counts)),
                                dtype=torch.long, device=dev)
            x = logits[r, seen]
            logits[r, seen] = torch.where(x > 0, x / rep[r], x * rep[r])
        if counts and (pres[r] or freq[r]):
            ids = torch.tensor(list(counts), dtype=torch.long, device=dev)
            c = torch.tensor(list(counts.values()), dtype=logits.dtype, device=dev)
            logits[r, ids] -= freq[r] * c + pres[r]
    return logits


def processed_logprobs(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """float32 log-softmax of each row of ``logits`` [batch, vocab] at its temperature.

    The distribution the sampler draws from, before its top-k / top-p cut: the logits
    (penalised already) divided by the temperature; a greedy row (temperature 0) is taken
    at temperature 1, the model's own distribution.
    """
    t = torch.tensor([x if x > 0 else 1.0 for x in temperatures], dtype=torch.float32)
    return torch.log_softmax(logits.float() / t.to(logits.device)[:, None], dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int]) -> list[dict[int, float]]:
    """Per row of ``logprobs`` [batch, vocab]: ``{token id: logprob}`` of the row's
    ``num_top[row]`` most likely tokens and of its chosen token ``token_ids[row]`` (so
    ``num_top`` or ``num_top + 1`` entries; the chosen one is ``out[row][token_ids[row]]``),
    the shape of vLLM's ``SampleLogprobs`` entries."""
    k = max(num_top, default=0)
    top = torch.topk(logprobs, k, dim=-1) if k else None
    index = torch.tensor([int(t) for t in token_ids], device=logprobs.device)[:, None]
    chosen = logprobs.gather(-1, index)[:, 0].tolist()
    out = []
    for r, (tok, n) in enumerate(zip(token_ids, num_top)):
        d = dict(zip(top.indices[r, :n].tolist(), top.values[r, :n].tolist())) if n else {}
        d[int(tok)] = chosen[r]
        out.append(d)
    return out


def filter_logits(logits: torch.Tensor, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Set logits outside the top-k / the top-p nucleus to -inf. logits [batch, vocab].

    ``top_k`` None, 0 or -1 and ``top_p`` None or 1.0 leave the logits as they are."""
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
    scaled = logits.float() / temperature
    if not bool(torch.isfinite(scaled).all()):
        # a tiny temperature or an extreme penalty overflowed float32 (softmax would give
        # NaN, and multinomial raise): measure from the row's largest logit first, so the
        # most likely token keeps the mass (a temperature near 0 is near greedy); NaN
        # counts as the lowest logit. Finite rows never come here: unchanged, bit for bit.
        f32 = torch.finfo(torch.float32)
        x = torch.nan_to_num(logits.float(), nan=-f32.max, posinf=f32.max, neginf=-f32.max)
        scaled = (x - x.max(dim=-1, keepdim=True).values) / max(temperature, f32.tiny)
    logits = filter_logits(scaled, top_k, top_p)
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


__all__ = ["MAX_LOGPROBS", "SEED_MIN", "SEED_MAX", "check_sampling_args", "check_penalties", "has_penalties",
           "apply_penalties", "filter_logits", "sample", "sample_rows", "processed_logprobs",
           "token_logprobs"]
