"""The generator: the no-cache baseline, or prefill + decode with a KV cache.

Without a cache (``kv_cache="none"``, the default) each new token costs a full forward
pass over prompt + everything generated so far, so generating T tokens costs O(T²)
token-passes: the textbook loop (notebook 01). With ``kv_cache="contiguous"`` the prompt
runs once and each later token costs one token-pass (notebook 02); ``kv_cache="paged"``
keeps K/V in blocks of a shared pool (notebook 04).

One loop drives every cache (:func:`generate_token_ids`): sample a token per sequence,
check whether it stops, feed the survivors. What differs is how a batch is fed to the
model, one small class per cache (:class:`RecomputeBatch`, :class:`ContiguousBatch`,
:class:`PagedBatch`). The sampler (:func:`llmlab.sampling.sample_rows`) and the stopping
rule (:mod:`llmlab.stopping`) are the serving engine's too, so a prompt gets the same
tokens on every path, alone or batched with longer ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import attention as attn_backends
from . import cache as kv_caches
from .cache.contiguous import check_kv_dtype
from .cache.paged import PagedKVCache, blocks_needed
from .device import sync
from .profiling.metrics import RequestMetrics
# The prompt helpers and the sampler are leaf modules; re-exported here because
# ``from llmlab.generate import encode_prompts, left_pad`` is how notebooks reach them.
from .prompts import Generation, check_token_ids, encode_prompts, left_pad, prepare_prompts
from .sampling import apply_penalties, check_penalties, has_penalties, sample_rows
from .speculative import SpeculativeConfig, speculative_token_ids
from .stopping import finish_reason, token_budget

__all__ = ["generate", "generate_token_ids", "generate_paged", "Generation", "TokenRun",
           "RecomputeBatch", "ContiguousBatch", "PagedBatch", "check_token_ids",
           "encode_prompts", "left_pad", "prepare_prompts"]


# -- how each cache feeds a batch to the model --------------------------------------------
#
# One class per cache, all with the same four methods, so that one loop drives them all:
#   prefill() -> logits [batch, vocab] after each prompt
#   decode(rows, tokens) -> logits [len(rows), vocab]: feed each row its newest token
#   release(row): that sequence is finished       close(): the generation is over
# and ``num_cached``: per prompt, the tokens a cache already held (only the paged one has any).


def _next_column(batch: int, rows: list[int], tokens: list[int], pad_token_id: int,
                 device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next token of every row, [batch, 1], and which are real, [batch, 1] bool (None
    when all are): a finished row keeps its place in the rectangle with a masked pad."""
    ids = torch.full((batch, 1), pad_token_id, dtype=torch.long)
    ids[rows, 0] = torch.tensor(tokens, dtype=torch.long)
    if len(rows) == batch:
        return ids.to(device), None
    real = torch.zeros((batch, 1), dtype=torch.bool)
    real[rows, 0] = True
    return ids.to(device), real.to(device)


class RecomputeBatch:
    """No KV cache (the baseline, notebook 01): every step runs the model over the whole
    left-padded sequences, prompt and every generated token, and keeps the last logits."""

    def __init__(self, model, prompts: list[list[int]], pad_token_id: int):
        self.model, self.pad_token_id = model, pad_token_id
        self.ids, self.mask = left_pad(prompts, pad_token_id, model.device)
        self.num_cached = [0] * len(prompts)      # prompt tokens found in a cache: none

    def _forward(self) -> torch.Tensor:
        return self.model(self.ids, attention_mask=self.mask, last_only=True)[:, -1]

    def prefill(self) -> torch.Tensor:
        return self._forward()

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        new, real = _next_column(len(self.ids), rows, tokens, self.pad_token_id, self.model.device)
        self.ids = torch.cat([self.ids, new], dim=1)
        self.mask = torch.cat([self.mask, torch.ones_like(new) if real is None else real.long()],
                              dim=1)
        return self._forward()[rows]          # the whole sequences again: O(length) per token

    def release(self, row: int) -> None:
        pass

    def close(self) -> None:
        pass


