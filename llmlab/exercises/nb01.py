"""Exercises of notebook 01 (the baseline, and where the time goes).

- ``nb01.naive_attention`` (build): textbook attention with grouped-query heads, a
  bottom-right causal mask and a numerically stable softmax written by hand; registered as
  a backend and run inside SmolLM2. While the student's code runs on the small cases,
  llmlab's own attention functions and torch's fused attention and softmax raise
  (:func:`forbid_torch`, :func:`llmlab.exercises.forbid`).
- ``nb01.token_passes``, ``nb01.score_bytes`` (compute): the cost of the baseline by hand.
- ``nb01.predict_memory_growth`` (predict): how naive attention's peak memory grows with N.
- ``nb01.predict_intensity_growth`` (predict): by what factor a no-cache step's FLOPs per
  byte grow from 8 to 96 tokens, committed before the roofline model prints them; the
  misreadings that lead to 1 or to 144 are named.
- ``nb01.padded_attention`` (stretch): the same attention with a key-padding mask, run on
  a left-padded batch.

The student's attention takes ``q [batch, heads, n_q, d]`` and ``k, v [batch, kv_heads,
n_k, d]`` (heads first, the layout of the textbook formula); :func:`as_backend` turns it
into a backend of :mod:`llmlab.attention`, whose tensors are ``[batch, seq, heads, d]``.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch

from . import Verdict, compare_tensors, exercise, forbid, number_verdict, right, wrong

NOTEBOOK = "01_baseline_where_time_goes"
PROMPT = "The three laws of thermodynamics are"


@functools.lru_cache(maxsize=1)
def smollm2():
    """(model, tokenizer) of SmolLM2-135M for the checkers, loaded once with ``naive``
    attention. A checker that changes the model's attention restores it before returning."""
    import llmlab

    return (llmlab.load_model("smollm2-135m", attention="naive"),
            llmlab.load_tokenizer("smollm2-135m"))


def as_backend(fn: Callable, padded: bool = False) -> Callable:
    """Wrap the student's ``fn(q, k, v, causal=True)`` (heads-first tensors) as a backend
    ``forward(q, k, v, *, causal, softmax_scale, key_padding_mask)`` of :mod:`llmlab.attention`
    (seq-first tensors). With ``padded=True`` it calls ``fn(q, k, v, key_padding_mask, causal)``."""

    def forward(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None):
        d = q.shape[-1]
        if softmax_scale is not None and not math.isclose(softmax_scale, 1 / math.sqrt(d)):
            raise ValueError(f"softmax_scale={softmax_scale} is not 1/√d; the exercise's "
                             "attention always scales by 1/√d")
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if padded:
            if key_padding_mask is None:
                key_padding_mask = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)
            out = fn(qt, kt, vt, key_padding_mask.to(torch.bool), causal=causal)
        else:
            if key_padding_mask is not None and not bool(key_padding_mask.all()):
                raise ValueError("this batch is left-padded, and naive_attention takes no "
                                 "key_padding_mask (the stretch exercise adds one)")
            out = fn(qt, kt, vt, causal=causal)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"your attention returned {type(out).__name__}, not a tensor")
        return out.transpose(1, 2)

    return forward


@functools.lru_cache(maxsize=4)
def _reference_run(prompts: tuple[tuple[int, ...], ...], new_tokens: int):
    """naive attention's logits over the prompts and its greedy tokens (cached)."""
    from ..generate import generate, left_pad

    model, tok = smollm2()
    ids, mask = left_pad([list(p) for p in prompts], tok.pad_token_id, model.device)
    with torch.inference_mode():
        logits = model(ids, attention_mask=mask)
    tokens = [g.token_ids for g in generate(model, tok, [list(p) for p in prompts],
                                            max_new_tokens=new_tokens)] if new_tokens else []
    return ids, mask, logits, tokens


