"""The exercises of notebook 14 (long contexts: KV bytes per token, split-KV decode with a
log-sum-exp merge, attention sinks).

- ``nb14.kv_gib_128k`` (compute): Llama-3-8B's KV cache at 128k tokens, in GiB.
- ``nb14.lse_merge`` (build): merge split-KV partials with their log-sum-exp. Checked on
  partials of ragged sequences (some splits empty) against unsplit attention, then in every
  layer of SmolLM2's decode through the paged engine: the same greedy tokens.
- ``nb14.explain_sinks`` (explain): why a window alone collapses.
- ``nb14.sinks_attention`` (build, stretch): one decode query of the sinks cache: which
  keys it keeps and where RoPE puts them; run token by token on SmolLM2.
"""
from __future__ import annotations

import functools as _functools

import torch as _torch

from . import Verdict, choice_verdict, exercise, forbid, right, wrong

NB = "14_long_context"

_SPLIT_LENS = (37, 70, 5, 129)        # ragged: not multiples of anything; 5 leaves splits empty
_SPLITS = 4


def reference_merge_splits(o, lse):
    """out = Σ_s exp(lse_s − L) o_s with L = log Σ_s exp(lse_s), the largest lse subtracted
    first so that nothing overflows; a split with lse = -inf weighs nothing."""
    top = lse.max(dim=0).values
    w = _torch.exp(lse - top)                      # [splits, ...]: each split's share, unnormalized
    return (w[..., None] * o).sum(dim=0) / w.sum(dim=0)[..., None]


def _merge_no_rescale(o, lse):
    return o.sum(dim=0)


def _merge_average(o, lse):
    seen = _torch.isfinite(lse)
    return (o * seen[..., None]).sum(dim=0) / seen.sum(dim=0)[..., None]


def _merge_max_for_lse(o, lse):
    top = lse.max(dim=0).values                    # normalizes by the max, not by Σ exp
    return (_torch.exp(lse - top)[..., None] * o).sum(dim=0)


def _merge_library(o, lse):
    from ..attention.split_kv import merge_partials

    return merge_partials(o, lse)[0]


def _merge_forbidden():
    from ..attention import split_kv
    from ..kernels import paged_attn

    out = [split_kv.merge_partials, split_kv.paged_attention_split_reference]
    if hasattr(paged_attn, "paged_attention_split"):
        out.append(paged_attn.paged_attention_split)
    return out


