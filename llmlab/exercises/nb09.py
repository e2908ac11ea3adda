"""The exercises of notebook 09 (speculative decoding).

- ``nb09.accept_reject`` (build): the accept/reject step of speculative sampling, for one
  sequence. The checker tries it on hand-made one-hot cases, then draws 6,000 times from a
  5-token target/draft pair whose answer is known (chi-square tests), then runs it inside
  real speculative generation of SmolLM2 (n-gram drafts, greedy) and compares the tokens
  with plain greedy decoding.
- ``nb09.predict_best_k`` (predict): which number of drafts k gives the best speedup.
- ``nb09.speculative_step`` (build): one greedy step, draft, verify in one forward, accept,
  roll the cache back, on SmolLM2's ``CausalLM.step`` and its contiguous KV cache. The
  checker runs it in a real generation (:func:`generate_with_step`) with two drafts (one
  that spoils one token of the target's answer per step, and prompt lookup), counts its
  forwards, reads the cache length after every step and compares the tokens with plain
  greedy decoding; llmlab's own speculative functions raise meanwhile.
- ``nb09.predict_batching_breakeven`` (predict): the smallest batch at which the roofline
  model of speculation is slower than plain decoding, against the notebook's run of the model.
- ``nb09.explain_early_exit`` (explain, stretch): why no early-exit depth pays on SmolLM2.

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
import time

import torch

from . import choice_verdict, exercise, first_token_difference, right, wrong
from ..cache.contiguous import ContiguousKVCache
from ..device import sync
from ..speculative import SpecStats, cost_model_speedup, expected_tokens, ngram_propose

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


# ---- build: one speculative step, inside SmolLM2 --------------------------------------------

STEP_K = 4                # drafts per step in the check of nb09.speculative_step


class StepError(ValueError):
    """The student's step broke the contract of a step; the message says how."""


def reference_speculative_step(model, cache, seq, draft, k):
    """One greedy speculative step: draft, verify in one forward, accept, roll back.

    ``cache`` holds the K/V of ``seq[:-1]``; returns the emitted tokens (the accepted drafts,
    then the target's own token) and leaves the cache holding the K/V of
    ``seq + emitted[:-1]``."""
    drafts = [int(d) for d in draft(seq, k)][:k]
    ids = torch.tensor([[seq[-1]] + drafts], dtype=torch.long, device=model.device)
    start = cache.length
    positions = cache.begin(ids.shape[1])
    logits = model.step(ids, positions, cache)[0]           # [len(drafts) + 1, vocab]
    cache.advance()
    target = logits.argmax(-1).tolist()                     # the target's token after each
    emitted = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            break
        emitted.append(d)
    n = len(emitted)
    emitted.append(target[n])         # the correction at the first mismatch, or the bonus
    cache.truncate(start + n + 1)     # keep t and the accepted drafts; forget the rest
    return emitted


def _forgets_the_roll_back(model, cache, seq, draft, k):
    drafts = [int(d) for d in draft(seq, k)][:k]
    ids = torch.tensor([[seq[-1]] + drafts], dtype=torch.long, device=model.device)
    logits = model.step(ids, cache.begin(ids.shape[1]), cache)[0]
    cache.advance()
    target = logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]                         # the rejected drafts' K/V stay


def _reads_the_next_row(model, cache, seq, draft, k):
    """Off by one: draft i is compared with row i + 1 (it sits at index i + 1 of the input)."""
    drafts = [int(d) for d in draft(seq, k)][:k]
    ids = torch.tensor([[seq[-1]] + drafts], dtype=torch.long, device=model.device)
    start = cache.length
    logits = model.step(ids, cache.begin(ids.shape[1]), cache)[0]
    cache.advance()
    target = logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == target[n + 1]:
        n += 1
    cache.truncate(start + n + 1)
    return drafts[:n] + [target[min(n + 1, len(drafts))]]


