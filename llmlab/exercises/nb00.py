"""Exercises of notebook 00 (setup and tour): sampling from the next-token distribution.

- ``nb00.apply_temperature`` (compute): the probabilities the sampler draws from.
- ``nb00.predict_temperature`` (predict): what halving the temperature does to the top token.
- ``nb00.explain_weights`` (explain): what dequantized Q4_1 weights mean for a comparison
  with the hub's bfloat16 checkpoint.
- ``nb00.top_p_filter`` (stretch): the nucleus (top-p) cut, checked against llmlab's sampler.
"""
from __future__ import annotations

import functools

import torch

from . import Verdict, choice_verdict, compare_tensors, exercise, right, wrong

NOTEBOOK = "00_setup_and_tour"
# The prompt of notebook 00's sampling plot: a plain completion whose likely next tokens
# are colour words (the chat template makes this small model open with "The" or "A").
COLOUR_PROMPT = "She painted the door a bright shade of"


# ---- apply_temperature -----------------------------------------------------------------------

def _solution_apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def _temperature_times(logits, temperature):
    return torch.softmax(logits * temperature, dim=-1)


def _temperature_forgets_softmax(logits, temperature):
    return logits / temperature


@exercise("nb00.apply_temperature", notebook=NOTEBOOK, kind="compute",
          title="apply_temperature(logits, temperature): the probabilities the sampler draws from",
          solution=_solution_apply_temperature,
          wrong_variants={"multiplies by the temperature": (_temperature_times, ("divide",)),
                          "no softmax": (_temperature_forgets_softmax, ("sum to 1",))})
def _check_apply_temperature(fn, **_) -> Verdict:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 3.0, -2.0, 1.0]])
    for t in (0.5, 1.0, 2.0):
        got = fn(logits, t)
        want = torch.softmax(logits / t, dim=-1)
        if isinstance(got, torch.Tensor) and got.shape == want.shape:
            sums = got.double().sum(-1)
            if not torch.allclose(sums, torch.ones_like(sums), atol=1e-5):
                return wrong(f"at temperature {t} your rows sum to {sums.tolist()}: they are not "
                             "probabilities, which must sum to 1.",
                             "turn the scaled logits into probabilities with torch.softmax(x, dim=-1).")
            if t != 1.0 and torch.allclose(got, torch.softmax(logits * t, -1), atol=1e-6):
                return wrong(f"at temperature {t} you get softmax(logits · {t}): a temperature "
                             "below 1 should sharpen the distribution, yours flattens it.",
                             "divide the logits by the temperature.")
        problem = compare_tensors(got, want, f"the probabilities at temperature {t}", atol=1e-6)
        if problem:
            return wrong(problem, "softmax(logits / temperature) along the last axis.")
    return right("softmax(logits / T): T < 1 sharpens the distribution toward the most likely "
                 "token, T > 1 flattens it, and T → 0 becomes greedy (argmax).")


# ---- predict: halving the temperature ----------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _top_probabilities(prompt: str = COLOUR_PROMPT) -> tuple[float, float]:
    """The most likely next token's probability after ``prompt`` at temperature 1 and 0.5."""
    from .nb01 import smollm2

    model, tok = smollm2()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.inference_mode():
        logits = model(ids, last_only=True)[0, -1].float()
    return (float(torch.softmax(logits, -1).max()), float(torch.softmax(logits / 0.5, -1).max()))


@exercise("nb00.predict_temperature", notebook=NOTEBOOK, kind="predict",
          title="predict: temperature 1.0 → 0.5, what happens to the top token's probability?",
          solution="a",
          wrong_variants={"falls": ("b", ("fall", "measured")),
                          "unchanged": ("c", ("measured",))})
def _check_predict_temperature(answer, p_at_1: float | None = None,
                               p_at_half: float | None = None, **_):
    if p_at_1 is None or p_at_half is None:
        p_at_1, p_at_half = _top_probabilities()
    measured = (f"Measured: {p_at_1:.3f} at temperature 1.0, {p_at_half:.3f} at 0.5 "
                f"({p_at_half / p_at_1:.2f}×).")
    verdict = choice_verdict(answer, "a", {
        "a": "It rises. Dividing the logits by 0.5 doubles every gap between them, and softmax "
             "turns a gap Δ into a probability ratio e^Δ: the top token's lead over each "
             "rival is squared.",
        "b": "A lower temperature would make it fall only if it flattened the distribution; "
             "dividing by 0.5 doubles the gaps between logits, which sharpens it.",
        "c": "Softmax is not scale-invariant: doubling the logits changes the probabilities.",
        "d": "It approaches 1 only as the temperature goes to 0 (greedy); at 0.5 the rivals "
             "keep some probability.",
    })
    return Verdict(verdict.passed, f"{verdict.message} {measured}")


# ---- explain: dequantized Q4_1 weights ----------------------------------------------------------