def _split_case(seed: int = 0):
    """Partials of a paged decode at ragged lengths (GQA 9/3 as SmolLM2, head_dim 16), and
    the unsplit output they must merge to."""
    from ..attention.paged import paged_attention_reference
    from ..attention.split_kv import split_kv_partials

    g = _torch.Generator().manual_seed(seed)
    block, kv_heads, heads, d = 8, 3, 9, 16
    need = [-(-n // block) for n in _SPLIT_LENS]
    pool = sum(need) + 2
    k_cache = _torch.randn(pool, block, kv_heads, d, generator=g) * 2   # peaked softmaxes
    v_cache = _torch.randn(pool, block, kv_heads, d, generator=g)
    perm = _torch.randperm(pool, generator=g).tolist()
    table = _torch.full((len(_SPLIT_LENS), max(need)), -1, dtype=_torch.int32)
    for b, nb in enumerate(need):
        table[b, :nb] = _torch.tensor([perm.pop() for _ in range(nb)], dtype=_torch.int32)
    seqlens = _torch.tensor(_SPLIT_LENS, dtype=_torch.int32)
    q = _torch.randn(len(_SPLIT_LENS), 1, heads, d, generator=g)
    want = paged_attention_reference(q, k_cache, v_cache, seqlens, table)
    o, lse = split_kv_partials(q, k_cache, v_cache, seqlens, table, _SPLITS, tile=16)
    return o, lse, want


def _diagnose_merge(got, o, lse) -> str:
    """Which known mistake ``got`` equals, as a sentence (or "")."""
    for fn, what in ((_merge_no_rescale, "the plain sum of the partials (no rescaling)"),
                     (_merge_average, "the average of the partials"),
                     (_merge_max_for_lse, "the partials weighted by exp(lse − max) but divided "
                                          "by nothing: the max stands where the log-sum-exp "
                                          "belongs")):
        ref = fn(o, lse)
        if got.shape == ref.shape and _torch.allclose(got.float(), ref.float(), atol=1e-5):
            return f" Your output equals {what}."
    return ""


_MERGE_PROMPTS = ("Explain what a KV cache stores, in two sentences.",
                  "Name three planets and one fact about each.")
_MERGE_TOKENS = 4
_STUDENT_SPLIT_BACKEND = "nb14_student_split"


@_functools.lru_cache(maxsize=1)
def _smollm2():
    import llmlab

    return (llmlab.load_model("smollm2-135m", attention="sdpa"),
            llmlab.load_tokenizer("smollm2-135m"))


@_functools.lru_cache(maxsize=1)
def _unsplit_tokens() -> list[list[int]]:
    """The greedy tokens the checker compares with (unsplit attention, computed once)."""
    model, tok = _smollm2()
    return _engine_tokens(model, tok, "paged_sdpa")


def _engine_tokens(model, tok, paged_attention: str) -> list[list[int]]:
    from ..engine import LLM, SamplingParams

    llm = LLM(model, tok, paged_attention=paged_attention, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=_MERGE_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(list(_MERGE_PROMPTS), params,
                                                         use_tqdm=False)]


def _check_merge_in_model(fn) -> str | None:
    """SmolLM2 through the paged engine, every layer's attention split in 4 and merged by
    ``fn``: greedy tokens against unsplit attention over the same pool."""
    from .. import attention as attn
    from ..attention.split_kv import split_kv_partials
    from ..exercises import first_token_difference

    model, tok = _smollm2()
    want = _unsplit_tokens()

    def with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, *, softmax_scale=None,
                     causal=True, max_seqlen_k=None):
        o, lse = split_kv_partials(q, k_cache, v_cache, cache_seqlens, block_table, _SPLITS,
                                   softmax_scale=softmax_scale, causal=causal,
                                   max_seqlen_k=max_seqlen_k)
        return fn(o, lse).to(q.dtype)

    attn.register(_STUDENT_SPLIT_BACKEND, attn.get("paged_split").forward,
                  with_kvcache=with_kvcache)
    try:
        with forbid(*_merge_forbidden()):
            got = _engine_tokens(model, tok, _STUDENT_SPLIT_BACKEND)
    finally:
        attn.unregister(_STUDENT_SPLIT_BACKEND)
    for row, (g, w) in enumerate(zip(got, want)):
        if (diff := first_token_difference(g, w)) is not None:
            return (f"in SmolLM2's greedy decode (every layer split in {_SPLITS}), prompt {row}: "
                    f"{diff}")
    return None


@exercise("nb14.lse_merge", notebook=NB, kind="build",
          title="build: merge split-KV partials with their log-sum-exp",
          solution=reference_merge_splits,
          wrong_variants={
              "no rescaling": (_merge_no_rescale, ("plain sum", "differs")),
              "average": (_merge_average, ("average",)),
              "max for lse": (_merge_max_for_lse, ("max stands where",)),
              "library": (_merge_library, ("llmlab's own",)),
          })
def _check_lse_merge(fn, **_) -> Verdict:
    from . import compare_tensors

    o, lse, want = _split_case()
    with forbid(*_merge_forbidden()):
        got = fn(o.clone(), lse.clone())
    if isinstance(got, tuple):
        got = got[0]
    if (problem := compare_tensors(got, want, "your merged output", 1e-5)) is not None:
        return wrong(problem + _diagnose_merge(got, o, lse) +
                     f" (sequences of {list(_SPLIT_LENS)} keys, {_SPLITS} splits; the "
                     "5-key one leaves 3 splits empty, lse = -inf)",
                     "each partial is normalized over its own keys only: weigh it by its "
                     "share of the whole softmax sum, exp(lse_s) / Σ_t exp(lse_t), with the "
                     "largest lse subtracted before exp.")
    if (problem := _check_merge_in_model(fn)) is not None:
        return wrong(problem, "the small case passed: check the dtype and shape you return "
                     "([..., head_dim], float32 is fine).")
    err = float((got - want).abs().max())
    return right(f"merged partials equal unsplit attention (max |error| {err:.1e}, float32 "
                 f"rounding) at ragged lengths with empty splits, and SmolLM2's greedy decode "
                 f"with every layer split in {_SPLITS} gives the unsplit tokens.")


# ---- compute: a KV cache at 128k tokens ------------------------------------------------------

@exercise("nb14.kv_gib_128k", notebook=NB, kind="compute",
          title="compute: Llama-3-8B's KV cache for one 128k-token sequence, in GiB (bfloat16)",
          solution=16.0,
          wrong_variants={"MHA heads": (64.0, ("4", "KV heads")),
                          "K only": (8.0, ("0.5",))})
def _check_kv_gib_128k(answer, **_) -> Verdict:
    from ..profiling.kv_memory import kv_bytes
    from . import number_verdict

    want = kv_bytes("llama-3-8b", context=128 * 1024).total / 2**30
    verdict = number_verdict(answer, want, rel=0.02, unit=" GiB",
                             good=f"{want:.0f} GiB: 2 (K and V) × 32 layers × 8 KV heads × 128 "
                                  "× 2 bytes = 128 KiB a token, times 131,072 tokens; the "
                                  "weights themselves are 16 GB.",
                             hint="per token: 2 × layers × KV heads × head_dim × bytes; "
                                  "Llama-3-8B has 8 KV heads, not 32.")
    if not verdict.passed and isinstance(answer, (int, float)) and want:
        ratio = answer / want
        if abs(ratio - 4) < 0.1:
            return wrong(f"{answer:g} GiB is 4× the answer: that counts 32 KV heads (MHA); "
                         "Llama-3-8B shares each K/V head among 4 query heads (8 KV heads).")
        if abs(ratio - 0.5) < 0.02:
            return wrong(f"{answer:g} GiB is 0.5× the answer: the cache holds K and V.")
    return verdict


# ---- explain: why a window alone collapses ------------------------------------------------------

_SINK_CHOICES = {
    "a": "The evicted tokens held the facts the text refers back to, and without them the "
         "model loses the thread of the argument.",
    "b": "Past the window, RoPE rotates the remaining keys by angles that the model never saw "
         "during its training.",
    "c": "Heads park much of their attention on the first tokens; once those are evicted, "
         "that mass lands on tokens never meant to take it.",
    "d": "The window's keys were computed with the first tokens present, so they no longer "
         "match each other once the first tokens are gone from the cache.",
}
_SINK_EXPLANATIONS = {
    "a": "Losing distant content costs little: the same window with 4 sink tokens, which "
         "add no facts about the text, brings perplexity back near the full cache's.",
    "b": "With positions inside the cache the largest distance is the cache's size, well "
         "inside SmolLM2's training context; and the sinks case uses the same positions.",
    "c": "Right: trained on contexts that always start at the same tokens, heads learn to "
         "park surplus attention on them (attention sinks). Softmax must sum to one, so "
         "once the sinks are evicted that mass is spread over tokens whose values were "
         "never meant to carry it. Keeping 4 of them restores the distribution.",
    "d": "Every cached key is a function of the tokens before it and stays valid; the "
         "window-plus-sinks cache keeps the very same window keys and recovers.",
}


@exercise("nb14.explain_sinks", notebook=NB, kind="explain",
          title="explain: why does perplexity blow up when a sliding window evicts the first "
                "tokens, and why do 4 kept tokens fix it?",
          solution="c", choices=_SINK_CHOICES,
          wrong_variants={"facts": ("a", ("4 sink tokens",)),
                          "rope": ("b", ("inside the cache",))})
def _check_explain_sinks(answer, alone: float | None = None, with_sinks: float | None = None,
                         **_) -> Verdict:
    """``alone``, ``with_sinks``: the run's perplexities over the full cache's, quoted."""
    verdict = choice_verdict(answer, "c", _SINK_EXPLANATIONS)
    if alone is None or with_sinks is None:
        return verdict
    return Verdict(verdict.passed, verdict.message + f" (This run: the window alone at "
                   f"{alone:.2f}× the full cache's perplexity, with 4 sinks {with_sinks:.2f}×.)")


# ---- stretch: one decode query of the sinks cache --------------------------------------------

def reference_sinks_attention(q, k, v, sinks, window, rope):
    """q [b, 1, heads, d]; k, v [b, n, kv_heads, d]: every token so far (the query's own
    last), un-rotated. Keep the first ``sinks`` and the last ``window``, rotate them at
    cache positions 0..c-1 and the query at c-1, attend."""
    n = k.shape[1]
    start = min(n, max(sinks, n - window))          # the window, past the sinks
    kept = _torch.cat([_torch.arange(min(sinks, n)), _torch.arange(start, n)])
    pos = _torch.arange(kept.numel())
    kk = rope(k[:, kept], pos)
    qq = rope(q, pos[-1:])
    group = q.shape[2] // k.shape[2]
    kk, vv = kk.repeat_interleave(group, 2), v[:, kept].repeat_interleave(group, 2)
    scores = _torch.einsum("bqhd,bkhd->bhqk", qq, kk) / q.shape[-1] ** 0.5
    return _torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)