def _run_model_with(forward: Callable, prompts: list[list[int]], new_tokens: int
                    ) -> tuple[str | None, str]:
    """Run SmolLM2 with ``forward`` registered as a backend; compare with ``naive``.

    Returns (problem or None, a summary of the errors)."""
    from .. import attention as A
    from ..generate import generate
    from . import first_token_difference

    model, tok = smollm2()
    ids, mask, ref, ref_tokens = _reference_run(tuple(tuple(p) for p in prompts), new_tokens)
    name = "nb01-yours"
    A.register(name, forward, description="the student's attention (notebook 01)")
    try:
        model.set_attention(name)
        with torch.inference_mode():
            got = model(ids, attention_mask=mask)
        real = mask.bool()
        problem = compare_tensors(got[real], ref[real], "SmolLM2's logits with your attention",
                                  atol=1e-4)
        if problem:
            return problem, ""
        err = float((got[real] - ref[real]).abs().max())
        if not new_tokens:
            return None, f"max |Δ logits| = {err:.1e}"
        tokens = [g.token_ids for g in generate(model, tok, prompts, max_new_tokens=new_tokens)]
        for mine, want in zip(tokens, ref_tokens):
            diff = first_token_difference(mine, want)
            if diff:
                return f"greedy generation with your attention: {diff}", ""
        return None, (f"max |Δ logits| = {err:.1e}, {new_tokens} greedy tokens identical: "
                      f"{tok.decode(tokens[0])!r}")
    finally:
        model.set_attention("naive")
        A.unregister(name)


# ---- naive_attention ---------------------------------------------------------------------------

class TorchAnswer(Exception):
    """Raised (by :func:`forbid_torch`) when the student's code calls a torch function that
    does the exercise's job: ``what`` names it."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@contextlib.contextmanager
def forbid_torch(*, softmax: bool = False):
    """Inside the block, torch's fused attention (``torch.nn.functional.
    scaled_dot_product_attention``) raises :class:`TorchAnswer`, and with ``softmax=True``
    so does every softmax of torch (``torch.softmax``, ``F.softmax``, ``Tensor.softmax``,
    ``torch.special.softmax``, ``nn.Softmax``, ``log_softmax``).

    A builtin's code cannot be swapped as :func:`llmlab.exercises.forbid` does for Python
    functions, and a student may hold it under another name (``from torch.nn.functional
    import scaled_dot_product_attention as sdpa``), so the calls are caught where every
    such name ends up: a :class:`torch.overrides.TorchFunctionMode`."""
    from torch.overrides import TorchFunctionMode

    class _Guard(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name == "scaled_dot_product_attention":
                raise TorchAnswer("fused attention `torch.nn.functional."
                                  "scaled_dot_product_attention`")
            if softmax and "softmax" in name:
                raise TorchAnswer(f"softmax (`{name}`)")
            return func(*args, **(kwargs or {}))

    with _Guard():
        yield


def library_attention() -> tuple[Callable, ...]:
    """llmlab's own dense attention functions: a build's checker forbids them."""
    from ..attention import naive_attention, sdpa_attention
    from ..attention.flash import flash_attention, flash_attention_varlen, flash_triton_attention

    return (naive_attention, sdpa_attention, flash_attention, flash_attention_varlen,
            flash_triton_attention)


def _stable_softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis from exp, max and sum (the checkers' own, guard-free)."""
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _solution_naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              causal: bool = True) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)            # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])      # [b, h, n_q, n_k]
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (n_k - n_q), float("-inf"))
    # softmax is unchanged by a shift of its row: after subtracting the row's max every
    # exp is <= 1, so no score overflows float32 (exp(89) already does)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v


def _attention_variant(q, k, v, causal=True, *, scale=True, mask=True, top_left=False,
                       modulo=False, always_causal=False, unstable=False):
    """Attention with one known mistake switched on (for the checker's diagnosis)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    idx = (torch.arange(heads) % kv_heads if modulo
           else torch.arange(heads) // (heads // kv_heads))
    k, v = k[:, idx], v[:, idx]
    scores = q @ k.transpose(-1, -2)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    if (causal or always_causal) and mask:
        n_q, n_k = q.shape[2], k.shape[2]
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_k)[None, :]
        shift = 0 if top_left else n_k - n_q
        scores = scores.masked_fill(j > i + shift, float("-inf"))
    if unstable:                                     # exp of the raw scores: overflows
        e = torch.exp(scores)
        return e / e.sum(dim=-1, keepdim=True) @ v
    return _stable_softmax(scores) @ v


def _with_torch_softmax(q, k, v, causal=True):
    """The formula with torch.softmax: right numbers, but the softmax is the build's."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _wraps_llmlab_naive(q, k, v, causal=True):
    """llmlab's own naive backend between two transposes."""
    from ..attention import naive_attention

    return naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


def _wraps_torch_sdpa(q, k, v, causal=True):
    """torch's fused attention with the KV heads repeated (top-left causal: a second bug)."""
    group = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
        is_causal=causal)


