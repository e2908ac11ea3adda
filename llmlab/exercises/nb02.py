"""Exercises of notebook 02 (the KV cache, and the roofline).

- ``nb02.kv_cache`` (build): the cache's ``append``, ``attend`` and ``advance``, written in a
  subclass of :class:`KVCacheBase` (which holds the storage and hands out positions);
  ``llmlab.generate`` runs SmolLM2 with it and must give the tokens of ``kv_cache="none"``.
- ``nb02.decode_loop`` (build): the generation loop around that cache: the prompt in one
  forward (prefill), then one forward per new token (decode), greedy; the tokens must equal
  ``llmlab.generate``'s, every step's logits a no-cache forward's, and the model must be fed
  one token per decode step at the right position (llmlab's own loops raise during the check).
- ``nb02.predict_decode_intensity`` (predict): the FLOPs per byte of a batch-1 decode step in
  float32, committed before the roofline model prints it; the usual miscounts are named.
- ``nb02.predict_batch_decode`` (predict): the step time of a decode step at batch 16
  over batch 1, committed before the notebook times both; judged against that run.
- ``nb02.compute_bound_batch`` (compute): the batch at which a decode step reaches a ridge point.
- ``nb02.padded_kv_cache`` (stretch): the same cache for a left-padded batch of prompts.
"""
from __future__ import annotations

import functools
import math
import statistics

import torch

from ..config import ModelConfig
from . import Verdict, compare_tensors, exercise, first_token_difference, right, wrong

NOTEBOOK = "02_kv_cache_and_roofline"
PROMPT = "The history of the printing press"