def _sinks_text_positions(q, k, v, sinks, window, rope):
    n = k.shape[1]
    start = min(n, max(sinks, n - window))          # the window, past the sinks
    kept = _torch.cat([_torch.arange(min(sinks, n)), _torch.arange(start, n)])
    kk = rope(k[:, kept], kept)                           # positions in the text
    qq = rope(q, _torch.tensor([n - 1]))
    group = q.shape[2] // k.shape[2]
    kk, vv = kk.repeat_interleave(group, 2), v[:, kept].repeat_interleave(group, 2)
    scores = _torch.einsum("bqhd,bkhd->bhqk", qq, kk) / q.shape[-1] ** 0.5
    return _torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)


def _sinks_no_sinks(q, k, v, sinks, window, rope):
    return reference_sinks_attention(q, k, v, 0, window, rope)


def _sinks_forbidden():
    from ..cache import sinks as S

    return [S.sink_window_attention, S.SinkKVCache.attend]


class _StudentSinksCache:
    """Keeps every token's un-rotated K/V; each decode step calls the student's function on
    all of them, so the function decides what is kept and where RoPE puts it."""

    def __init__(self, model, fn, sinks, window):
        from ..cache.sinks import rope

        attn = model.layers[0].self_attn
        self.fn, self.sinks, self.window = fn, sinks, window
        inv_freq = attn.rotary.inv_freq
        self.rope = lambda x, positions: rope(x, positions, inv_freq)
        self.k = [None] * model.config.num_layers
        self.v = [None] * model.config.num_layers

    def attend(self, layer_idx, q, k, v, backend=None):
        if self.k[layer_idx] is not None:
            k = _torch.cat([self.k[layer_idx], k], 1)
            v = _torch.cat([self.v[layer_idx], v], 1)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return self.fn(q, k, v, self.sinks, self.window, self.rope)