def _forgets_the_bonus(model, cache, seq, draft, k):
    """Feeds [t, d1 .. d(k-1)]: enough rows to check every draft, none for the bonus."""
    drafts = [int(d) for d in draft(seq, k)][:k]
    ids = torch.tensor([[seq[-1]] + drafts[:-1]], dtype=torch.long, device=model.device)
    start = cache.length
    logits = model.step(ids, cache.begin(ids.shape[1]), cache)[0]
    cache.advance()
    target = logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    cache.truncate(start + min(n + 1, len(target)))
    return drafts[:n] + ([target[n]] if n < len(drafts) else [])


def _one_token_per_forward(model, cache, seq, draft, k):
    drafts = [int(d) for d in draft(seq, k)][:k]
    emitted = []
    for i, tok in enumerate([seq[-1]] + drafts):            # one forward per verified token
        ids = torch.tensor([[tok]], dtype=torch.long, device=model.device)
        nxt = int(model.step(ids, cache.begin(1), cache)[0, -1].argmax())
        cache.advance()
        emitted.append(nxt)
        if i == len(drafts) or drafts[i] != nxt:
            return emitted
    return emitted


def _calls_llmlabs_greedy_accept(model, cache, seq, draft, k):
    from ..speculative import greedy_accept

    drafts = [int(d) for d in draft(seq, k)][:k]
    ids = torch.tensor([[seq[-1]] + drafts], dtype=torch.long, device=model.device)
    start = cache.length
    logits = model.step(ids, cache.begin(ids.shape[1]), cache)[0]
    cache.advance()
    n, nxt = greedy_accept(logits.argmax(-1).tolist(), drafts)
    cache.truncate(start + n + 1)
    return drafts[:n] + [nxt]


def ngram_draft(seq, k):
    """Prompt lookup (:func:`llmlab.speculative.ngram_propose`) as a ``draft(seq, k)``."""
    return ngram_propose(seq, k)


class NoisyOracle:
    """A draft that knows the target's greedy continuation ``ref`` and spoils one token of it
    per step, at a position that cycles: step j spoils draft j mod (k + 2), none when that
    is k or k + 1. So every branch of a step occurs: all rejected, some accepted, all
    accepted (and the bonus token)."""

    def __init__(self, ref: list[int], prompt_len: int, vocab_size: int):
        self.ref, self.prompt_len, self.vocab_size = list(ref), prompt_len, vocab_size
        self.calls = 0

    def __call__(self, seq, k):
        pos = len(seq) - self.prompt_len
        out = self.ref[pos:pos + k]
        j = self.calls % (k + 2)
        self.calls += 1
        if j < len(out):
            out[j] = (out[j] + 1) % self.vocab_size
        return out


def _as_tokens(out, what: str) -> list[int]:
    if isinstance(out, torch.Tensor):
        out = out.reshape(-1).tolist()
    if not isinstance(out, (list, tuple)) or not out:
        raise StepError(f"{what} returned {out!r}; a step returns a non-empty list of token "
                        "ids: the accepted drafts, then the target's own token.")
    return [int(t) for t in out]