class ContiguousBatch:
    """A contiguous KV cache (notebook 02), or any cache with its ``begin``/``advance``
    protocol: the prompts run once, then each step feeds one token per row."""

    def __init__(self, model, prompts: list[list[int]], pad_token_id: int, max_new: int,
                 kv_cache: str = "contiguous", kv_dtype: str = "auto", step=None):
        self.model, self.pad_token_id, self.step = model, pad_token_id, step
        self.ids, mask = left_pad(prompts, pad_token_id, model.device)
        self.mask = None if bool(mask.all()) else mask
        options = {} if kv_dtype == "auto" else {"kv_dtype": kv_dtype}
        self.cache = kv_caches.create(kv_cache, model, len(prompts), self.ids.shape[1] + max_new,
                                      **options)
        self.num_cached = [0] * len(prompts)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        positions = self.cache.begin(ids.shape[1], mask)
        logits = self.model(ids, positions=positions, cache=self.cache, last_only=True)[:, -1]
        self.cache.advance()
        return logits

    def prefill(self) -> torch.Tensor:
        return self._forward(self.ids, self.mask)

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        new, real = _next_column(len(self.ids), rows, tokens, self.pad_token_id, self.model.device)
        if self.step is None:
            return self._forward(new, real)[rows]
        # the compiled step: same shapes at every position (a finished row feeds a pad)
        positions = self.cache.begin(1, real)
        logits = self.step(new, positions, self.cache)
        self.cache.advance()
        return logits[rows]

    def release(self, row: int) -> None:
        pass

    def close(self) -> None:
        pass


class PagedBatch:
    """A paged KV cache (notebook 04): each sequence holds blocks of a shared pool. The
    prompts' cached prefixes are reused; a finished sequence frees its blocks at once and
    leaves the batch. Blocks are freed on every exit, an exception or interrupt included."""

    def __init__(self, model, prompts: list[list[int]], pad_token_id: int, cache: PagedKVCache):
        self.model, self.pad_token_id, self.cache = model, pad_token_id, cache
        self.prompts = prompts
        self.seq_ids = [cache.new_seq_id() for _ in prompts]
        self.num_cached: list[int] = []
        try:
            for sid, ids in zip(self.seq_ids, prompts):
                self.num_cached.append(cache.manager.allocate(sid, ids))
        except BaseException:
            self.close()
            raise

    def _forward(self, seq_ids: list, new: list[list[int]]) -> torch.Tensor:
        positions = self.cache.prepare(seq_ids, [len(n) for n in new])
        ids, _ = left_pad(new, self.pad_token_id, self.model.device)
        logits = self.model(ids, positions=positions, cache=self.cache, last_only=True)[:, -1]
        bm = self.cache.manager
        for sid in seq_ids:           # their K/V are written: full blocks may serve as prefixes
            bm.mark_computed(sid, bm.num_tokens(sid))
        return logits

    def prefill(self) -> torch.Tensor:
        """Only the tokens the prefix cache does not hold, left-padded."""
        return self._forward(self.seq_ids, [p[c:] for p, c in zip(self.prompts, self.num_cached)])

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        seq_ids = [self.seq_ids[r] for r in rows]
        copies = []
        for sid, tok in zip(seq_ids, tokens):
            _, cow = self.cache.manager.append_slot(sid, tok)
            if cow:
                copies.append(cow)
        self.cache.copy_blocks(copies)
        return self._forward(seq_ids, [[t] for t in tokens])

    def release(self, row: int) -> None:
        self.cache.manager.free(self.seq_ids[row])

    def close(self) -> None:
        bm = self.cache.manager
        for sid in self.seq_ids:
            if bm.has_seq(sid):
                bm.free(sid)


# -- the loop -----------------------------------------------------------------------------

@dataclass
class TokenRun:
    """What :func:`generate_token_ids` produced for one prompt."""

    token_ids: list[int] = field(default_factory=list)    # generated tokens only
    times_s: list[float] = field(default_factory=list)    # since the start, per token
    finish_reason: str | None = None                       # "stop" or "length"
    num_cached_tokens: int = 0                             # prompt tokens the prefix cache held


