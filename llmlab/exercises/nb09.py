"""The exercises of notebook 09 (speculative decoding).

- ``nb09.accept_reject`` (build): the accept/reject step of speculative sampling, for one
  sequence. The checker tries it on hand-made one-hot cases, then draws 6,000 times from a
  5-token target/draft pair whose answer is known (chi-square tests), then runs it inside
  real speculative generation of SmolLM2 (n-gram drafts, greedy) and compares the tokens
  with plain greedy decoding.
- ``nb09.predict_best_k`` (predict): which number of drafts k gives the best speedup.
- ``nb09.explain_batching`` (explain): why batching erodes the gain.
- ``nb09.explain_int4_draft`` (explain, stretch): what an int4 draft of a Q4_1 model buys.

The student's function, for one sequence with k drafts::

    accept_reject(p, q, drafts, generator=None) -> list[int]

p [k+1, vocab]: the target's distribution at each drafted position and one past the last;
q [k, vocab]: the distribution each draft was sampled from; drafts: k token ids. It returns
the tokens the step emits: the accepted prefix of ``drafts``, then one token of the target's
(drawn from the normalized (p − q)⁺ at the first rejection, or from p[k] when all k were
accepted: the bonus). :func:`as_library_rule` turns it into the library's
:func:`llmlab.speculative.accept_reject` signature, for ``SpeculativeConfig(accept_fn=...)``.
"""
from __future__ import annotations

import functools

import torch

from . import choice_verdict, exercise, first_token_difference, right, wrong
from ..speculative import cost_model_speedup, expected_tokens

NB = "09_speculative_decoding"
DRAWS = 6_000             # draws of the distribution test: the wrong rules miss by > 20 sigma
P_VALUE = 1e-4            # a correct rule fails a test with this probability
GREEDY_PROMPT = ("Correct the spelling mistakes in this text and return the corrected text only: "
                 "Yesterday I went to the libary to borow a book about the histroy of Rome. The "
                 "librarian was very helpfull and showed me were the books were.")
GREEDY_TOKENS = 32


class RuleError(ValueError):
    """The student's rule returned something a step cannot emit."""


# ---- the reference and realistic mistakes -------------------------------------------------

def reference_accept_reject(p, q, drafts, generator=None) -> list[int]:
    """Accept draft i with probability min(1, p_i(d)/q_i(d)); at the first rejection emit
    a token from the normalized (p_i − q_i)⁺ and stop; after k acceptances a bonus from p_k."""
    out = []
    for i, d in enumerate(drafts):
        if torch.rand((), generator=generator) * q[i, d] < p[i, d]:    # u < p/q, no division
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


def _always_accepts(p, q, drafts, generator=None):
    return list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


def _accepts_with_p(p, q, drafts, generator=None):
    out = []
    for i, d in enumerate(drafts):
        if torch.rand((), generator=generator) < p[i, d]:             # forgets q
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    return out + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


