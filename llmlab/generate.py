"""The generator: the no-cache baseline, or prefill + decode with a KV cache.

Without a cache (``kv_cache="none"``, the default) each new token costs a full forward
pass over prompt + everything generated so far, so generating T tokens costs O(T²)
token-passes: the textbook loop (notebook 01). With ``kv_cache="contiguous"`` the prompt
runs once and each later token costs one token-pass (notebook 02).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import cache as kv_caches
from .device import sync
from .engine.sampler import check_sampling_args, sample
from .profiling.metrics import RequestMetrics


@dataclass
class Generation:
    prompt: str
    text: str
    token_ids: list[int]          # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str            # "stop" (end-of-sequence token) or "length"
    metrics: RequestMetrics = field(repr=False, default=None)
    token_times_s: list[float] = field(repr=False, default_factory=list)  # since start, per token


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
                    top_k: int | None, top_p: float | None, chat: bool):
    """Check the generation arguments; -> (prompt strings, token ids per prompt).

    ``prompts``: a string, a list of strings, or a list of token-id lists (used as they are).
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    check_sampling_args(temperature, top_k, top_p)
    if all(isinstance(p, (list, tuple)) for p in prompts):
        encoded = [[int(t) for t in p] for p in prompts]
        if not all(encoded):
            raise ValueError("a token-id prompt is empty")
        return [tokenizer.decode(p) for p in encoded], encoded
    return prompts, encode_prompts(tokenizer, prompts, chat)


@torch.inference_mode()
def generate(model, tokenizer, prompts, max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             chat: bool = True, kv_cache: str = "none", ignore_eos: bool = False):
    """Generate for one prompt (returns a :class:`Generation`) or a list (returns a list).

    ``prompts``: a string, a list of strings, or a list of token-id lists (used as they are).
    ``kv_cache="none"`` (the baseline) runs the model over the full sequence (prompt +
    generated) at every step; ``"contiguous"`` runs the prompt once (prefill) and then
    one token per step (decode), keeping K and V in a :class:`llmlab.cache.ContiguousKVCache`
    (notebook 02); see ``llmlab.cache.available()``. Prompts in a batch are left-padded
    with an attention mask, so each one gets the tokens it would get alone.
    ``temperature=0`` is greedy; ``seed`` makes sampling reproducible; ``ignore_eos``
    keeps generating past the end-of-sequence token (all ``max_new_tokens``, for timing).
    """
    single = isinstance(prompts, str)
    prompts, encoded = prepare_prompts(tokenizer, prompts, max_new_tokens, temperature, top_k,
                                       top_p, chat)
    kv_caches.check_name(kv_cache)
    cfg = model.config
    ctx = cfg.max_position_embeddings
    for p, ids in zip(prompts, encoded):
        if len(ids) >= ctx:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of "
                             f"{ctx} tokens (it needs room for at least one new token): "
                             f"{p[:40]!r}...")
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None

    ids, mask = left_pad(encoded, pad, dev)
    batch = len(prompts)
    steps = min(max_new_tokens, ctx - ids.shape[1])
    cache = kv_caches.create(kv_cache, model, batch, ids.shape[1] + steps)
    # With a cache: the first forward feeds the whole prompt, later ones the newest token.
    feed, feed_mask = ids, (None if bool(mask.all()) else mask)
    out_tokens = [[] for _ in range(batch)]
    done = torch.zeros(batch, dtype=torch.bool, device=dev)
    any_done = False
    step_times = []
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        if cache is None:
            logits = model(ids, attention_mask=mask, last_only=True)[:, -1]
        else:
            positions = cache.begin(feed.shape[1], feed_mask)
            logits = model(feed, positions=positions, cache=cache, last_only=True)[:, -1]
            cache.advance()
        nxt = sample(logits, temperature, top_k, top_p, gen)
        was_done = done
        if any_done:
            nxt = torch.where(was_done, torch.full_like(nxt, pad), nxt)
        for i, (t, d) in enumerate(zip(nxt.tolist(), was_done.tolist())):  # syncs: honest times
            if not d:
                out_tokens[i].append(t)
        step_times.append(time.perf_counter() - t0)
        if not ignore_eos:
            done = was_done | (nxt == eos)
            any_done = bool(done.any())
            if any_done and bool(done.all()):
                break
        if cache is None:
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, (~was_done).long()[:, None]], dim=1)
        else:
            feed = nxt[:, None]
            feed_mask = (~was_done)[:, None] if bool(was_done.any()) else None

    results = []
    for i, p in enumerate(prompts):
        toks = out_tokens[i]
        finished = not ignore_eos and bool(toks) and toks[-1] == eos
        text = tokenizer.decode(toks[:-1] if finished else toks, skip_special_tokens=True)
        n = len(toks)
        metrics = RequestMetrics(prompt_tokens=len(encoded[i]), output_tokens=n,
                                 ttft_s=step_times[0], e2e_s=step_times[n - 1])
        results.append(Generation(p, text, toks, encoded[i], "stop" if finished else "length",
                                  metrics, step_times[:n]))
    return results[0] if single else results