class KVCacheBase:
    """The bookkeeping of a contiguous KV cache, for the notebook-02 exercise.

    Given: the storage, per layer ``k[layer]`` and ``v[layer]`` of shape
    ``[batch, kv_heads, max_len, head_dim]`` (zeros, allocated once); ``length``, the
    number of slots filled and committed; ``pending``, the number of new tokens
    announced by :meth:`begin` for the forward under way; and :meth:`begin` itself.

    Yours (in a subclass): :meth:`append`, :meth:`attend` and :meth:`advance`. One step::

        positions = cache.begin(num_new)        # announce num_new tokens per row
        model(ids, positions=positions, cache=cache)   # each layer calls cache.attend(...)
        cache.advance()                         # commit them

    Rows of a batch must not be padded here (the stretch exercise adds padding).
    """

    name = "exercise"

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        for label, value in (("num_layers", num_layers), ("batch", batch),
                             ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                             ("max_len", max_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{label}={value!r} must be a positive int")
        self.num_layers, self.batch, self.max_len = num_layers, batch, max_len
        self.device = torch.device(device)
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0      # slots 0 .. length-1 hold committed tokens
        self.pending = 0     # new tokens announced by begin(), committed by advance()

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCacheBase":
        """A cache shaped for ``model``, on its device and in its dtype (the factory that
        ``llmlab.cache.register`` expects)."""
        c = model.config
        return cls(c.num_layers, batch, c.num_kv_heads, c.head_dim, max_len,
                   dtype=model.dtype, device=model.device)

    def begin(self, num_new: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Announce ``num_new`` tokens per row; returns their positions [batch, num_new]."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("this cache takes unpadded rows only; a left-padded batch needs "
                             "the stretch exercise's cache")
        if not isinstance(num_new, int) or num_new < 1:
            raise ValueError(f"num_new={num_new!r} must be a positive int")
        if self.length + num_new > self.max_len:
            raise ValueError(f"{num_new} new tokens do not fit: {self.length} of max_len="
                             f"{self.max_len} slots are used")
        self.pending = num_new
        return torch.arange(self.length, self.length + num_new,
                            device=self.device).expand(self.batch, num_new)

    def append(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k, v [batch, num_new, kv_heads, head_dim] of one layer."""
        raise NotImplementedError

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               backend) -> torch.Tensor:
        """Append k, v, then attend q [batch, num_new, heads, head_dim] over every stored
        token of this layer; returns [batch, num_new, heads, head_dim]."""
        raise NotImplementedError

    def advance(self) -> None:
        """Commit the tokens announced by :meth:`begin`."""
        raise NotImplementedError


# ---- the reference cache and three realistic mistakes ------------------------------------------

class _SolutionKVCache(KVCacheBase):
    def append(self, layer_idx, k, v):
        start, end = self.length, self.length + k.shape[1]
        self.k[layer_idx][:, :, start:end] = k.transpose(1, 2)
        self.v[layer_idx][:, :, start:end] = v.transpose(1, 2)

    def attend(self, layer_idx, q, k, v, backend):
        self.append(layer_idx, k, v)
        end = self.length + k.shape[1]
        keys = self.k[layer_idx][:, :, :end].transpose(1, 2)      # [batch, end, kv_heads, d]
        values = self.v[layer_idx][:, :, :end].transpose(1, 2)
        return backend.forward(q, keys, values, causal=True)

    def advance(self):
        self.length += self.pending
        self.pending = 0


class _OverwritesSlotZero(_SolutionKVCache):
    def append(self, layer_idx, k, v):
        n = k.shape[1]
        self.k[layer_idx][:, :, :n] = k.transpose(1, 2)
        self.v[layer_idx][:, :, :n] = v.transpose(1, 2)


class _AttendsNewOnly(_SolutionKVCache):
    def attend(self, layer_idx, q, k, v, backend):
        self.append(layer_idx, k, v)
        return backend.forward(q, k, v, causal=True)


class _ForgetsAdvance(_SolutionKVCache):
    def advance(self):
        self.pending = 0


class _WrapsLibraryCache(KVCacheBase):
    """Hands every call to llmlab's own contiguous cache."""

    def __init__(self, num_layers, batch, num_kv_heads, head_dim, max_len, dtype=torch.float32,
                 device="cpu"):
        from ..cache import ContiguousKVCache

        super().__init__(num_layers, batch, num_kv_heads, head_dim, max_len, dtype, device)
        self.lib = ContiguousKVCache(num_layers, batch, num_kv_heads, head_dim, max_len,
                                     dtype=dtype, device=device)
        self.k, self.v = self.lib.k, self.lib.v

    def begin(self, num_new, attention_mask=None):
        return self.lib.begin(num_new, attention_mask)

    def attend(self, layer_idx, q, k, v, backend):
        return self.lib.attend(layer_idx, q, k, v, backend)

    def advance(self):
        self.lib.advance()
        self.length = self.lib.length


def _library_caches() -> tuple:
    """llmlab's own caches' store-and-attend: what the kv_cache build writes."""
    from ..cache.contiguous import ContiguousKVCache
    from ..cache.paged import PagedKVCache
    from ..cache.static import StaticKVCache

    return (ContiguousKVCache.attend, ContiguousKVCache.store, ContiguousKVCache.read,
            StaticKVCache.attend, PagedKVCache.attend)


# ---- the checker --------------------------------------------------------------------------------

def _slot_problem(stored: torch.Tensor, keys: torch.Tensor, end: int, newest: int) -> str | None:
    """None when slots 0..end-1 of ``stored`` [b, kv, max_len, d] hold tokens 0..end-1 of
    ``keys`` [b, n, kv, d]; else which slot holds what."""
    got = stored[:, :, :end].transpose(1, 2)
    for i in range(end):
        if torch.allclose(got[:, i], keys[:, i]):
            continue
        holds = [j for j in range(keys.shape[1]) if torch.allclose(got[:, i], keys[:, j])]
        what = (f"the keys of token {holds[0]}" if holds else
                "zeros (nothing was written there)" if not bool(got[:, i].any()) else
                "something that is no token's keys")
        msg = f"after appending token {newest}, slot {i} holds {what}; it should hold token {i}'s."
        if i == 0 and holds and holds[0] == newest:
            msg += " Each append overwrites slot 0."
        return msg
    return None


def _check_small(cls) -> Verdict | None:
    """Drive the cache by hand on small tensors: a prefill of 5, then 3 decode steps."""
    from .. import attention as A

    backend = A.get("naive")
    g = torch.Generator().manual_seed(0)
    layers, batch, heads, kv_heads, d, total = 2, 2, 4, 2, 8, 8
    qs = [torch.randn(batch, total, heads, d, generator=g) for _ in range(layers)]
    ks = [torch.randn(batch, total, kv_heads, d, generator=g) for _ in range(layers)]
    vs = [torch.randn(batch, total, kv_heads, d, generator=g) for _ in range(layers)]
    cache = cls(layers, batch, kv_heads, d, 12)
    start = 0
    for n in (5, 1, 1, 1):
        end = start + n
        step = "the prefill of 5 tokens" if n > 1 else f"the decode step of token {start}"
        cache.begin(n)
        for layer in range(layers):
            q, k, v = qs[layer][:, start:end], ks[layer][:, start:end], vs[layer][:, start:end]
            out = cache.attend(layer, q, k, v, backend)
            stored = getattr(cache, "k", None)
            if isinstance(stored, list) and len(stored) == layers:
                problem = _slot_problem(stored[layer], ks[layer], end, end - 1)
                if problem:
                    return wrong(f"in {step}: {problem}",
                                 "append writes the new tokens at slots [self.length, "
                                 "self.length + num_new) of self.k[layer] and self.v[layer], "
                                 "laid out [batch, kv_heads, max_len, head_dim].")
            want = backend.forward(q, ks[layer][:, :end], vs[layer][:, :end], causal=True)
            problem = compare_tensors(out, want, f"the output of {step} (layer {layer})", 1e-5)
            if problem:
                if isinstance(out, torch.Tensor) and out.shape == want.shape and torch.allclose(
                        out, backend.forward(q, k, v, causal=True), atol=1e-5):
                    return wrong(f"in {step}: your output equals attention over only the new "
                                 f"token{'s' if n > 1 else ''}: the query must also see the "
                                 f"{start} tokens stored before.",
                                 "attend over slots [0, self.length + num_new) of the cache, "
                                 "not over the k, v passed in.")
                return wrong(problem, "backend.forward(q, keys, values, causal=True) with keys "
                                      "and values read from the cache as [batch, seq, kv_heads, "
                                      "head_dim] (transpose(1, 2)).")
        cache.advance()
        if cache.length != end:
            return wrong(f"after {step} and advance(), cache.length is {cache.length}; it should "
                         f"be {end}. The next tokens would get the wrong positions and overwrite "
                         "the stored ones.",
                         "advance() must add the announced tokens (self.pending) to self.length.")
        start = end
    return None


@functools.lru_cache(maxsize=2)
def _reference_tokens(prompts: tuple[tuple[int, ...], ...], new_tokens: int):
    """Greedy tokens (and the per-token arrival times) of SmolLM2 without a cache."""
    from ..generate import generate
    from .nb01 import smollm2

    model, tok = smollm2()
    model.set_attention("sdpa")
    try:
        gens = generate(model, tok, [list(p) for p in prompts], max_new_tokens=new_tokens,
                        ignore_eos=True)
    finally:
        model.set_attention("naive")
    return [g.token_ids for g in gens], gens[0].token_times_s


def _generate_with(cls, prompts: list[list[int]], new_tokens: int):
    """Generate with ``cls`` registered as a cache; returns (generations, positions per step)."""
    from .. import cache as kv_caches
    from ..generate import generate
    from .nb01 import smollm2

    model, tok = smollm2()
    name = "nb02-yours"
    kv_caches.register(name, cls.for_model)
    fed = []
    hook = model.layers[0].register_forward_pre_hook(lambda mod, args: fed.append(args[0].shape[1]))
    model.set_attention("sdpa")
    try:
        gens = generate(model, tok, prompts, max_new_tokens=new_tokens, ignore_eos=True,
                        kv_cache=name)
    finally:
        hook.remove()
        model.set_attention("naive")
        kv_caches.unregister(name)
    return gens, fed


def _step_ratio(times_s: list[float], window: int) -> tuple[float, float, float]:
    """Median step time of the first ``window`` decode steps and of the last ``window``."""
    steps = [b - a for a, b in zip(times_s, times_s[1:])]   # steps[0]: the first decode step
    early, late = statistics.median(steps[:window]), statistics.median(steps[-window:])
    return early, late, late / early


def _check_generation(cls, prompts: list[list[int]], new_tokens: int):
    """-> (a failing verdict or None, the generations, positions fed per step)."""
    ref_tokens, _ = _reference_tokens(tuple(tuple(p) for p in prompts), new_tokens)
    gens, fed = _generate_with(cls, prompts, new_tokens)
    for i, (g, want) in enumerate(zip(gens, ref_tokens)):
        diff = first_token_difference(g.token_ids, want)
        if diff:
            row = f"prompt {i}: " if len(prompts) > 1 else ""
            return wrong(f"the small cases pass, but llmlab.generate with your cache differs "
                         f"from kv_cache=\"none\": {row}{diff}",
                         "run generate(..., kv_cache=...) by hand and compare the texts."), gens, fed
    return None, gens, fed


NEW_TOKENS = 32
WINDOW = 6


@exercise("nb02.kv_cache", notebook=NOTEBOOK, kind="build",
          title="kv_cache: append, attend over the cached keys, advance; "
                "generate gives the no-cache tokens",
          solution=_SolutionKVCache,
          wrong_variants={"append overwrites slot 0": (_OverwritesSlotZero, ("slot 0",)),
                          "attends only to the new token": (_AttendsNewOnly, ("only the new",)),
                          "forgets to advance length": (_ForgetsAdvance, ("advance", "length")),
                          "wraps llmlab's cache": (_WrapsLibraryCache, ("llmlab's own",))})
def _check_kv_cache(cls, **_) -> Verdict:
    from . import forbid
    from .nb01 import smollm2

    if not isinstance(cls, type):
        return wrong(f"expected your cache class (e.g. MyKVCache), got {type(cls).__name__}.",
                     "pass the class itself, not an instance: exercises.check(..., MyKVCache).")
    with forbid(*_library_caches()):
        verdict = _check_small(cls)
    if verdict is not None:
        return verdict
    _, tok = smollm2()
    prompt = tok(PROMPT)["input_ids"]
    _reference_tokens((tuple(prompt),), NEW_TOKENS)       # with llmlab's caches on
    with forbid(*_library_caches()):
        verdict, gens, fed = _check_generation(cls, [prompt], NEW_TOKENS)
    if verdict is not None:
        return verdict
    # What the model computed per step (counted at its first layer), and how long a step took
    # early and late in the generation (medians of WINDOW steps each).
    early, late, ratio = _step_ratio(gens[0].token_times_s, WINDOW)
    if ratio > 4:      # a loaded machine can spike; measure once more before saying "grows"
        with forbid(*_library_caches()):
            gens, fed = _generate_with(cls, [prompt], NEW_TOKENS)
        early, late, ratio = _step_ratio(gens[0].token_times_s, WINDOW)
        if ratio > 4:
            return wrong(f"the tokens are right, but a decode step takes {late * 1e3:.0f} ms "
                         f"late in the generation against {early * 1e3:.0f} ms early "
                         f"({ratio:.1f}×): your cache's cost grows with the length.",
                         "write into the preallocated tensors in place (no torch.cat) and read "
                         "only slots [0, self.length + num_new).")
    p = len(prompt)
    no_cache = sum(p + t for t in range(NEW_TOKENS))
    trend = "flat" if ratio < 1.5 else "this machine's timing is noisy; the positions count"
    return right(f"{NEW_TOKENS} greedy tokens identical to kv_cache=\"none\". The model computed "
                 f"{sum(fed)} token positions ({fed[0]} for the prompt, then "
                 f"{'/'.join(str(n) for n in sorted(set(fed[1:])))} per step) where the no-cache "
                 f"loop computes {no_cache} ({no_cache / sum(fed):.0f}× more). A decode step "
                 f"took {early * 1e3:.0f} ms (median) with {p + 1}–{p + WINDOW} tokens in the "
                 f"sequence and {late * 1e3:.0f} ms with {p + NEW_TOKENS - WINDOW}–"
                 f"{p + NEW_TOKENS - 1}: {ratio:.2f}× ({trend}).")


# ---- build: the generation loop around the cache -------------------------------------------------

def _solution_decode_loop(model, prompt_ids, max_new_tokens, cache_cls):
    """Greedy generation with a KV cache: the prompt once, then one new token per step."""
    device = model.device
    cache = cache_cls.for_model(model, batch=1, max_len=len(prompt_ids) + max_new_tokens)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    positions = cache.begin(ids.shape[1])                 # prefill: every prompt token, once
    logits = model(ids, positions=positions, cache=cache, last_only=True)
    cache.advance()
    new_tokens = []
    while True:
        token = int(logits[0, -1].argmax())
        new_tokens.append(token)
        if len(new_tokens) == max_new_tokens:
            return new_tokens
        ids = torch.tensor([[token]], dtype=torch.long, device=device)   # decode: the newest only
        positions = cache.begin(1)
        logits = model(ids, positions=positions, cache=cache, last_only=True)
        cache.advance()


def _loop_refeeds_everything(model, prompt_ids, max_new_tokens, cache_cls):
    """No cache at all: every step runs the model over prompt + everything generated."""
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([tokens], device=model.device), last_only=True)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt_ids):]