_ATTENTION_MISTAKES = (
    (dict(mask=False), "your output equals attention with no causal mask: each query also "
     "sees the keys after it (the future).",
     "before the softmax, set the score of key j to -inf where j > i + (n_k − n_q)."),
    (dict(scale=False), "your output equals attention without the 1/√d scale: the scores "
     "are √d = 8× too large, so the softmax is far too sharp.",
     "multiply Q Kᵀ by 1 / math.sqrt(d), d = q.shape[-1]."),
    (dict(top_left=True), "your causal mask is aligned top-left (query i sees keys j ≤ i). "
     "With n_q < n_k the queries are the LAST n_q positions, so it hides keys they may see.",
     "align it bottom-right: query i sees key j when j ≤ i + (n_k − n_q)."),
    (dict(modulo=True), "query head h reads KV head h % kv_heads: that interleaves the groups.",
     "grouped-query attention gives each KV head a contiguous group of query heads: query "
     "head h reads KV head h // (heads // kv_heads) (torch.repeat_interleave along dim 1)."),
    (dict(always_causal=True), "with causal=False your output is still causally masked.",
     "apply the mask only when causal is True."),
    (dict(unstable=True), "your softmax overflows: these scores reach about {top:.0f}, and "
     "exp of anything above 88.7 is inf in float32, so the rows come out as inf / inf = NaN.",
     "softmax is unchanged when a row is shifted: subtract each row's max "
     "(scores.amax(dim=-1, keepdim=True)) before exp, so every exp is at most 1."),
)