_SINK_TEXT_TOKENS = 24
_SINK_SETTING = (2, 8)


def _check_sinks_in_model(fn) -> tuple[str | None, float]:
    from ..cache.sinks import streaming_nll
    from ..quant.eval import eval_token_ids
    import torch.nn.functional as F

    model, tok = _smollm2()
    ids = _torch.tensor(eval_token_ids(tok, _SINK_TEXT_TOKENS))
    sinks, window = _SINK_SETTING
    want = streaming_nll(model, ids, sinks, window, chunk=_SINK_TEXT_TOKENS)
    cache = _StudentSinksCache(model, fn, sinks, window)
    got = []
    with _torch.inference_mode(), forbid(*_sinks_forbidden()):
        for t in range(ids.numel() - 1):
            logits = model.step(ids[None, t:t + 1], _torch.zeros(1, 1, dtype=_torch.long), cache)
            got.append(F.cross_entropy(logits[0].float(), ids[t + 1:t + 2]))
    got = _torch.stack(got)
    err = float((got - want).abs().max())
    if err > 1e-3:
        t = int((got - want).abs().argmax())
        return (f"on SmolLM2 ({ids.numel()} tokens of text, {sinks} sinks, window {window}), the "
                f"loss of token {t + 1} is {float(got[t]):.3f} nats with yours, "
                f"{float(want[t]):.3f} with llmlab's cache (max |difference| {err:.3g})."), err
    return None, err