def _loop_fresh_cache_each_step(model, prompt_ids, max_new_tokens, cache_cls):
    """A cache, but a new one every step, filled from scratch: the same as no cache."""
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        cache = cache_cls.for_model(model, batch=1, max_len=len(tokens))
        positions = cache.begin(len(tokens))
        logits = model(torch.tensor([tokens], device=model.device), positions=positions,
                       cache=cache, last_only=True)
        cache.advance()
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt_ids):]


def _loop_off_by_one(model, prompt_ids, max_new_tokens, cache_cls):
    """Counts its own positions, one too far: the first new token goes to len(prompt) + 1."""
    n = len(prompt_ids)
    cache = cache_cls.for_model(model, batch=1, max_len=n + max_new_tokens)
    logits = model(torch.tensor([prompt_ids], device=model.device),
                   positions=cache.begin(n), cache=cache, last_only=True)
    cache.advance()
    new_tokens = []
    for step in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        new_tokens.append(token)
        cache.begin(1)
        positions = torch.tensor([[n + step + 1]], device=model.device)
        logits = model(torch.tensor([[token]], device=model.device), positions=positions,
                       cache=cache, last_only=True)
        cache.advance()
    return new_tokens


def _loop_feeds_last_prompt_token(model, prompt_ids, max_new_tokens, cache_cls):
    """Forgets to append: every decode step feeds the prompt's last token again."""
    ids = torch.tensor([prompt_ids], device=model.device)
    cache = cache_cls.for_model(model, batch=1, max_len=ids.shape[1] + max_new_tokens)
    logits = model(ids, positions=cache.begin(ids.shape[1]), cache=cache, last_only=True)
    cache.advance()
    new_tokens = []
    for _ in range(max_new_tokens):
        new_tokens.append(int(logits[0, -1].argmax()))
        logits = model(ids[:, -1:], positions=cache.begin(1), cache=cache, last_only=True)
        cache.advance()
    return new_tokens