@torch.inference_mode()
def generate_with_step(step, model, prompt: list[int], draft, k: int = STEP_K,
                       max_new_tokens: int = 32, eos_token_id: int | None = None,
                       inspect=None):
    """Greedy generation for one prompt (token ids) whose every step after the prefill is
    ``step(model, cache, seq, draft, k) -> emitted tokens``.

    The prefill runs here (the cache then holds the prompt, and the first token is the
    prefill's argmax); each step gets ``seq`` = prompt + tokens so far. Stops after
    ``eos_token_id`` or ``max_new_tokens`` (a step never drafts past the budget). Returns
    (tokens, :class:`~llmlab.speculative.SpecStats`). ``inspect(seq, drafts, emitted,
    cache)``, if given, runs after each step (the checker's hook)."""
    room = len(prompt) + max_new_tokens + k + 1
    cache = ContiguousKVCache.for_model(model, 1, room)
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    logits = model.step(ids, cache.begin(len(prompt)), cache, rows="last")[0, -1]
    cache.advance()
    tokens = [int(logits.argmax())]
    stats = SpecStats(getattr(draft, "__name__", type(draft).__name__), k)
    proposed: list[list[int]] = []

    def recorded(seq, kk):
        out = [int(d) for d in draft(seq, kk)]
        proposed.append(out)
        return out

    while tokens[-1] != eos_token_id and len(tokens) < max_new_tokens:
        seq = prompt + tokens
        kk = min(k, max_new_tokens - len(tokens) - 1)
        proposed.clear()
        t = time.perf_counter()
        out = step(model, cache, list(seq), recorded, kk)
        sync(model.device)
        stats.target_s += time.perf_counter() - t
        if len(proposed) != 1:
            raise StepError(f"your step called draft(seq, k) {len(proposed)} times; call it "
                            "once per step for the k drafts it verifies.")
        drafts = proposed[0][:kk]
        out = _as_tokens(out, "your step")
        if inspect is not None:
            inspect(seq, drafts, out, cache)
        if len(out) > len(drafts) + 1:
            raise StepError(f"with {len(drafts)} drafts a step emits at most "
                            f"{len(drafts) + 1} tokens; yours emitted {len(out)}.")
        stats.accepted_per_step.append(len(out) - 1)
        stats.drafted_per_step.append(len(drafts))
        for t_ in out:
            tokens.append(t_)
            if t_ == eos_token_id or len(tokens) == max_new_tokens:
                break
    stats.num_generated = len(tokens)
    return tokens, stats


@functools.lru_cache(maxsize=1)
def _smollm2_greedy_run():
    import llmlab

    model, tok, _ = _smollm2_and_greedy()
    g = llmlab.generate(model, tok, GREEDY_PROMPT, max_new_tokens=GREEDY_TOKENS,
                        kv_cache="contiguous")
    return model, g.prompt_token_ids, g.token_ids


class _Probe:
    """Counts the forwards of a step (calls of the token embedding, with their widths) and
    keeps the argmax of each row of the last vocabulary projection."""

    def __init__(self, model):
        self.widths: list[int] = []
        self.rows: list[int] | None = None
        self.handles = [
            model.embed_tokens.register_forward_hook(
                lambda mod, args, out: self.widths.append(int(args[0].shape[-1]))),
            model.lm_head.register_forward_hook(self._rows)]

    def _rows(self, mod, args, out):
        self.rows = out.reshape(-1, out.shape[-1]).argmax(-1).tolist()

    def reset(self):
        self.widths, self.rows = [], None

    def close(self):
        for h in self.handles:
            h.remove()


def _expected(ref: list[int], pos: int, drafts: list[int]) -> tuple[int, list[int]]:
    """The accepted count and the tokens a right step emits, by the reference greedy run."""
    n = 0
    while n < len(drafts) and pos + n < len(ref) and drafts[n] == ref[pos + n]:
        n += 1
    return n, drafts[:n] + ref[pos + n:pos + n + 1]