@exercise("nb14.sinks_attention", notebook=NB, kind="build", stretch=True,
          title="stretch: one decode query of the sinks cache",
          solution=reference_sinks_attention,
          wrong_variants={"text positions": (_sinks_text_positions, ("cache position",)),
                          "no sinks": (_sinks_no_sinks, ("first",)),
                          "library": (lambda q, k, v, s, w, rope: _sinks_library(q, k, v, s, w),
                                      ("llmlab's own",))})
def _check_sinks_attention(fn, **_) -> Verdict:
    from ..cache.sinks import rope as lib_rope
    from ..layers.rotary import inverse_frequencies
    from . import compare_tensors

    inv_freq = inverse_frequencies(16, 10000.0)
    rope = lambda x, positions: lib_rope(x, positions, inv_freq)   # noqa: E731
    g = _torch.Generator().manual_seed(0)
    for n, sinks, window in ((5, 2, 8), (14, 2, 8), (30, 4, 6), (30, 0, 6)):
        q = _torch.randn(2, 1, 6, 16, generator=g)
        k, v = _torch.randn(2, n, 2, 16, generator=g), _torch.randn(2, n, 2, 16, generator=g)
        want = reference_sinks_attention(q, k, v, sinks, window, rope)
        with forbid(*_sinks_forbidden()):
            got = fn(q, k, v, sinks, window, rope)
        if (problem := compare_tensors(got, want, f"your output (n={n} tokens, sinks={sinks}, "
                                       f"window={window})", 1e-5)) is not None:
            hint = ("keep the first `sinks` tokens and the last `window` (the query's own "
                    "among them); number the kept keys 0..c-1 and rotate each at its cache "
                    "position, the query at c-1.")
            text = _sinks_text_positions(q, k, v, sinks, window, rope)
            if got.shape == text.shape and _torch.allclose(got, text, atol=1e-5):
                problem += (" It matches keys rotated at their positions in the text, not "
                            "their cache position.")
            elif sinks and n > sinks + window:
                plain = reference_sinks_attention(q, k, v, 0, window, rope)
                if got.shape == plain.shape and _torch.allclose(got, plain, atol=1e-5):
                    problem += " It matches a window without the first tokens kept."
            return wrong(problem, hint)
    problem, err = _check_sinks_in_model(fn)
    if problem is not None:
        return wrong(problem, "the random cases passed: check the dtype you return and the "
                     "grouped heads (query head h reads KV head h // group).")
    return right(f"your query matches the literal rule on random cases, and on SmolLM2 token by "
                 f"token it gives llmlab's chunked cache's losses (max |difference| {err:.1e}).")


def _sinks_library(q, k, v, sinks, window):
    from ..cache.sinks import sink_window_attention
    from ..layers.rotary import inverse_frequencies

    n = k.shape[1]
    return sink_window_attention(q, k, v, _torch.tensor([n - 1]), _torch.arange(n), sinks,
                                 window, inverse_frequencies(q.shape[-1], 10000.0))