def _loop_prompt_token_by_token(model, prompt_ids, max_new_tokens, cache_cls):
    """Feeds the prompt one token per forward, as if it were being generated."""
    cache = cache_cls.for_model(model, batch=1, max_len=len(prompt_ids) + max_new_tokens)
    new_tokens, fed = [], list(prompt_ids)
    while len(new_tokens) < max_new_tokens:
        token = fed.pop(0) if fed else new_tokens[-1]
        logits = model(torch.tensor([[token]], device=model.device), positions=cache.begin(1),
                       cache=cache, last_only=True)
        cache.advance()
        if not fed:
            new_tokens.append(int(logits[0, -1].argmax()))
    return new_tokens


def _loop_wraps_library(model, prompt_ids, max_new_tokens, cache_cls):
    from ..generate import generate_token_ids

    return generate_token_ids(model, [list(prompt_ids)], max_new_tokens, ignore_eos=True,
                              kv_cache="contiguous")[0].token_ids


def _library_decode_loops() -> tuple:
    """llmlab's own generation loops and their per-cache feeders: what the build writes."""
    import importlib
    import inspect

    G = importlib.import_module("llmlab.generate")    # the module (llmlab.generate is the function)
    from ..engine.llm import LLM, LLMEngine
    from ..speculative import speculative_token_ids

    fns = [G.generate, G.generate_token_ids, G.generate_paged, speculative_token_ids,
           LLM.generate, LLMEngine.step]
    fns += [inspect.unwrap(f) for f in fns if inspect.unwrap(f) is not f]
    for cls in (G.RecomputeBatch, G.ContiguousBatch, G.PagedBatch):
        fns += [cls.prefill, cls.decode]
    return tuple(fns)


class _Fed:
    """What the model was fed, forward by forward (hooks on the embedding, the first layer
    and the vocabulary projection, so model(...) and model.step(...) are both seen)."""

    def __init__(self, model):
        self.ids, self.positions, self.cached, self.logits = [], [], [], []
        self.hooks = [
            model.embed_tokens.register_forward_pre_hook(
                lambda mod, args: self.ids.append(args[0].detach().cpu().clone())),
            model.layers[0].register_forward_pre_hook(self._layer),
            model.lm_head.register_forward_hook(
                lambda mod, args, out: self.logits.append(
                    out.detach().reshape(-1, out.shape[-1])[-1].float().cpu()))]

    def _layer(self, mod, args):
        self.positions.append(args[1].detach().cpu().clone())
        self.cached.append(len(args) > 2 and args[2] is not None)

    def remove(self):
        for h in self.hooks:
            h.remove()