def _inspector(probe: _Probe, ref: list[int], prompt_len: int, what: str,
               eos_token_id: int | None):
    def inspect(seq, drafts, out, cache):
        k, pos = len(drafts), len(seq) - prompt_len
        where = f"{what}, step at output token {pos}, drafts {drafts}"
        if len(probe.widths) != 1 or (k > 0 and probe.widths[0] == 1):
            raise StepError(f"{where}: your step ran {len(probe.widths)} forward(s) of the "
                            f"target (of {probe.widths} tokens). The point of speculation is "
                            f"one forward of all {k + 1} tokens [t, d1 .. d{k}]: causal "
                            "attention gives the target's choice after each of them at once.")
        if probe.widths[0] != k + 1:
            raise StepError(f"{where}: your verify forward fed {probe.widths[0]} tokens; it "
                            f"needs {k + 1}: the last emitted token t and the {k} drafts. Row i "
                            "of its output checks draft i + 1, and row k (after the last draft) "
                            "is the bonus token when every draft is accepted.")
        n, want = _expected(ref, pos, drafts)
        # past the end-of-sequence token nothing counts
        got = out[:len(want)] if want and want[-1] == eos_token_id else out
        if got != want:
            rows = probe.rows if probe.rows and len(probe.rows) == k + 1 else None
            m = len(out) - 1
            if m == k == n and out == drafts:
                raise StepError(f"{where}: all {k} drafts were accepted and your step emitted "
                                f"{out}: it forgot the bonus token, row {k} of the verify "
                                f"forward (here {want[-1]}). A step emits up to k + 1 tokens.")
            if rows and out[:m] == drafts[:m] and m <= k and out[-1] == \
                    rows[min(m + 1, k)] != rows[m]:
                raise StepError(f"{where}: you emitted {out}, the right tokens are {want}. "
                                f"Off by one: row i of the verify forward is the target's "
                                f"token after input i (t is input 0), so draft i + 1 is "
                                f"checked by row i and the token after {m} accepted drafts "
                                f"is row {m}, not row {m + 1}.")
            if m > n and out[:m] == drafts[:m]:
                raise StepError(f"{where}: you accepted {m} drafts, but the target's choice "
                                f"after {'t' if n == 0 else f'd{n}'} is {ref[pos + n]}, not "
                                f"draft {drafts[n]}; the right tokens are {want}.")
            raise StepError(f"{where}: you emitted {out}, the right tokens are {want} (the "
                            f"drafts the target agrees with, in order, then its own token).")
        held, should = cache.length, len(seq) + len(out) - 1
        if held > should:
            raise StepError(f"{where}: after the step your cache holds {held} tokens, it "
                            f"should hold {should} (seq and the emitted tokens but the last). "
                            f"The K/V of the {held - should} rejected draft(s) are still "
                            "there: roll back the cache (cache.truncate) to forget them.")
        if held < should:
            raise StepError(f"{where}: after the step your cache holds {held} tokens, it "
                            f"should hold {should}: it rolled back too far, and the next "
                            "step would attend to a text with holes.")
        probe.reset()
    return inspect


@exercise("nb09.speculative_step", notebook=NB, kind="build",
          title="one speculative step inside SmolLM2: draft, verify in one forward, accept, "
                "roll back",
          solution=reference_speculative_step,
          wrong_variants={
              "forgets the roll-back": (_forgets_the_roll_back, ("roll back",)),
              "reads the token after draft i from row i + 1": (_reads_the_next_row,
                                                               ("Off by one",)),
              "forgets the bonus token": (_forgets_the_bonus, ("bonus",)),
              "verifies one token per forward": (_one_token_per_forward, ("one forward",)),
              "calls llmlab's own greedy_accept": (_calls_llmlabs_greedy_accept,
                                                   ("llmlab's own",)),
          })
def _check_speculative_step(answer) -> object:
    if not callable(answer):
        return wrong(f"pass your function itself; got {type(answer).__name__}.",
                     "exercises.check('nb09.speculative_step', speculative_step)")
    from . import forbid
    from .. import speculative as S

    model, prompt, ref = _smollm2_greedy_run()
    eos = model.config.eos_token_id
    probe = _Probe(model)

    def guarded(*args):
        probe.reset()
        with forbid(S.greedy_accept, S.verify, S.accept_reject, S.speculative_token_ids):
            return answer(*args)

    runs = {}
    try:
        for what, draft in (("noisy drafts", NoisyOracle(ref, len(prompt),
                                                          model.config.vocab_size)),
                            ("prompt-lookup drafts", ngram_draft)):
            try:
                tokens, stats = generate_with_step(
                    guarded, model, prompt, draft, STEP_K, GREEDY_TOKENS, eos,
                    inspect=_inspector(probe, ref, len(prompt), what, eos))
            except StepError as exc:
                return wrong(f"SmolLM2, k = {STEP_K}, {exc}")
            diff = first_token_difference(tokens, ref)
            if diff:
                return wrong(f"SmolLM2 with your step and {what}: {diff} Greedy speculation "
                             "must give plain greedy's tokens.")
            runs[what] = stats
    finally:
        probe.close()
    noisy, lookup = runs["noisy drafts"], runs["prompt-lookup drafts"]
    full = sum(a == d > 0 for a, d in zip(noisy.accepted_per_step, noisy.drafted_per_step))
    zero = sum(a == 0 < d for a, d in zip(noisy.accepted_per_step, noisy.drafted_per_step))
    return right(f"your step gives plain greedy's {len(ref)} tokens of SmolLM2 with k = "
                 f"{STEP_K}: with noisy drafts in {noisy.target_forwards} target forwards "
                 f"({full} steps took the bonus, {zero} rejected every draft), and with prompt "
                 f"lookup in {lookup.target_forwards} ({sum(lookup.accepted_per_step)} drafts "
                 f"accepted, {sum(lookup.drafted_per_step) - sum(lookup.accepted_per_step)} "
                 "rolled back), one forward per step and the cache rolled back each time.")