def _make_batch(model, prompts: list[list[int]], budgets: list[int], pad_token_id: int,
                kv_cache, block_size: int, num_blocks: int | None,
                paged_attention: str | None, kv_dtype: str = "auto", compile: bool = False):
    if compile:
        from .compile import compiled_step

        if kv_cache not in ("none", "static"):
            raise ValueError(f"compile=True runs the decode step on the static cache (fixed "
                             f"shapes: one graph for every position); got kv_cache={kv_cache!r}, "
                             "allowed: 'static' (or leave the default)")
        return ContiguousBatch(model, prompts, pad_token_id, max(budgets), "static", kv_dtype,
                               step=compiled_step(model))
    if check_kv_dtype(kv_dtype) != "auto" and (isinstance(kv_cache, PagedKVCache)
                                               or kv_cache == "none"):
        raise ValueError(f"kv_cache_dtype={kv_dtype!r} needs kv_cache='contiguous' or 'paged' "
                         f"(a cache passed in keeps its own kv_dtype); got kv_cache={kv_cache!r}")
    if isinstance(kv_cache, PagedKVCache):            # a cache kept across calls
        return PagedBatch(model, prompts, pad_token_id, kv_cache)
    kv_caches.check_name(kv_cache)
    if kv_cache == "none":
        return RecomputeBatch(model, prompts, pad_token_id)
    if kv_cache == "paged":
        allowed = attn_backends.paged_backends()
        if paged_attention is not None and paged_attention not in allowed:
            raise ValueError(f"paged_attention={paged_attention!r}; allowed: {allowed} or None")
        if num_blocks is None:        # exactly what these sequences can reach
            num_blocks = blocks_needed([len(p) + b for p, b in zip(prompts, budgets)], block_size)
        cache = PagedKVCache.for_model(model, num_blocks, block_size, backend=paged_attention,
                                       kv_dtype=kv_dtype)
        return PagedBatch(model, prompts, pad_token_id, cache)
    return ContiguousBatch(model, prompts, pad_token_id, max(budgets), kv_cache, kv_dtype)


@torch.inference_mode()
def generate_token_ids(model, prompts: list[list[int]], max_new_tokens: int, *,
                       temperature: float = 0.0, top_k: int | None = None,
                       top_p: float | None = None, seed: int | None = None,
                       eos_token_id: int | None = None, pad_token_id: int = 0,
                       ignore_eos: bool = False, kv_cache="none", block_size: int = 16,
                       num_blocks: int | None = None, paged_attention: str | None = None,
                       agree: Callable[[list[int]], list[int]] | None = None,
                       presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repetition_penalty: float = 1.0,
                       kv_cache_dtype: str = "auto", compile: bool = False,
                       grammar=None) -> list[TokenRun]:
    """The generation loop every path shares: prefill, then sample / stop / decode.

    ``prompts``: token ids per prompt (checked by the caller). Each prompt gets exactly
    the tokens it would get alone: the same sampler (a seeded prompt has its own
    generator, seeded with ``seed``) and the same stopping rule
    (:func:`llmlab.stopping.finish_reason`: end-of-sequence token, ``max_new_tokens``,
    or a full context, whatever the other prompts' lengths). ``kv_cache``: ``"none"``,
    ``"contiguous"``, ``"paged"`` (with ``block_size``, ``num_blocks`` and
    ``paged_attention``, one of ``llmlab.attention.paged_backends()``) or a
    :class:`~llmlab.cache.paged.PagedKVCache` to reuse (its prefix cache then serves
    repeated prompt prefixes). ``agree`` maps the sampled tokens to the ones every
    process uses (tensor parallelism broadcasts rank 0's choice). The penalties are the
    engine's (:func:`llmlab.sampling.apply_penalties`), applied before sampling.
    ``compile``: decode with the compiled step on a static cache (:mod:`llmlab.compile`).
    ``grammar``: a compiled grammar (:func:`llmlab.structured.compile_grammar`); each row
    gets its own matcher, the forbidden tokens' logits are set to -inf before sampling,
    and a row finishes ("stop") once nothing but EOS may follow.
    """
    penalized = has_penalties(presence_penalty, frequency_penalty, repetition_penalty)
    ctx = model.config.max_position_embeddings
    budgets = [token_budget(len(p), max_new_tokens, ctx) for p in prompts]
    dev = model.device
    generators = [torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
                  for _ in prompts]
    batch = _make_batch(model, prompts, budgets, pad_token_id, kv_cache, block_size,
                        num_blocks, paged_attention, kv_cache_dtype, compile)
    runs = [TokenRun(num_cached_tokens=c) for c in batch.num_cached]
    matchers = [grammar.matcher() for _ in prompts] if grammar is not None else None
    sync(dev)
    t0 = time.perf_counter()
    try:
        active = list(range(len(prompts)))
        logits = batch.prefill()
        while True:
            n = len(active)
            if penalized:
                logits = apply_penalties(logits, [prompts[r] for r in active],
                                         [runs[r].token_ids for r in active], presence_penalty,
                                         frequency_penalty, repetition_penalty)
            if matchers is not None:         # structured output: forbidden tokens -> -inf
                logits = logits.clone()
                for i, r in enumerate(active):
                    matchers[r].mask_logits_(logits[i])
            tokens = sample_rows(logits, [temperature] * n, [top_k] * n, [top_p] * n,
                                 [generators[r] for r in active])      # syncs: honest times
            if agree is not None:
                tokens = agree(tokens)
            now = time.perf_counter() - t0
            still = []
            for row, tok in zip(active, tokens):
                run = runs[row]
                run.token_ids.append(tok)
                run.times_s.append(now)
                run.finish_reason = finish_reason(
                    tok, len(run.token_ids), len(prompts[row]) + len(run.token_ids),
                    eos_token_id=eos_token_id, ignore_eos=ignore_eos,
                    max_tokens=max_new_tokens, max_len=ctx)
                if matchers is not None and run.finish_reason != "stop":
                    matchers[row].advance(tok)
                    if matchers[row].is_finished():      # only EOS could follow
                        run.finish_reason = "stop"
                if run.finish_reason is None:
                    still.append(row)
                else:
                    batch.release(row)
            active = still
            if not active:
                return runs
            logits = batch.decode(active, [runs[r].token_ids[-1] for r in active])
    finally:
        batch.close()