_WEIGHTS_CHOICES = {
    "a": "llmlab's decoder has a bug: two correct implementations of one architecture give the "
         "same greedy tokens",
    "b": "bfloat16's rounding explains it: the hub's checkpoint cast to float32 would give "
         "llmlab's tokens",
    "c": "nothing about llmlab yet: the two runs use different weights, so the oracle must load "
         "ours",
    "d": "llmlab's float32 copy rounds the 4-bit values a second time, and that second rounding "
         "is the gap",
}
_WEIGHTS_EXPLANATIONS = {
    "a": "the two runs are not the same model: llmlab's weights are the hub's after a 4-bit Q4_1 "
         "round trip, so the logits differ by the quantization error, and greedy decoding picks "
         "another token wherever two were close. A bug shows only against a reference that "
         "loads the same weights.",
    "b": "bfloat16 keeps about 3 significant digits, moving a weight by under 0.4%; Q4_1 puts "
         "each block of 32 weights on 16 levels between its minimum and maximum, an error of "
         "up to half a step, far larger. Cast to float32, the hub's checkpoint still lacks that "
         "rounding.",
    "c": "our float32 weights are exactly the dequantized Q4_1 values, so llmlab is compared "
         "with HF transformers loading these same weights (they agree to ~1e-5), while the "
         "hub's bfloat16 checkpoint gives slightly different logits and can pick other "
         "tokens; the 4-bit rounding happened once, at conversion.",
    "d": "float32 holds every dequantized Q4_1 value exactly (a 4-bit code times an fp16 "
         "scale plus an fp16 minimum), so storing them in float32 loses nothing further.",
}


@exercise("nb00.explain_weights", notebook=NOTEBOOK, kind="explain",
          title="explain: suppose the hub's bfloat16 SmolLM2, run in transformers, and llmlab "
                "part ways after a dozen greedy tokens on one prompt. What does that tell you?",
          solution="c", choices=_WEIGHTS_CHOICES,
          wrong_variants={"a bug": ("a", ("same weights",)),
                          "bfloat16 rounding": ("b", ("16 levels",)),
                          "a second rounding": ("d", ("exactly",))})
def _check_explain_weights(answer, **_):
    return choice_verdict(answer, "c", _WEIGHTS_EXPLANATIONS)


# ---- stretch: top-p ---------------------------------------------------------------------------

def _solution_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before > top_p)
    return logits.masked_fill(drop, float("-inf"))


def _top_p_drops_crossing_token(logits, top_p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = torch.softmax(sorted_logits, -1).cumsum(-1)
    drop = torch.zeros_like(cum, dtype=torch.bool).scatter(-1, order, cum > top_p)
    return logits.masked_fill(drop, float("-inf"))


def _top_p_ascending(logits, top_p):
    sorted_logits, order = torch.sort(logits, dim=-1)
    probs = torch.softmax(sorted_logits, -1)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order,
                                                             probs.cumsum(-1) - probs > top_p)
    return logits.masked_fill(drop, float("-inf"))


@exercise("nb00.top_p_filter", notebook=NOTEBOOK, kind="build", stretch=True,
          title="stretch: top_p_filter(logits, top_p), the nucleus cut of the sampler",
          solution=_solution_top_p,
          wrong_variants={"drops the token that crosses p": (_top_p_drops_crossing_token,
                                                             ("crosses",)),
                          "keeps the least likely tokens": (_top_p_ascending, ("least likely",))})
def _check_top_p(fn, **_):
    from ..sampling import filter_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for p in (0.9, 0.5, 0.05):
        got = fn(logits.clone(), p)
        want = filter_logits(logits, top_p=p)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return wrong(f"expected logits of shape {tuple(want.shape)}, got {shape}.",
                         "return the logits with the dropped tokens set to -inf.")
        kept, want_kept = torch.isfinite(got), torch.isfinite(want)
        if not torch.equal(kept, want_kept):
            row = int((kept != want_kept).any(-1).nonzero()[0])
            n, n_want = int(kept[row].sum()), int(want_kept[row].sum())
            order = torch.argsort(logits[row], descending=True)
            if n == 0:
                problem = f"at top_p={p} row {row} keeps no token at all."
            elif n < n_want and torch.equal(kept[row][order][:n], want_kept[row][order][:n]):
                problem = (f"at top_p={p} row {row} keeps {n} tokens, the nucleus has {n_want}: "
                           "you drop the token whose probability crosses p, so the kept mass "
                           "is below p.")
            elif bool(kept[row][order[-1]]) and not bool(want_kept[row][order[-1]]):
                problem = (f"at top_p={p} row {row} keeps the least likely tokens: the nucleus "
                           "is built from the most likely token down.")
            else:
                problem = f"at top_p={p} row {row} keeps {n} tokens, the nucleus has {n_want}."
            return wrong(problem, "sort descending, keep every token whose probability mass "
                                  "*before* it is at most p (so the most likely token always stays).")
        problem = compare_tensors(got[kept], want[want_kept], f"the kept logits at top_p={p}", 1e-6)
        if problem:
            return wrong(problem, "leave the kept logits unchanged; only set the dropped ones to -inf.")
    return right("the nucleus is the smallest set of most likely tokens whose mass reaches p; "
                 "it adapts to the distribution, where top-k keeps a fixed count.")