DECODE_TOKENS = NEW_TOKENS     # the kv_cache check's reference serves this one too


@functools.lru_cache(maxsize=1)
def _reference_logits(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> torch.Tensor:
    """Logits [len(tokens), vocab] that predicted each token, from one no-cache forward."""
    from .nb01 import smollm2

    model, _ = smollm2()
    model.set_attention("sdpa")
    try:
        with torch.inference_mode():
            ids = torch.tensor([list(prompt) + list(tokens[:-1])], device=model.device)
            logits = model(ids)[0, len(prompt) - 1:].float().cpu()
    finally:
        model.set_attention("naive")
    return logits


@exercise("nb02.decode_loop", notebook=NOTEBOOK, kind="build",
          title="decode_loop: prefill the prompt once, then one token per step through your "
                "cache; greedy tokens equal llmlab.generate's",
          solution=_solution_decode_loop,
          wrong_variants={
              "re-feeds the whole sequence each step": (_loop_refeeds_everything,
                                                         ("whole sequence",)),
              "a fresh cache every step": (_loop_fresh_cache_each_step, ("whole sequence",)),
              "positions off by one": (_loop_off_by_one, ("position",)),
              "forgets to append the new token": (_loop_feeds_last_prompt_token, ("newest",)),
              "prompt fed token by token": (_loop_prompt_token_by_token, ("prefill",)),
              "wraps llmlab's generate": (_loop_wraps_library, ("llmlab's own",))})
def _check_decode_loop(fn, cache_cls=None, **_) -> Verdict:
    from . import forbid
    from .nb01 import smollm2

    if not callable(fn):
        return wrong(f"expected your function decode_loop, got {type(fn).__name__}.",
                     "pass the function itself: exercises.check(\"nb02.decode_loop\", "
                     "decode_loop, cache_cls=MyKVCache).")
    if cache_cls is None:
        cache_cls = _SolutionKVCache
    elif not isinstance(cache_cls, type) or not hasattr(cache_cls, "for_model"):
        return wrong(f"cache_cls should be your cache class (e.g. MyKVCache), got "
                     f"{cache_cls!r}.", "pass the class itself: cache_cls=MyKVCache.")
    elif issubclass(cache_cls, KVCacheBase):
        problem = _check_small(cache_cls)
        if problem is not None:
            return wrong(f"your cache fails before the loop runs: {problem.message} Finish "
                         "MyKVCache first (its check is above), or check the loop with llmlab's "
                         "cache: cache_cls=llmlab.cache.ContiguousKVCache.")
    model, tok = smollm2()
    prompt = tok(PROMPT)["input_ids"]
    p, n = len(prompt), DECODE_TOKENS
    model.set_attention("sdpa")
    fed = _Fed(model)
    try:
        with torch.inference_mode(), forbid(*_library_decode_loops()):
            got = fn(model, list(prompt), n, cache_cls)
    finally:
        fed.remove()
        model.set_attention("naive")
    # the references, with llmlab's loops on again: llmlab.generate without a cache
    (want,), _ = _reference_tokens((tuple(prompt),), n)
    if isinstance(got, torch.Tensor):
        got = got.flatten().tolist()
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, int) for t in got):
        return wrong(f"decode_loop should return a list of {n} token ids (ints), got "
                     f"{type(got).__name__}.", "collect int(logits[0, -1].argmax()) per step.")
    calls = len(fed.ids)
    sizes = [int(ids.shape[-1]) for ids in fed.ids]
    if calls == 0:
        return wrong("your loop never ran the model.", "call model(ids, positions=..., "
                     "cache=..., last_only=True).")
    if not fed.cached[0]:
        return wrong(f"your loop runs the model without a cache: each step feeds the whole "
                     f"sequence ({sizes[0]}, {sizes[1] if calls > 1 else '…'}, … tokens), so "
                     f"it computes {sum(sizes)} token positions for {n} tokens.",
                     "make one cache with cache_cls.for_model(model, batch=1, max_len=...) and "
                     "pass it to every forward.")
    if sizes[0] != p:
        if sizes[0] == 1 and calls >= p:
            return wrong(f"your loop feeds the {p}-token prompt one token per forward ({calls} "
                         "forwards in all): the prefill should take the whole prompt in one "
                         "forward, which is what makes the prompt cheap.",
                         "first forward: all prompt ids, positions = cache.begin(len(prompt)).")
        return wrong(f"the first forward fed {sizes[0]} tokens; the prefill feeds the whole "
                     f"{p}-token prompt at once.", "positions = cache.begin(len(prompt_ids)).")
    for step, (size, ids) in enumerate(zip(sizes[1:], fed.ids[1:]), start=1):
        if size > 1:
            return wrong(f"decode step {step} fed {size} tokens to the model: your loop "
                         f"re-feeds the whole sequence each step ({sum(sizes)} token positions "
                         f"in all, against {p + calls - 1} with one token per step). The cache "
                         "already holds the keys and values of every token before.",
                         "after the prefill, feed only the newest token, ids of shape [1, 1].")
    if calls < n:
        return wrong(f"your loop ran the model {calls} times for {n} tokens.",
                     f"one prefill, then one forward per new token: {n - 1} decode steps "
                     "(the last token needs none).")
    for step in range(1, min(calls, len(got) + 1)):
        pos = int(fed.positions[step].flatten()[-1])
        if pos != p + step - 1:
            return wrong(f"decode step {step} fed its token at position {pos}; it is token "
                         f"{p + step - 1} of the sequence (the {p}-token prompt holds positions "
                         f"0…{p - 1}), so its position is {p + step - 1}. A wrong position "
                         "rotates its query and key by the wrong angle.",
                         "use the positions cache.begin(1) returns.")
        token = int(fed.ids[step].flatten()[-1])
        if step <= len(got) and token != got[step - 1]:
            return wrong(f"decode step {step} fed token {token}, but the token your loop chose "
                         f"the step before is {got[step - 1]}: feed the newest token, the one "
                         "just generated.", "ids = torch.tensor([[token]]) with the token "
                         "you just appended.")
    if calls > n + 1:
        return wrong(f"your loop ran the model {calls} times for {n} tokens.",
                     "stop once max_new_tokens tokens are generated.")
    diff = first_token_difference(got, want)
    if diff:
        return wrong(f"your greedy tokens differ from llmlab.generate's: {diff}",
                     "take the argmax of the last position's logits each step.")
    ref_logits = _reference_logits(tuple(prompt), tuple(want))
    err = float((torch.stack(fed.logits[:n]) - ref_logits).abs().max())
    if err > 1e-3:
        return wrong(f"the tokens match, but the logits differ from a no-cache forward by "
                     f"up to {err:.2g}.", "check the positions and the cache.")
    no_cache = sum(p + t for t in range(n))
    return right(f"{n} greedy tokens identical to llmlab.generate (no cache); the logits of "
                 f"every step match a no-cache forward within {err:.1e}. The model computed "
                 f"{sum(sizes)} token positions ({p} for the prompt, then one per step) where "
                 f"re-running the whole sequence computes {no_cache} "
                 f"({no_cache / sum(sizes):.1f}× more).")