@torch.inference_mode()
def generate(model, tokenizer, prompts, max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             chat: bool = True, kv_cache="none", ignore_eos: bool = False,
             block_size: int = 16, num_blocks: int | None = None,
             paged_attention: str | None = None, speculative=None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, kv_cache_dtype: str = "auto",
             compile: bool = False, structured=None):
    """Generate for one prompt (returns a :class:`Generation`) or a list (returns a list).

    ``prompts``: a string, a list of strings, or a list of token-id lists (used as they are).
    ``kv_cache="none"`` (the baseline) runs the model over the full sequence (prompt +
    generated) at every step; ``"contiguous"`` runs the prompt once (prefill) and then
    one token per step (decode), keeping K and V in a :class:`llmlab.cache.ContiguousKVCache`
    (notebook 02); ``"paged"`` keeps them in blocks of ``block_size`` tokens of a pool
    (``num_blocks``, default: exactly what the batch needs) read by the ``paged_attention``
    backend (default: the layer's if it is a paged one, else ``"paged"``; notebook 04).
    A :class:`llmlab.cache.PagedKVCache` may be passed as ``kv_cache`` to reuse it across
    calls (its prefix cache then serves repeated prompt prefixes:
    ``generation.num_cached_tokens``). Each prompt of a batch gets exactly the tokens it
    would get alone (:func:`generate_token_ids`), up to ``max_new_tokens`` or the end of
    the model's context. ``temperature=0`` is greedy; ``seed`` makes sampling
    reproducible; ``ignore_eos`` keeps generating past the end-of-sequence token (all
    ``max_new_tokens``, for timing).
    ``speculative``: a :class:`llmlab.SpeculativeConfig` or a dict of its fields (e.g.
    ``{"method": "ngram", "num_tokens": 4}``) drafts and verifies several tokens per target
    forward (notebook 09): one prompt, a contiguous KV cache (``kv_cache`` "none" or
    "contiguous"); same tokens when greedy, same distribution when sampling; the statistics
    are on ``generation.speculative`` (a :class:`llmlab.speculative.SpecStats`).
    ``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty``: as in the
    engine's :class:`~llmlab.engine.SamplingParams` (not with ``speculative``).
    ``kv_cache_dtype="int8"``: the contiguous or paged cache stores K/V in int8, one scale
    per token and KV head (``kv_dtype`` of :class:`llmlab.cache.ContiguousKVCache`).
    ``compile=True`` (vLLM's ``enforce_eager=False``): the prompt runs eagerly, then every
    decode step runs one graph compiled by ``torch.compile`` (CUDA graphs on a GPU) over a
    :class:`llmlab.cache.StaticKVCache` (``kv_cache="static"``, fixed shapes, the default
    then); the first call of a batch size compiles (notebook 11, :mod:`llmlab.compile`).
    ``structured``: constrain every output to a grammar, as ``SamplingParams.structured``
    (``{"regex": ...}``, ``{"json_schema": ...}``, ``{"choice": [...]}``; notebook 12), or
    a grammar compiled already (anything with ``.matcher()``, :mod:`llmlab.structured`).
    """
    check_penalties(presence_penalty, frequency_penalty, repetition_penalty)
    penalties = dict(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty)
    single = isinstance(prompts, str)
    cfg = model.config
    prompts, encoded = prepare_prompts(tokenizer, prompts, max_new_tokens, temperature, top_k,
                                       top_p, chat, seed=seed, vocab_size=cfg.vocab_size)
    ctx = cfg.max_position_embeddings
    for p, ids in zip(prompts, encoded):
        if len(ids) >= ctx:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of "
                             f"{ctx} tokens (it needs room for at least one new token): "
                             f"{p[:40]!r}...")
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    grammar = None
    if structured is not None and hasattr(structured, "matcher"):
        grammar = structured                  # a grammar compiled already (notebook 12's)
    elif structured is not None:
        from .structured import compile_grammar

        grammar = compile_grammar(structured, tokenizer, cfg.vocab_size, eos)
    if speculative is not None:
        if grammar is not None:
            raise ValueError("structured= does not apply to speculative decoding yet; pass one")
        spec = SpeculativeConfig.coerce(speculative)
        if compile:
            raise ValueError("compile=True does not apply to speculative decoding yet; pass one")
        if has_penalties(**penalties):
            raise ValueError(f"speculative decoding takes no penalties; got {penalties}")
        if kv_cache_dtype != "auto":
            raise ValueError(f"speculative decoding keeps K/V in the model's dtype; got "
                             f"kv_cache_dtype={kv_cache_dtype!r}")
        if len(encoded) != 1 or kv_cache not in ("none", "contiguous"):
            raise ValueError(f"speculative decoding runs one prompt on a contiguous KV cache; "
                             f"got {len(encoded)} prompts and kv_cache={kv_cache!r}")
        runs = [speculative_token_ids(model, encoded[0], max_new_tokens, spec,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      seed=seed, eos_token_id=eos, ignore_eos=ignore_eos)]
    else:
        runs = generate_token_ids(model, encoded, max_new_tokens, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos,
                                  pad_token_id=pad, ignore_eos=ignore_eos, kv_cache=kv_cache,
                                  block_size=block_size, num_blocks=num_blocks,
                                  paged_attention=paged_attention, **penalties,
                                  kv_cache_dtype=kv_cache_dtype, compile=compile,
                                  grammar=grammar)
    results = []
    for p, ids, run in zip(prompts, encoded, runs):
        toks = run.token_ids
        stopped = run.finish_reason == "stop" and toks[-1] == eos   # a grammar may end it too
        text = tokenizer.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)
        metrics = RequestMetrics(prompt_tokens=len(ids), output_tokens=len(toks),
                                 ttft_s=run.times_s[0], e2e_s=run.times_s[-1])
        g = Generation(p, text, toks, ids, run.finish_reason, metrics, run.times_s)
        g.num_cached_tokens = run.num_cached_tokens
        g.speculative = getattr(run, "stats", None)      # SpecStats, or None without it
        results.append(g)
    return results[0] if single else results


def generate_paged(model, tokenizer, prompts, max_new_tokens: int = 32, block_size: int = 16,
                   backend: str = "paged", num_blocks: int | None = None, chat: bool = True,
                   cache: PagedKVCache | None = None, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None,
                   seed: int | None = None, ignore_eos: bool = False):
    """:func:`generate` with ``kv_cache="paged"``, in notebook 04's words: ``backend`` is the
    paged attention backend, ``cache`` a :class:`~llmlab.cache.PagedKVCache` to reuse
    across calls (then its own block size, pool and backend apply). When the pool is too
    small it raises :class:`~llmlab.cache.NoFreeBlocksError` holding no block (a fixed
    batch, not a scheduler: the serving engine preempts instead).
    """
    if backend not in attn_backends.paged_backends():
        raise ValueError(f"backend={backend!r}; allowed: {attn_backends.paged_backends()}")
    return generate(model, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                    chat, kv_cache="paged" if cache is None else cache, ignore_eos=ignore_eos,
                    block_size=block_size, num_blocks=num_blocks, paged_attention=backend)