# ---- predict: the best k -----------------------------------------------------------------

K_CHOICES = (1, 2, 4, 8)


@exercise("nb09.predict_best_k", notebook=NB, kind="predict",
          title="predict: which number of drafts k gives the best speedup?",
          solution=4,
          wrong_variants={"one draft": (1, ("rarely",)), "as many as possible": (8, ("α^i",))})
def _check_predict_best_k(answer, measured: dict | None = None, alpha: float = 0.8,
                          c: float = 0.15, times: dict | None = None) -> object:
    """``measured`` {k: speedup}; without it the cost model at ``alpha`` and ``c``.
    ``times`` {k: seconds of each whole run}: then a k whose runs this noise cannot tell
    from the fastest k's counts as right (``llmlab.profiling.compare``), a tie being a tie."""
    from ..profiling.compare import SLOWER, compare

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
    if times is not None:
        times = {int(k): list(v) for k, v in times.items()}
        tied = [k for k in sorted(times) if k == best
                or compare(times[best], times[k]).verdict != SLOWER]
        if answer in tied:
            others = [k for k in tied if k != answer]
            return right(f"k = {answer}: {speedups[answer]:.2f}x ({what}: {table})"
                         + (f"; this run cannot tell it from k = {others} (their runs overlap), "
                            "so each of them is a right answer here." if others else
                            ", faster than every other k beyond this run's noise.")
                         + " The first draft is accepted with probability α, the i-th only if "
                         "all before it were (α^i), while every draft and every verified "
                         "position is paid for.")
        close = False
    else:
        close = speedups[answer] >= 0.95 * speedups[best]
    if close:
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


# ---- predict: the batch at which speculation stops paying -----------------------------------

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
# one recorded run of the notebook's roofline model (acceptance 0.8, k = 4, a free draft),
# used when the check is given no run of its own
REFERENCE_BATCH_SPEEDUPS = {1: 3.33, 2: 3.29, 4: 3.23, 8: 2.63, 16: 1.53, 32: 0.98, 64: 0.71,
                            128: 0.67}


def breakeven_batch(speedups: dict) -> int | None:
    """The smallest batch whose modelled speedup is below 1 (None if none is)."""
    below = [b for b in sorted(speedups) if speedups[b] < 1]
    return below[0] if below else None


@exercise("nb09.predict_batching_breakeven", notebook=NB, kind="predict",
          title="predict: the smallest batch at which speculation is slower than plain decoding "
                "(roofline model, acceptance 0.8, k = 4)",
          solution=breakeven_batch(REFERENCE_BATCH_SPEEDUPS),
          wrong_variants={"loses at batch 1": (1, ("memory roof",)),
                          "pays at every batch": (128, ("k + 1",)),
                          "compute-bound means slower": (16, ("E[tokens]",))})