# ---- compute: the roofline -----------------------------------------------------------

def smallest_compute_bound_batch(config: ModelConfig, context: int, ridge_point: float,
                                 bytes_per_el: int = 4, max_batch: int = 4096) -> int | None:
    """The smallest batch whose decode step has intensity >= ``ridge_point`` (None: never)."""
    from ..profiling.roofline import decode_cost

    for b in range(1, max_batch + 1):
        if decode_cost(config, b, context, bytes_per_el).intensity >= ridge_point:
            return b
    return None


@functools.lru_cache(maxsize=1)
def _smollm2_config() -> ModelConfig:
    from ..models.registry import model_dir

    return ModelConfig.from_file(model_dir("smollm2-135m"))


@exercise("nb02.compute_bound_batch", notebook=NOTEBOOK, kind="compute",
          title="the smallest batch at which a SmolLM2 decode step (512 cached tokens) "
                "reaches a ridge point of 10 FLOP/byte",
          solution=101,
          wrong_variants={"batch / 2 guess": (20, ("ignores the KV cache",)),
                          "one too small": (100, ("too small",))})
def _check_compute_bound_batch(answer, config: ModelConfig | None = None, context: int = 512,
                               ridge_point: float = 10.0, **_) -> Verdict:
    config = config or _smollm2_config()
    expected = smallest_compute_bound_batch(config, context, ridge_point)
    if isinstance(answer, bool) or not isinstance(answer, int):
        return wrong(f"expected an int batch size, got {answer!r}.",
                     "loop over batch sizes with decode_cost(cfg, batch, 512).intensity.")
    if answer == expected:
        return right(f"batch {expected}: each weight byte is reused by {expected} tokens, but "
                     "every sequence also reads its own KV cache, so the intensity saturates "
                     "instead of growing forever.")
    if answer == int(2 * ridge_point):
        return wrong(f"{answer} is the batch/2 guess, which ignores the KV cache each sequence "
                     "reads.", "use decode_cost(config, batch, context).intensity.")
    direction = "too small" if answer < expected else "not the smallest"
    return wrong(f"batch {answer} is {direction}.",
                 "loop over batch sizes with llmlab.profiling.roofline.decode_cost(config, "
                 "batch, context).intensity.")


# ---- predict: a decode step at batch 16 ---------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _measured_batch_ratio() -> float:
    from .nb01 import smollm2

    from ..viz.baseline import cached_step_times

    model, _ = smollm2()
    model.set_attention("sdpa")
    try:
        one, sixteen = (cached_step_times(model, [129], batch=b)[0].median_s for b in (1, 16))
    finally:
        model.set_attention("naive")
    return sixteen / one


def _modelled_batch_bytes_ratio(batch: int = 16, context: int = 128) -> float:
    """The roofline model's bytes of a decode step at ``batch`` over those at batch 1: the
    weights once either way, plus every sequence's own KV cache and activations."""
    from ..profiling.roofline import decode_cost

    cfg = _smollm2_config()
    return decode_cost(cfg, batch, context).bytes / decode_cost(cfg, 1, context).bytes


BATCH_TOLERANCE = 2.0   # a prediction within this factor of the measured ratio passes


@exercise("nb02.predict_batch_decode", notebook=NOTEBOOK, kind="predict",
          title="predict: the step time of a decode step for 16 sequences over that for 1 "
                "(128 cached tokens each)",
          solution=2.0,
          wrong_variants={"16x: a weight read per sequence": (16.0, ("own weight read",
                                                                     "measured")),
                          "the time per token, not per step": (1 / 16, ("per token",
                                                                        "measured"))})