def _resamples_from_p(p, q, drafts, generator=None):
    out = []
    for i, d in enumerate(drafts):
        if torch.rand((), generator=generator) * q[i, d] < p[i, d]:
            out.append(d)
            continue
        return out + [int(torch.multinomial(p[i], 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


def _forgets_the_bonus(p, q, drafts, generator=None):
    out = reference_accept_reject(p, q, drafts, generator)
    return out[:len(drafts)]


def _off_by_one(p, q, drafts, generator=None):
    out = []
    for i, d in enumerate(drafts):
        out.append(d)                                 # appended before the test
        if torch.rand((), generator=generator) * q[i, d] < p[i, d]:
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    return out + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


# ---- the checks ---------------------------------------------------------------------------

def as_library_rule(fn):
    """The student's one-sequence ``fn`` as a :func:`llmlab.speculative.accept_reject`
    replacement (rows of a batch one at a time); raises :class:`RuleError` when ``fn``
    returns something no step can emit."""
    def rule(p, q, drafts, generator=None):
        num_accepted, next_token = [], []
        for row in range(drafts.shape[0]):
            ds = drafts[row].tolist()
            out = _emitted(fn(p[row], q[row], ds, generator), ds)
            num_accepted.append(len(out) - 1)
            next_token.append(out[-1])
        return torch.tensor(num_accepted), torch.tensor(next_token)
    return rule


def _emitted(out, drafts: list[int]) -> list[int]:
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or not out:
        raise RuleError(f"your function returned {out!r}; it should return a non-empty list of "
                        "token ids: the accepted drafts, then one more token.")
    out = [int(t) for t in out]
    k = len(drafts)
    if len(out) > k + 1:
        raise RuleError(f"with {k} drafts a step emits at most {k + 1} tokens; yours emitted "
                        f"{len(out)}.")
    n = len(out) - 1
    if out[:n] != drafts[:n]:
        raise RuleError(f"the emitted tokens {out} should start with the accepted drafts "
                        f"{drafts[:n]} (the drafts, in order, up to the first rejection).")
    return out


def _one_hot(rows: list[int], vocab: int = 5) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), vocab).float()


def _check_one_hot_cases(fn):
    """Greedy-like cases where every answer is certain. None, or a failing verdict."""
    g = torch.Generator().manual_seed(0)
    cases = [  # (target argmax per position, drafts, the only right output, what it tests)
        ([1, 2, 3], [4, 2], [1], "a draft the target gives probability 0 must be rejected"),
        ([1, 2, 3], [1, 4], [1, 2], "the first draft is right, the second is not"),
        ([1, 2, 3], [1, 2], [1, 2, 3], "both drafts right: both, then the bonus token"),
    ]
    for argmax, drafts, want, what in cases:
        try:
            got = _emitted(fn(_one_hot(argmax), _one_hot(drafts), list(drafts), g), drafts)
        except RuleError as exc:
            got, err = None, str(exc)
        if got == want:
            continue
        if got is None:
            return wrong(f"p one-hot on {argmax}, q one-hot on the drafts {drafts}: {err}",
                         "return drafts[:n] + [one more token].")
        if len(got) == len(drafts) and got == drafts and len(want) == len(drafts) + 1:
            return wrong(f"all {len(drafts)} drafts were accepted and your function emitted "
                         f"{got}: it forgot the bonus token, drawn from p[k] (here "
                         f"{want[-1]}). A step emits up to k + 1 tokens.",
                         "after the loop over the drafts, append a token sampled from p[k].")
        if len(got) == len(want) + 1 and got[:len(want)] == drafts[:len(want)]:
            return wrong(f"p one-hot on {argmax}, drafts {drafts}: you emitted {got}, the right "
                         f"output is {want}. Your accepted count is off by one: the rejected "
                         "draft was emitted as if accepted.",
                         "append a draft only after its test passed.")
        if drafts[0] == 4 and got[:1] == [4]:
            return wrong(f"p one-hot on {argmax}, drafts {drafts}: you emitted {got}, but the "
                         "target gives draft 4 probability 0, so min(1, p/q) = 0 and it must "
                         "be rejected; the right output is [1].",
                         "accept draft d when u < p(d)/q(d) for u uniform in [0, 1).")
        return wrong(f"p one-hot on {argmax}, q one-hot on the drafts {drafts} ({what}): you "
                     f"emitted {got}, the only right output is {want}.",
                     "with one-hot p and q the rule is greedy verification.")
    return None


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (empty bins dropped)."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    if bool((counts[~keep] > 0).any()):
        return 0.0
    obs, exp = counts[keep].double(), expected[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         stat / 2))


# A 5-token target p and draft q at k = 2 positions, and p's bonus row. Acceptance of a draft
# at position i has probability a_i = sum(min(p_i, q_i)): 0.55 and 0.6 here.
P = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05],
                  [0.10, 0.10, 0.20, 0.30, 0.30],
                  [0.20, 0.20, 0.20, 0.20, 0.20]])
Q = torch.tensor([[0.05, 0.20, 0.15, 0.30, 0.30],
                  [0.10, 0.40, 0.30, 0.10, 0.10]])