def _check_predict_batching_breakeven(answer, speedups: dict | None = None, alpha: float = 0.8,
                                      k: int = 4) -> object:
    """``speedups`` {batch: modelled speedup} from the notebook's run; without it a recorded
    run. A batch counts when its speedup is below 1.1 and the batch before it is at 0.9 or
    more: the roofs are measured, so a crossing within 10% of 1 is a tie."""
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong(f"answer one batch size, an int from {list(BATCHES)}; got {answer!r}.",
                     "e.g. 8")
    s = {int(b): float(v) for b, v in (speedups or REFERENCE_BATCH_SPEEDUPS).items()}
    if answer not in s:
        return wrong(f"batch {answer} is not in the model's list {sorted(s)}.", "e.g. 8")
    e = expected_tokens(alpha, k)
    cross = breakeven_batch(s)
    table = ", ".join(f"{b}: {v:.2f}x" for b, v in sorted(s.items()))
    smaller = [b for b in sorted(s) if b < answer]
    before = s[smaller[-1]] if smaller else None
    why = (f"A verify feeds k + 1 = {k + 1} tokens per sequence and yields E[tokens] = "
           f"{e:.2f}. While it sits left of the ridge point it costs about one decode step; once "
           f"the batch pushes it past the ridge its time grows with its FLOPs, and it loses as "
           f"soon as it costs more than {e:.2f} decode steps (at most k + 1 = {k + 1}, when "
           f"decode is compute-bound too: {e:.2f} / {k + 1} = {e / (k + 1):.2f}x).")
    if cross is None:
        return wrong(f"in this run the model never falls below 1x ({table}).", why)
    if s[answer] < 1.1 and (before is None or before >= 0.9):
        tie = "" if answer == cross else (f" (the model crosses 1x at batch {cross}, "
                                          f"{s[cross]:.2f}x: within 10% of 1, a tie at these "
                                          "measured roofs)")
        return right(f"batch {answer}: {s[answer]:.2f}x{tie}. The model: {table}. {why}")
    if answer < cross:
        where = ("still on the memory roof, where the extra tokens ride on the same weight reads"
                 if s[answer] > 0.9 * s[min(s)] else "past the ridge, but not yet that dear")
        return wrong(f"at batch {answer} the model still gives {s[answer]:.2f}x: the verify is "
                     f"{where}. It first falls below 1x at batch {cross} ({table}).", why)
    return wrong(f"at batch {answer} the model gives {s[answer]:.2f}x, but it is already below "
                 f"1x at batch {cross} ({table}): speculation does not pay at every batch.", why)


# ---- explain (stretch): early exit on SmolLM2 ----------------------------------------------

_EARLY_EXIT_CHOICES = {
    "a": "A wrong early-exit draft changes the emitted text, so the target must run a second "
         "pass to repair it, which doubles the cost of every step.",
    "b": "Its guesses agree with the target only when the cut is deep, and there a draft "
         "token costs most of a decode step.",
    "c": "The early exit keeps no KV cache of its own, so every draft token re-reads the "
         "whole prompt through its layers.",
    "d": "Verifying k + 1 tokens costs k + 1 decode steps on this CPU, so even a free draft "
         "that is always right loses.",
}
_EARLY_EXIT_WHY = {
    "a": "a draft never changes the output: a rejected draft is replaced by the target's own "
         "token in the same step, with no second pass.",
    "b": "the sweep shows agreement climbing only in the last layers, and a draft token of "
         "depth n reads about n layers and the lm_head, so c is large exactly where α is; "
         "E[tokens] / (v + k·c) stays below 1 at every depth. An early exit pays when the "
         "model is trained to be read early (LayerSkip).",
    "c": "the early exit keeps its own KV cache for its first n layers (see "
         "llmlab.speculative.make_drafter): a draft token costs n layers, not the prompt.",
    "d": "the notebook measured v(k + 1): a verify of up to 9 tokens costs far less than k + 1 "
         "decode steps, and prompt lookup, a nearly free draft, gains with it.",
}


@exercise("nb09.explain_early_exit", notebook=NB, kind="explain", stretch=True,
          title="stretch: why does no early-exit depth pay off on SmolLM2?",
          solution="b", choices=_EARLY_EXIT_CHOICES,
          wrong_variants={"second pass": ("a", ("never changes the output",)),
                          "no cache": ("c", ("own KV cache",))})
def _check_explain_early_exit(answer) -> object:
    return choice_verdict(answer, "b", _EARLY_EXIT_WHY)