def _check_predict_batch_decode(answer, measured: float | None = None, batch: int = 16,
                                **_) -> Verdict:
    """``answer``: step(batch) / step(1); ``measured``: that ratio from the notebook's run
    (without it the check times SmolLM2 itself at batch 16)."""
    if measured is None:
        measured, batch = _measured_batch_ratio(), 16
    measured = float(measured)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not (
            math.isfinite(answer) and answer > 0):
        return wrong(f"the prediction should be a positive number (a ratio of step times), got "
                     f"{answer!r}.", "e.g. 3.0 if you expect the batch-16 step to take 3× as long.")
    said = f"measured here: the batch-{batch} step takes {measured:.2f}× the batch-1 step"
    why = (f"A decode step at batch 1 streams all of SmolLM2's ~540 MB of float32 weights to do "
           f"2 FLOPs per weight; at batch {batch} it streams them once and uses each for "
           f"{batch} tokens, so the step costs far less than {batch} single steps: decode is "
           "memory-bound, and batching is how a server fills the idle arithmetic.")
    if measured >= 0.5 * batch:
        why = ("On this run the step grew almost with the batch, which a memory-bound step "
               "does not do: the machine was probably busy while it was timed (rerun the "
               "cell), or this step is past its ridge point here.")
    proportional = answer >= 0.6 * batch
    faster = answer < 1 and answer < measured / 1.25    # batch 16 quicker than batch 1
    if max(answer / measured, measured / answer) <= BATCH_TOLERANCE and not (
            (proportional and measured < 0.5 * batch) or faster):
        return right(f"you predicted {answer:g}×; {said}. {why}")
    if proportional:
        problem = (f"{answer:g}× would mean each sequence needs its own weight read, as if the "
                   f"{batch} sequences ran one after another. The weights are read once per "
                   f"step and each is used for all {batch} tokens; what each sequence adds is "
                   "its own KV cache and activations, a small share of the bytes.")
    elif faster:
        problem = (f"below 1 the step for {batch} sequences would be faster than the step for "
                   "one. That is the time per token, which does fall with the batch (the "
                   f"{batch} tokens share one pass over the weights); the step itself does "
                   f"{batch}× the FLOPs and reads the same weights, so it cannot take less time.")
    elif answer <= 1.05 and measured > answer:
        problem = (f"{answer:g}× would make the other {batch - 1} sequences free. They are "
                   "cheap, not free: each reads its own KV cache and activations, and the step "
                   f"does {batch}× the FLOPs, which the idle arithmetic absorbs only in part.")
    elif abs(answer - _modelled_batch_bytes_ratio(batch)) <= 0.15 * answer and measured > answer:
        problem = (f"{answer:g}× is what the bytes alone predict (the weights once, plus "
                   f"{batch} KV caches: {_modelled_batch_bytes_ratio(batch):.2f}× the bytes of "
                   "batch 1). The step costs more than its bytes here: with more rows the matrix "
                   "library leaves its matrix-vector routine for others that read the same bytes "
                   "more slowly (the batch sweep below shows where).")
    else:
        problem = (f"you predicted {answer:g}×, {answer / measured:.2f} times the measured "
                   "ratio.")
    return wrong(f"{said}; {problem} {why}",
                 "at batch 1, what does a decode step spend its time on, and how much of it "
                 f"does batch {batch} repeat?")


# ---- predict: the intensity of a decode step --------------------------------------------------

def _modelled_decode_intensity() -> float:
    """The roofline model's FLOPs per byte of a SmolLM2 decode step: batch 1, 128 cached
    tokens, float32."""
    from ..profiling.roofline import decode_cost

    return decode_cost(_smollm2_config(), 1, 128).intensity


def _prefill_intensity() -> float:
    from ..profiling.roofline import prefill_cost

    return prefill_cost(_smollm2_config(), 1, 128).intensity


@exercise("nb02.predict_decode_intensity", notebook=NOTEBOOK, kind="predict", solution=0.5,
          title="predict: the FLOPs per byte of a batch-1 decode step in float32",
          wrong_variants={"per weight, not per byte": (2.0, ("4 bytes",)),
                          "bfloat16's bytes": (1.0, ("float32",)),
                          "a multiply-add as one FLOP": (0.25, ("two FLOPs",)),
                          "the prefill's": (39.0, ("prefill",))})
def _check_predict_decode_intensity(answer, measured: float | None = None, **_) -> Verdict:
    """``answer``: FLOP/byte; ``measured``: the roofline model's value the notebook prints."""
    want = _modelled_decode_intensity() if measured is None else float(measured)
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not answer > 0:
        return wrong(f"expected a positive number of FLOPs per byte, got {answer!r}.",
                     "take one weight: how many bytes are read for it, how many FLOPs use it?")
    if abs(answer - want) <= 0.2 * want:
        return right(f"the model gives {want:.2f} FLOP/byte. Each float32 weight (4 bytes) is "
                     "read once per step and used for one multiply and one add with the one "
                     "token's activation: 2 FLOPs per 4 bytes. The activations, the norms and the "
                     "KV cache move the model's value a little off 0.5.")
    ratio = answer / want
    if 3 < ratio < 5:
        why = ("that counts FLOPs per weight, not per byte: in float32 a weight is 4 bytes, "
               "so its 2 FLOPs are spread over 4 bytes.")
    elif 1.6 < ratio <= 3:
        why = ("that would be bfloat16's 2 bytes per weight; this step runs in float32, 4 bytes "
               "per weight.")
    elif 0.35 < ratio < 0.65:
        why = ("a multiply and an add are two FLOPs (a fused multiply-add counts as two), and "
               "each weight gets both.")
    elif answer >= 0.5 * _prefill_intensity():
        why = (f"that is near a prefill's {_prefill_intensity():.0f} FLOP/byte: a prefill "
               "reuses each weight for every prompt token, a decode step for one token only. "
               "Intensity belongs to the computation, not to the model.")
    else:
        why = f"{answer:g} is {ratio:.2f}× the model's value."
    return wrong(f"the model gives {want:.2f} FLOP/byte; {why}",
                 "take one weight: bytes read for it, FLOPs done with it, at batch 1.")