def _check_attention_cases(fn, padded: bool) -> Verdict | None:
    """The small-tensor cases: shape, then value, diagnosing the known mistakes. The last
    case has scores near ±100, which an exp without the max subtracted overflows.

    The student's calls run with llmlab's own attention functions and torch's fused
    attention forbidden (and, for the main build, torch's softmax): calling one comes back
    as a verdict that names it."""
    g = torch.Generator().manual_seed(1)
    cases = [(2, 4, 2, 6, 6, True, 1.0), (1, 4, 2, 3, 8, True, 1.0), (1, 2, 2, 5, 5, False, 1.0),
             (1, 2, 1, 3, 7, True, 40.0)]
    for b, h, kv, n_q, n_k, causal, spread in cases:
        d = 16
        q = torch.randn(b, h, n_q, d, generator=g) * spread
        k = torch.randn(b, kv, n_k, d, generator=g)
        v = torch.randn(b, kv, n_k, d, generator=g)
        where = f"(batch={b}, heads={h}, kv_heads={kv}, n_q={n_q}, n_k={n_k}, causal={causal})"
        try:
            with forbid(*library_attention()), forbid_torch(softmax=not padded):
                if padded:
                    got = fn(q, k, v, torch.ones(b, n_k, dtype=torch.bool), causal=causal)
                else:
                    got = fn(q, k, v, causal=causal)
        except TorchAnswer as exc:
            job = ("the softmax, which this build asks you to write from exp, max and sum"
                   if "softmax" in exc.what else "all of attention at once, which is what "
                   "this build asks you to write")
            return wrong(f"your answer calls torch's {exc.what}: it does {job}.",
                         "write it from plain tensor operations (@, masked_fill, amax, exp, "
                         "sum); the notebook's formula above has every piece.")
        want = _solution_naive_attention(q, k, v, causal)
        problem = compare_tensors(got, want, f"the output {where}", atol=1e-5)
        if problem is None:
            continue
        if isinstance(got, torch.Tensor) and got.shape == want.shape:
            top = float((q @ k.repeat_interleave(h // kv, dim=1).transpose(-1, -2)).abs().max()
                        / math.sqrt(d))
            for flags, msg, hint in _ATTENTION_MISTAKES:
                if flags.get("unstable") and padded:
                    continue
                other = _attention_variant(q, k, v, causal, **flags)
                if torch.allclose(got, other, atol=1e-5, equal_nan=True):
                    return wrong(f"{where}: {msg.format(top=top)}", hint)
        return wrong(problem, "softmax(Q Kᵀ / √d + causal mask) V, with query head h reading KV "
                              "head h // (heads // kv_heads); return [batch, heads, n_q, d].")
    return None


@exercise("nb01.naive_attention", notebook=NOTEBOOK, kind="build",
          title="naive_attention(q, k, v, causal=True): grouped-query, bottom-right causal, "
                "1/√d, a stable softmax by hand; runs inside SmolLM2",
          solution=_solution_naive_attention,
          wrong_variants={
              "missing causal mask": (functools.partial(_attention_variant, mask=False),
                                      ("no causal mask",)),
              "no 1/√d": (functools.partial(_attention_variant, scale=False), ("1/√d",)),
              "mask aligned top-left": (functools.partial(_attention_variant, top_left=True),
                                        ("top-left", "bottom-right")),
              "head h reads KV head h % kv_heads": (functools.partial(_attention_variant,
                                                                      modulo=True),
                                                    ("h % kv_heads", "h // (heads // kv_heads)")),
              "softmax without the max subtracted": (functools.partial(_attention_variant,
                                                                       unstable=True),
                                                     ("overflows", "max")),
              "torch.softmax": (_with_torch_softmax, ("torch's softmax", "exp, max and sum")),
              "wraps llmlab's naive backend": (_wraps_llmlab_naive, ("llmlab's own",
                                                                     "naive_attention")),
              "wraps torch's fused attention": (_wraps_torch_sdpa, ("torch's fused attention",)),
          })
def _check_naive_attention(fn, **_) -> Verdict:
    verdict = _check_attention_cases(fn, padded=False)
    if verdict is not None:
        return verdict
    _, tok = smollm2()
    problem, summary = _run_model_with(as_backend(fn), [tok(PROMPT)["input_ids"]], new_tokens=8)
    if problem:
        return wrong(f"the small cases pass, but inside SmolLM2: {problem}",
                     "check the dtype and that you do not modify q, k or v in place.")
    return right("small cases (GQA, n_q < n_k, causal and not, scores near ±100) match, and "
                 f"SmolLM2 runs with your attention as a backend: {summary}.")


# ---- compute: the cost of the baseline ---------------------------------------------------------

@exercise("nb01.token_passes", notebook=NOTEBOOK, kind="compute",
          title="token-passes of the no-cache loop for T = 100 tokens after a P = 30 prompt",
          solution=sum(30 + t for t in range(100)),
          wrong_variants={"with a cache": (129, ("cache",)),
                          "forgets the prompt": (sum(range(100)), ("prompt",))})
def _check_token_passes(answer, prompt_len: int = 30, new_tokens: int = 100, **_) -> Verdict:
    expected = sum(prompt_len + t for t in range(new_tokens))
    cached = prompt_len + new_tokens - 1
    if answer == cached:
        return wrong(f"{answer} is what a KV cache would cost (the prompt once, then one "
                     "token per step).", "without a cache, step t re-runs the prompt and the t "
                                         "tokens generated so far: P + t token-passes.")
    if answer == sum(range(new_tokens)):
        return wrong(f"{answer} counts only the generated tokens; every step also re-runs the "
                     f"{prompt_len}-token prompt.", "step t runs the model over P + t tokens.")
    return number_verdict(answer, expected, good=(
        f"{expected:,} token-passes: P·T + T(T−1)/2, quadratic in T; with a cache it would be "
        f"{cached} ({expected / cached:.0f}× fewer)."),
        hint="step t (t = 0 … T−1) runs the model over P + t tokens; add them up.")


@exercise("nb01.score_bytes", notebook=NOTEBOOK, kind="compute",
          title="bytes of one float32 score matrix of SmolLM2 at N = 8192",
          solution=9 * 8192 * 8192 * 4,
          wrong_variants={"one head": (8192 * 8192 * 4, ("heads",)),
                          "2-byte floats": (9 * 8192 * 8192 * 2, ("4 bytes",))})
def _check_score_bytes(answer, n: int = 8192, heads: int = 9, bytes_per_el: int = 4,
                       batch: int = 1, **_) -> Verdict:
    expected = batch * heads * n * n * bytes_per_el
    if answer == expected // heads:
        return wrong(f"{answer:,} bytes is one head's matrix.",
                     f"the scores are [batch, heads, N, N]: all {heads} query heads have one.")
    if answer == expected // 2:
        return wrong(f"{answer:,} bytes assumes 2-byte floats.", "a float32 is 4 bytes.")
    return number_verdict(answer, expected, good=(
        f"{expected / 2**30:.2f} GiB for ONE layer's scores: naive attention cannot reach long "
        "contexts, and FlashAttention (notebook 03) never stores them."),
        hint="a [batch, heads, N, N] tensor of 4-byte floats.")


# ---- predict: how naive attention's memory grows ----------------------------------------------

@functools.lru_cache(maxsize=1)
def _measured_memory_growth(n: int = 1024) -> float:
    """Peak bytes of one naive attention call at 2n over the peak at n (SmolLM2's shape)."""
    from .. import attention as A
    from ..profiling import peak_memory

    g = torch.Generator().manual_seed(0)
    peaks = []
    for length in (n, 2 * n):
        q = torch.randn(1, length, 9, 64, generator=g)
        k = torch.randn(1, length, 3, 64, generator=g)
        peaks.append(peak_memory(lambda: A.get("naive").forward(q, k, k, causal=True),
                                 device="cpu").peak_bytes)
    return peaks[1] / peaks[0]


@exercise("nb01.predict_memory_growth", notebook=NOTEBOOK, kind="predict",
          title="predict: naive attention's peak memory at N = 2048 over N = 1024",
          solution=4.0,
          wrong_variants={"linear": (2.0, ("measured", "score")),
                          "cubic": (8.0, ("measured",))})
def _check_predict_memory_growth(answer, measured: float | None = None, **_) -> Verdict:
    if measured is None:
        measured = _measured_memory_growth()
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or answer <= 0:
        return wrong(f"the prediction should be a positive number (a factor), got {answer!r}.",
                     "e.g. 2.0 if you expect the memory to double.")
    why = (f"Measured: {measured:.2f}×. The peak is the [1, 9, N, N] score matrix and its "
           "softmax (the inputs and output are only [1, N, heads, 64]), so doubling N "
           "multiplies it by about 2² = 4.")
    if abs(answer - measured) <= 0.25 * measured:
        return right(f"you predicted {answer:g}×. {why}")
    return wrong(f"you predicted {answer:g}×, {answer / measured:.2f} times the measured growth. "
                 f"{why}", "count the elements of the largest tensor the call creates.")


# ---- predict: how a no-cache step's intensity grows with L ---------------------------------------

GROWTH_FROM, GROWTH_TO = 8, 96


@functools.lru_cache(maxsize=1)
def _smollm2_config():
    from ..config import ModelConfig
    from ..models.registry import model_dir

    return ModelConfig.from_file(model_dir("smollm2-135m"))


def modelled_intensity_growth(config=None, short: int = GROWTH_FROM,
                              long: int = GROWTH_TO) -> float:
    """The roofline model's FLOPs per byte of a no-cache forward over ``long`` tokens over
    that of one over ``short`` tokens (batch 1, float32; SmolLM2 by default)."""
    from ..profiling.roofline import forward_cost

    config = config or _smollm2_config()
    return forward_cost(config, 1, long).intensity / forward_cost(config, 1, short).intensity


@exercise("nb01.predict_intensity_growth", notebook=NOTEBOOK, kind="predict", solution=12.0,
          title=f"predict: by what factor a no-cache step's FLOPs per byte grow from "
                f"L = {GROWTH_FROM} to L = {GROWTH_TO} tokens",
          wrong_variants={"weights read once per token": (1.0, ("once", "all L")),
                          "bytes grow faster than FLOPs": (0.5, ("faster", "once")),
                          "attention's L² dominates": (144.0, ("L²", "minority"))})
def _check_predict_intensity_growth(answer, measured: float | None = None, **_) -> Verdict:
    """``answer``: the factor; ``measured``: the roofline model's factor the notebook prints."""
    want = modelled_intensity_growth() if measured is None else float(measured)
    tokens = GROWTH_TO / GROWTH_FROM
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not (
            math.isfinite(answer) and answer > 0):
        return wrong(f"the prediction should be a positive number (a factor), got {answer!r}.",
                     "e.g. 2.0 if you expect the FLOPs per byte to double.")
    said = f"the model gives ×{want:.1f} from L = {GROWTH_FROM} to L = {GROWTH_TO}"
    if max(answer / want, want / answer) <= 1.4:          # within a factor of 1.4
        return right(f"you predicted ×{answer:g}; {said} ({tokens:g}× the tokens). A forward "
                     "reads each weight once and multiplies it with all L rows of its input, "
                     "so its FLOPs grow with L while its bytes hardly move: the intensity grows "
                     "about like L, and a long enough step crosses the ridge point. It grows a "
                     "little less than L because the activations' bytes grow with L too and the "
                     "embedding table is used for the last token's logits only.")
    if answer <= 0.9:
        why = ("below 1 the bytes would grow faster than the FLOPs, as if each weight were read "
               "more than once per token. A forward reads each weight matrix once and multiplies "
               "it with all L rows of its [L, hidden] input: the bytes hardly change with L.")
    elif answer < 1.5:
        why = ("a constant intensity is what you get if every weight were read once per token, "
               "so that bytes grow with L like the FLOPs. A forward reads each weight once and "
               "uses it for all L tokens: the FLOPs grow with L, the bytes hardly.")
    elif answer >= 0.5 * tokens ** 2:
        why = (f"×{answer:g} is about ({tokens:g})², the growth of attention's L × L score "
               "matrix. At these lengths attention is a minority of the FLOPs: 2 FLOPs per "
               "weight per token over 135M weights outweigh the L² term until L is in the "
               "thousands, so the intensity grows about like L, not L².")
    else:
        why = f"you predicted ×{answer:g}, {answer / want:.2f} times the model's value."
    return wrong(f"{said}; {why}", "per forward: how many times is each weight read, and for how "
                                   "many tokens is it used?")


# ---- stretch: attention with a key-padding mask -----------------------------------------------

def _solution_padded_attention(q, k, v, key_padding_mask, causal: bool = True):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = key_padding_mask[:, None, None, :]                    # [b, 1, 1, n_k]
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        allowed = allowed & (j <= i + (n_k - n_q))
    # a finite fill: a padding query whose keys are all masked gets uniform weights, not NaN
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


def _padded_ignores_mask(q, k, v, key_padding_mask, causal=True):
    return _solution_naive_attention(q, k, v, causal)


def _padded_minus_inf(q, k, v, key_padding_mask, causal=True):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = key_padding_mask[:, None, None, :]
    if causal:
        allowed = allowed & (torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q))
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@exercise("nb01.padded_attention", notebook=NOTEBOOK, kind="build", stretch=True,
          title="stretch: padded_attention(q, k, v, key_padding_mask, causal=True) on a "
                "left-padded batch",
          solution=_solution_padded_attention,
          wrong_variants={"ignores the padding mask": (_padded_ignores_mask, ("padding",)),
                          "-inf fill gives NaN": (_padded_minus_inf, ("NaN",))})
def _check_padded_attention(fn, **_) -> Verdict:
    verdict = _check_attention_cases(fn, padded=True)
    if verdict is not None:
        return verdict
    from ..attention import naive_attention

    g = torch.Generator().manual_seed(2)
    b, h, kv, n, d = 2, 4, 2, 6, 16
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, kv, n, d, generator=g)
    v = torch.randn(b, kv, n, d, generator=g)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :3] = False                                   # row 0 is left-padded by 3
    got = fn(q, k, v, mask, causal=True)
    if not isinstance(got, torch.Tensor) or got.shape != q.shape:
        return wrong(f"expected a tensor of shape {tuple(q.shape)}.", "return [b, heads, n_q, d].")
    if not bool(torch.isfinite(got).all()):
        rows = sorted({int(i) for i in torch.nonzero(~torch.isfinite(got))[:, 2]})
        return wrong(f"your output has NaN or inf at query positions {rows} of the padded row: "
                     "every key of those padding queries is masked, and a softmax over all -inf "
                     "is 0/0 = NaN, which then spreads through the next layer's values.",
                     "fill masked scores with a large finite negative number "
                     "(torch.finfo(dtype).min) instead of -inf.")
    want = naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                           key_padding_mask=mask).transpose(1, 2)
    real = mask[:, None, :, None].expand_as(want)         # queries that are real tokens
    problem = compare_tensors(got[real], want[real], "the real queries' output", atol=1e-5)
    if problem:
        unmasked = _solution_naive_attention(q, k, v, causal=True)
        if torch.allclose(got[real], unmasked[real], atol=1e-5):
            problem += (" It equals attention that ignores the padding mask: the real queries "
                        "of row 0 attend to its 3 padding keys.")
        return wrong(problem, "combine the key-padding mask, broadcast as [b, 1, 1, n_k], with "
                              "the causal mask before the softmax.")
    _, tok = smollm2()
    prompts = [tok("Name a planet.")["input_ids"], tok(PROMPT + " the first one")["input_ids"]]
    problem, summary = _run_model_with(as_backend(fn, padded=True), prompts, new_tokens=0)
    if problem:
        return wrong(f"inside SmolLM2 on a left-padded batch: {problem}", "")
    return right(f"SmolLM2 runs a left-padded batch of two prompts with your attention: "
                 f"{summary} over the real tokens.")