def distribution_test(fn, draws: int = DRAWS, seed: int = 0) -> dict:
    """Run ``fn`` on ``draws`` draft pairs sampled from Q; returns the p-values of the
    accepted-count distribution, of the first emitted token (should follow P[0]) and of the
    second (rows that accepted the first draft: should follow P[1]), with the counts."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q, draws, replacement=True, generator=g).T.tolist()
    accepted, first, second = torch.zeros(3), torch.zeros(5), torch.zeros(5)
    for ds in drafts:
        out = _emitted(fn(P, Q, ds, g), ds)
        accepted[len(out) - 1] += 1
        first[out[0]] += 1
        if len(out) >= 2:
            second[out[1]] += 1
    a = torch.minimum(P[:2], Q).sum(-1)
    want_acc = torch.stack([1 - a[0], a[0] * (1 - a[1]), a[0] * a[1]])
    return {"accepted": accepted, "want_accepted": want_acc, "first": first, "second": second,
            "p_accepted": chi2_pvalue(accepted, want_acc),
            "p_first": chi2_pvalue(first, P[0]), "p_second": chi2_pvalue(second, P[1])}


def _fractions(counts: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in (counts / counts.sum()).tolist()) + "]"


def _check_distribution(fn):
    r = distribution_test(fn)
    if r["p_accepted"] < P_VALUE:
        return wrong(f"over {DRAWS:,} steps with k = 2 the share of steps accepting 0, 1, 2 "
                     f"drafts is {_fractions(r['accepted'])}; the rule gives "
                     f"{_fractions(r['want_accepted'])} (chi-square p = {r['p_accepted']:.1e}).",
                     "accept draft d with probability min(1, p(d)/q(d)): draw u uniform in "
                     "[0, 1) and accept when u < p(d)/q(d) (u·q(d) < p(d) avoids dividing).")
    for key, row in (("first", 0), ("second", 1)):
        if r[f"p_{key}"] < P_VALUE:
            return wrong(f"the {key} emitted token should follow the target's p[{row}] = "
                         f"{_fractions(P[row])}; yours follows {_fractions(r[key])} "
                         f"(chi-square p = {r[f'p_{key}']:.1e}, {DRAWS:,} steps). Acceptance is "
                         "right, so the token drawn after a rejection is not.",
                         "on rejection sample from the normalized (p − q)⁺ = max(p − q, 0) / "
                         "its sum, not from p: p's mass on accepted drafts was already given.")
    return None


@functools.lru_cache(maxsize=1)
def _smollm2_and_greedy():
    import llmlab

    model = llmlab.load_model("smollm2-135m", attention="sdpa")
    tok = llmlab.load_tokenizer("smollm2-135m")
    ref = llmlab.generate(model, tok, GREEDY_PROMPT, max_new_tokens=GREEDY_TOKENS,
                          kv_cache="contiguous").token_ids
    return model, tok, ref


def _check_in_generation(fn):
    import llmlab
    from ..speculative import SpeculativeConfig


    model, tok, ref = _smollm2_and_greedy()
    spec = SpeculativeConfig("ngram", num_tokens=4, accept_fn=as_library_rule(fn))
    try:
        g = llmlab.generate(model, tok, GREEDY_PROMPT, max_new_tokens=GREEDY_TOKENS,
                            speculative=spec)
    except RuleError as exc:
        return None, wrong(f"inside SmolLM2's speculative generation: {exc}")
    diff = first_token_difference(g.token_ids, ref)
    if diff:
        return None, wrong(f"SmolLM2, n-gram drafts, greedy (p and q one-hot): {diff} Greedy "
                           "speculation must give plain greedy's tokens.",
                           "with one-hot p and q, accept exactly the drafts equal to the "
                           "target's argmax, then emit the argmax.")
    return g.speculative, None


@exercise("nb09.accept_reject", notebook=NB, kind="build",
          title="the accept/reject step of speculative sampling, inside real generation",
          solution=reference_accept_reject,
          wrong_variants={
              "always accepts": (_always_accepts, ("probability 0",)),
              "accepts with p(d), ignoring q": (_accepts_with_p, ("min(1, p(d)/q(d))",)),
              "resamples from p instead of (p - q)+": (_resamples_from_p, ("(p − q)⁺",)),
              "forgets the bonus token": (_forgets_the_bonus, ("bonus",)),
              "off by one in the accepted count": (_off_by_one, ("off by one",)),
          })
def _check_accept_reject(answer) -> object:
    if not callable(answer):
        return wrong(f"pass your function itself; got {type(answer).__name__}.",
                     "exercises.check('nb09.accept_reject', accept_reject)")
    for check in (_check_one_hot_cases, _check_distribution):
        try:
            bad = check(answer)
        except RuleError as exc:
            bad = wrong(str(exc), "return drafts[:n] + [one more token].")
        if bad is not None:
            return bad
    stats, bad = _check_in_generation(answer)
    if bad is not None:
        return bad
    return right(f"{DRAWS:,} steps on a 5-token pair emit the target's distribution (chi-square "
                 "tests of the accepted count and of the first two tokens pass), and inside "
                 f"SmolLM2's n-gram speculation your rule gives plain greedy's "
                 f"{stats.num_generated} tokens in {stats.target_forwards} target forwards "
                 f"({sum(stats.accepted_per_step)} drafts accepted, "
                 f"{sum(stats.drafted_per_step) - sum(stats.accepted_per_step)} rejected).")


# ---- predict: the best k -----------------------------------------------------------------

K_CHOICES = (1, 2, 4, 8)


@exercise("nb09.predict_best_k", notebook=NB, kind="predict",
          title="predict: which number of drafts k gives the best speedup?",
          solution=4,
          wrong_variants={"one draft": (1, ("rarely",)), "as many as possible": (8, ("α^i",))})
def _check_predict_best_k(answer, measured: dict | None = None, alpha: float = 0.8,
                          c: float = 0.15) -> object:
    """``measured`` {k: speedup}; without it the cost model at ``alpha`` and ``c``."""
    if isinstance(answer, bool) or answer not in K_CHOICES:
        return wrong(f"answer one of k = {K_CHOICES}; got {answer!r}.", "e.g. 4")
    if measured is None:
        speedups = {k: cost_model_speedup(expected_tokens(alpha, k), k, c)
                    for k in K_CHOICES}
        what = f"the cost model at α = {alpha}, c = {c}"
    else:
        speedups = {int(k): float(v) for k, v in measured.items()}
        what = "the measurement"
    if answer not in speedups:
        return wrong(f"k = {answer} was not measured; measured: {sorted(speedups)}.")
    best = max(speedups, key=speedups.get)
    table = ", ".join(f"k={k}: {v:.2f}x" for k, v in sorted(speedups.items()))
    if speedups[answer] >= 0.95 * speedups[best]:
        return right(f"k = {answer} is within 5% of the best ({what}: {table}). The first draft "
                     "is accepted with probability α, the i-th only if all before it were "
                     "(α^i), while every draft and every verified position is paid for.")
    if answer < best:
        return wrong(f"k = {answer}: {speedups[answer]:.2f}x, but k = {best} gives "
                     f"{speedups[best]:.2f}x ({what}: {table}). A draft that is rarely wrong "
                     "and costs little pays for more drafts per step.",
                     "expected tokens per step are (1 − α^(k+1)) / (1 − α).")
    return wrong(f"k = {answer}: {speedups[answer]:.2f}x, but k = {best} gives "
                 f"{speedups[best]:.2f}x ({what}: {table}). Draft i counts only if all drafts "
                 "before it were accepted (probability α^i), but its cost is paid every step.",
                 "compare what the k-th draft adds, α^k tokens, with what it costs.")


# ---- explain: batching -------------------------------------------------------------------

_BATCH_CHOICES = {
    "a": "acceptance does not depend on the batch: each sequence's drafts are checked "
         "against its own target distribution.",
    "b": "at batch 1 a decode step reads every weight for one token per sequence, so k + 1 "
         "tokens cost about the same time; at a large batch the step is already "
         "compute-bound (right of the roofline's ridge), and k + 1 tokens per sequence cost "
         "about k + 1 times as much. The idle FLOPs speculation spent are gone.",
    "c": "rejected drafts are rolled back per sequence; they never touch another sequence's "
         "cache.",
    "d": "greedy speculation gives the same tokens at any batch size; only the time changes.",
}


@exercise("nb09.explain_batching", notebook=NB, kind="explain",
          title="explain: why does batching erode the speedup of speculative decoding?",
          solution="b",
          wrong_variants={"acceptance": ("a", ("does not depend",)),
                          "tokens change": ("d", ("same tokens",))})
def _check_explain_batching(answer) -> object:
    return choice_verdict(answer, "b", _BATCH_CHOICES)


# ---- explain (stretch): an int4 draft of a Q4_1 model --------------------------------------

_INT4_CHOICES = {
    "a": "an int4 draft stores the same 4-bit grid, so it proposes what the target would: "
         "acceptance is close to 100%. But a draft token costs a whole int4 decode step, so c "
         "is that step's cost over the float32 step's (the notebook measures it): well above "
         "0, and E[tokens] / (1 + k·c) stays far below k + 1. And here the draft is the "
         "target itself in fewer bytes: run alone, the int4 model gives the same tokens "
         "(its weights are the target's exactly) at its full speed, with no verify step. A "
         "draft pays when it is much cheaper than the target, not when it is the same model "
         "in fewer bytes.",
    "b": "acceptance is high, not low: the int4 weights reproduce the shipped Q4_1 weights "
         "(notebook 08), so the two models nearly agree.",
    "c": "the rejection rule keeps the target's distribution for any draft; a draft changes "
         "the speed, never the output.",
    "d": "a draft's cost per token is its own decode step; a quantized draft still reads "
         "all its weights once per token.",
}


@exercise("nb09.explain_int4_draft", notebook=NB, kind="explain", stretch=True,
          title="stretch: what does an int4 draft buy when the target is dequantized Q4_1?",
          solution="a",
          wrong_variants={"low acceptance": ("b", ("acceptance is high",)),
                          "changes output": ("c", ("never the output",))})
def _check_explain_int4_draft(answer) -> object:
    return choice_verdict(answer, "a", _INT4_CHOICES)