# ---- stretch: a cache for left-padded batches ----------------------------------------------------

class _SolutionPaddedKVCache(_SolutionKVCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_padding_mask = torch.zeros(self.batch, self.max_len, dtype=torch.bool,
                                            device=self.device)
        self.real_lengths = torch.zeros(self.batch, dtype=torch.long, device=self.device)

    def begin(self, num_new, attention_mask=None):
        if self.length + num_new > self.max_len:
            raise ValueError(f"{num_new} new tokens do not fit in max_len={self.max_len}")
        real = (torch.ones(self.batch, num_new, dtype=torch.bool, device=self.device)
                if attention_mask is None else attention_mask.to(torch.bool))
        self.key_padding_mask[:, self.length:self.length + num_new] = real
        self.pending = num_new
        # positions count real tokens only, so a padded row's first real token is position 0
        return (self.real_lengths[:, None] + real.long().cumsum(-1) - 1).clamp_min(0)

    def attend(self, layer_idx, q, k, v, backend):
        self.append(layer_idx, k, v)
        end = self.length + k.shape[1]
        keys = self.k[layer_idx][:, :, :end].transpose(1, 2)
        values = self.v[layer_idx][:, :, :end].transpose(1, 2)
        return backend.forward(q, keys, values, causal=True,
                               key_padding_mask=self.key_padding_mask[:, :end])

    def advance(self):
        new = self.key_padding_mask[:, self.length:self.length + self.pending]
        self.real_lengths += new.sum(-1)
        super().advance()


class _PaddedCountsPads(_SolutionPaddedKVCache):
    def begin(self, num_new, attention_mask=None):
        super().begin(num_new, attention_mask)
        return torch.arange(self.length, self.length + num_new).expand(self.batch, num_new)


class _PaddedNoMask(_SolutionPaddedKVCache):
    def attend(self, layer_idx, q, k, v, backend):
        return _SolutionKVCache.attend(self, layer_idx, q, k, v, backend)


@exercise("nb02.padded_kv_cache", notebook=NOTEBOOK, kind="build", stretch=True,
          title="stretch: a KV cache for a left-padded batch (begin with an attention mask)",
          solution=_SolutionPaddedKVCache,
          wrong_variants={"positions count the padding": (_PaddedCountsPads, ("positions",)),
                          "no key-padding mask": (_PaddedNoMask, ("padding",))})
def _check_padded_kv_cache(cls, **_) -> Verdict:
    from .. import attention as A

    if not isinstance(cls, type):
        return wrong(f"expected your cache class, got {type(cls).__name__}.",
                     "pass the class itself.")
    backend = A.get("naive")
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, d, total = 2, 4, 2, 8, 7
    q = torch.randn(batch, total, heads, d, generator=g)
    k = torch.randn(batch, total, kv_heads, d, generator=g)
    v = torch.randn(batch, total, kv_heads, d, generator=g)
    mask = torch.ones(batch, total, dtype=torch.bool)
    mask[0, :2] = False                                   # row 0: 2 pads, then 3 prompt tokens
    cache = cls(1, batch, kv_heads, d, total)
    start = 0
    for n in (5, 1, 1):
        end = start + n
        positions = cache.begin(n, mask[:, start:end] if n > 1 else None)
        want_pos = (mask[:, :end].long().cumsum(-1) - 1).clamp_min(0)[:, start:end]
        if not isinstance(positions, torch.Tensor) or not torch.equal(positions.cpu(), want_pos):
            return wrong(f"begin({n}) returned positions {positions.tolist() if isinstance(positions, torch.Tensor) else positions}, "
                         f"expected {want_pos.tolist()}: positions count real tokens only, so "
                         "row 0's first real token (after 2 pads) is position 0.",
                         "keep a per-row count of real tokens; positions = count + "
                         "cumsum(mask) − 1.")
        out = cache.attend(0, q[:, start:end], k[:, start:end], v[:, start:end], backend)
        want = backend.forward(q[:, start:end], k[:, :end], v[:, :end], causal=True,
                               key_padding_mask=mask[:, :end])
        real = mask[:, start:end]
        problem = compare_tensors(out[real] if isinstance(out, torch.Tensor) else out,
                                  want[real], f"the output of the real queries after {end} "
                                  "tokens", 1e-5)
        if problem:
            return wrong(f"{problem} Row 0's queries must not see its 2 padding keys.",
                         "remember which slots are padding (a [batch, max_len] bool mask) and "
                         "pass key_padding_mask=mask[:, :end] to backend.forward.")
        cache.advance()
        start = end
    from .nb01 import smollm2

    _, tok = smollm2()
    prompts = [tok("Name a planet.")["input_ids"], tok(PROMPT + " in Europe")["input_ids"]]
    verdict, _, _ = _check_generation(cls, prompts, 12)
    if verdict is not None:
        return verdict
    return right(f"a left-padded batch of prompts of {len(prompts[0])} and {len(prompts[1])} "
                 "tokens generates, with your cache, exactly the tokens each gets without one.")
