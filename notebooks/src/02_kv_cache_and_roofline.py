# %% [markdown]
# # 02 · The KV cache, and the roofline
#
# **Why.** Notebook 01 ran the textbook loop: every new token re-runs the model over the whole
# sequence, so T new tokens cost a number of token-passes quadratic in T. Yet the keys and values
# an attention layer computes for a token never change once the token is written (each depends
# only on the tokens before it). Keeping them — a **KV cache** — means the prompt is processed once
# (**prefill**, which sets TTFT) and then each step feeds only the newest token (**decode**, TPOT).
# The idea is as old as Transformer decoding; Shazeer (2019) and Pope et al. (2023) analyse its
# cost.
#
# The catch is two-fold. With a cache a decode step multiplies each weight matrix by a single
# vector (a matrix–vector product, GEMV) instead of a matrix (GEMM): the step turns from
# **compute-bound** to **memory-bound**, its time set by reading the weights. And the cache costs
# memory: Kwon et al. (2023) serve a 13B-parameter model on a 40 GB A100 where the weights take
# 26 GB (65%) and the KV caches of the requests in flight more than 30%; they count 800 KB of K and V
# per token for OPT-13B, up to 1.6 GB for one 2048-token request. We check that figure, build the
# cache, confirm it changes no token, then measure where prefill and decode sit on this machine's
# roofline.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.cache import kv_bytes_per_token, kv_cache_bytes
from llmlab.config import ModelConfig
from llmlab.device import device_name
from llmlab.profiling import expect

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
cfg = model.config
print(device_name())

# %% [markdown]
# ## Why, in numbers: how big is a KV cache?
#
# Every layer keeps one key and one value vector per KV head for every token.
# Llama-2-13B has OPT-13B's shape here: 40 layers and 40 KV heads of dim 128 (no grouped-query
# attention). SmolLM2-135M has 30 layers but only 3 KV heads of dim 64 (its 9 query heads share
# them, 3 each).

# %%
# NBVAL_CHECK_OUTPUT
llama13b = ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
                       num_heads=40, num_kv_heads=40, head_dim=128, max_position_embeddings=4096)
per_tok_13b = kv_bytes_per_token(llama13b, bytes_per_el=2)
print(f"13B shape, float16: {per_tok_13b:,} bytes = {per_tok_13b / 2**10:.0f} KiB per token")
print(f"  one 2048-token request: {kv_cache_bytes(llama13b, 1, 2048, 2) / 2**30:.2f} GiB; "
      f"one 4096-token sequence: {kv_cache_bytes(llama13b, 1, 4096, 2) / 2**30:.2f} GiB")
print(f"SmolLM2-135M, float32: {kv_bytes_per_token(cfg, 4):,} bytes per token; "
      f"float16: {kv_bytes_per_token(cfg, 2):,}")

# %% [markdown]
# ## How: a preallocated cache, prefill, then decode
#
# A contiguous cache allocates, per layer, one K and one V tensor of shape
# `[batch, kv_heads, max_len, head_dim]`, once, for the longest sequence the generation can reach:
# no step allocates. Slots `0 … length−1` hold the tokens so far. Around each forward of the
# model the generator calls three methods:
#
# ```python
# positions = cache.begin(num_new)                       # announce the new tokens
# logits = model(ids, positions=positions, cache=cache)  # every layer calls cache.attend(...)
# cache.advance()                                        # commit them
# ```
#
# and inside the forward each attention layer hands the cache its new tokens' rotated
# queries, keys and values, and gets back the attention output:
#
# `cache.attend(layer_idx, q, k, v, backend)`, with `q` `[batch, num_new, heads, head_dim]` and
# `k`, `v` `[batch, num_new, kv_heads, head_dim]`, returns `[batch, num_new, heads, head_dim]`.
#
# For the prefill `num_new` is the prompt length; for a decode step it is 1. `backend.forward(q,
# k, v, causal=True)` is the attention of notebook 01 in the `[batch, seq, heads, head_dim]`
# layout, with the causal mask aligned bottom-right — so one new query sees every key before it.
#
# ## Build: your KV cache
#
# `KVCacheBase` gives you the storage (`self.k[layer]`, `self.v[layer]`), `self.length` (slots
# committed), `self.pending` (tokens announced by `begin`) and `begin` itself. You write:
#
# - `append(layer_idx, k, v)`: store the new tokens' keys and values in the next free slots;
# - `attend(layer_idx, q, k, v, backend)`: append, then attend the new queries over **every**
#   stored token of that layer;
# - `advance()`: commit the announced tokens.
#
# The check drives your cache by hand on small tensors, then runs `llmlab.generate` on SmolLM2
# with it: the 32 greedy tokens must be exactly those of `kv_cache="none"`, and it reports how many
# positions the model computed and whether the time per step stays flat.

# %%
from llmlab.exercises.nb02 import KVCacheBase


class MyKVCache(KVCacheBase):
    def append(self, layer_idx, k, v):
        # YOUR CODE HERE
        raise NotImplementedError

    def attend(self, layer_idx, q, k, v, backend):
        # YOUR CODE HERE
        raise NotImplementedError

    def advance(self):
        # YOUR CODE HERE
        raise NotImplementedError


verdict = exercises.check("nb02.kv_cache", MyKVCache)
verdict

# %% [markdown]
# Once it passes, your cache is a cache like any other: register it by name and generate with it.

# %%
if verdict:
    llmlab.cache.register("mine", MyKVCache.for_model)
    mine = llmlab.generate(model, tok, "Explain in two sentences why the sky is blue.",
                           max_new_tokens=24, kv_cache="mine")
    print(repr(mine.text))
else:
    print("finish MyKVCache above first; this cell then generates with it")

# %% [markdown]
# **Compare with llmlab's.** `llmlab.cache.ContiguousKVCache` does what yours does, plus two
# things. It serves a **left-padded batch** (prompts of different lengths): `begin(num_new,
# attention_mask)` records which slots hold real tokens and counts positions over real tokens only,
# and `attend` passes that `key_padding_mask` to the backend (the stretch exercise). And for a decode
# step it avoids copying K/V per query head: under grouped-query attention the 3 query heads that
# share a KV head are moved into the query-length axis, so the backend sees 3 KV heads with 3
# queries each:
#
# ```python
# qg = q.reshape(b, kv_heads, groups, d).transpose(1, 2)      # [b, 1, heads, d] -> [b, groups, kv_heads, d]
# out = backend.forward(qg, k_cache, v_cache, causal=False)    # each KV head read once, not 3 times
# ```
#
# ## Build: the loop that makes the cache pay
#
# A cache saves nothing by itself: the generation loop decides what the model is fed. Write
# `decode_loop(model, prompt_ids, max_new_tokens, cache_cls)`, greedy generation with **one** cache
# of class `cache_cls` (your `MyKVCache`). The prompt goes through the model once, in one forward
# (the **prefill**); every later forward feeds the model only what the cache does not hold yet (a
# **decode** step). Greedy: each new token is the argmax of the last position's logits. Generate
# exactly `max_new_tokens` tokens; the end-of-sequence token does not stop the loop.
#
# What you have: `cache_cls.for_model(model, batch, max_len)` makes an empty cache with room for
# `max_len` tokens; the three calls of the How section go around every forward; and
# `model(ids, positions=positions, cache=cache, last_only=True)` takes `ids` `[1, n]`
# (`torch.long`, on `model.device`) and returns logits `[1, 1, vocab]` for the last of its `n`
# tokens. Return the new token ids as a list of ints.
#
# The check runs your loop on SmolLM2 and watches every forward: how many tokens it is fed, at
# which positions, and which token. The tokens must be those of `llmlab.generate` and every
# step's logits those of a no-cache forward; llmlab's own generation loops are switched off
# while it runs.

# %%
def decode_loop(model, prompt_ids, max_new_tokens, cache_cls):
    """Greedy generation with a KV cache.

    prompt_ids: list of ints. Returns the max_new_tokens new token ids (a list of ints).
    """
    # YOUR CODE HERE
    raise NotImplementedError


loop_verdict = exercises.check("nb02.decode_loop", decode_loop, cache_cls=MyKVCache)
loop_verdict

# %% [markdown]
# With both builds done, your loop and your cache generate text on their own:

# %%
if loop_verdict:
    with torch.inference_mode():
        new = decode_loop(model, tok("The capital of France is")["input_ids"], 12, MyKVCache)
    print(repr(tok.decode(new)))
else:
    print("finish decode_loop above first; this cell then generates with it")

# %% [markdown]
# **Compare with llmlab's.** `llmlab.generate(..., kv_cache="contiguous")` runs this loop for a
# batch of prompts (`generate_token_ids` in `llmlab/generate.py`): it samples instead of taking the
# argmax when asked, stops a row at its end-of-sequence token, and keeps the rows that are still
# going in the batch.

# %% [markdown]
# ## Check: same logits, same tokens
#
# First the logits: a batch of two prompts of different lengths (so one is left-padded) goes
# through prefill + 12 decode steps, and is compared with one no-cache forward over the full
# sequences (the baseline, with its attention mask).

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.cache import ContiguousKVCache
from llmlab.generate import encode_prompts, left_pad

prompts = ["Name three primary colors.", "Write a short poem about the sea, please, with rhymes."]
follow = tok(" Red, blue and yellow are the colors of the sea.")["input_ids"][:12]
full = [p + follow for p in encode_prompts(tok, prompts, chat=True)]
ids, mask = left_pad(full, tok.pad_token_id, model.device)
n_prompt = ids.shape[1] - len(follow)
cache = ContiguousKVCache.for_model(model, batch=2, max_len=ids.shape[1])
with torch.inference_mode():
    reference = model(ids, attention_mask=mask)
    pos = cache.begin(n_prompt, mask[:, :n_prompt])
    got = [model(ids[:, :n_prompt], positions=pos, cache=cache)]
    cache.advance()
    for t in range(n_prompt, ids.shape[1]):
        got.append(model(ids[:, t:t + 1], positions=cache.begin(1), cache=cache))
        cache.advance()
err = (torch.cat(got, 1) - reference).abs().amax(-1)[mask.bool()].max().item()
print("prompt lengths:", [len(f) - len(follow) for f in full])
print(f"max |Δ logits| over real tokens = {err:.1e}, below 1e-3: {err < 1e-3}")

# %% [markdown]
# Then the tokens: greedy generation with and without the cache, past the end-of-sequence token
# (`ignore_eos=True`) so both runs generate the same number of tokens.

# %%
# NBVAL_CHECK_OUTPUT
N_NEW = 8 if QUICK else 16
question = "Explain in two sentences why the sky is blue."
no_cache = llmlab.generate(model, tok, question, max_new_tokens=N_NEW, ignore_eos=True)
cached = llmlab.generate(model, tok, question, max_new_tokens=N_NEW, ignore_eos=True,
                         kv_cache="contiguous")
print("prompt tokens:", len(cached.prompt_token_ids), "| new tokens:", len(cached.token_ids))
print("same greedy tokens:", no_cache.token_ids == cached.token_ids)
print(repr(cached.text[:70]))

# %% [markdown]
# ## Measure: one step, with and without the cache
#
# A no-cache step at sequence length n is a forward over n tokens; a cached decode step at length n
# is a forward over one token that reads n − 1 cached keys and values. Both timed at several n,
# median of 5 runs after a warm-up (band: min–max):

# %%
from llmlab.viz.baseline import (cached_step_times, fit_exponent, fit_line, forward_step_times,
                                 generation_totals, plot_generation_totals, plot_step_times)

lengths = [8, 84, 168] if QUICK else [8, 40, 84, 126, 168]
no_cache_steps = forward_step_times(model, lengths, repeats=5)
cache_steps = cached_step_times(model, lengths, repeats=5)
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=80)
plot_step_times([no_cache_steps, cache_steps], ax=a1, title="time per step")
fits = {}
for rows in (no_cache_steps, cache_steps):
    a, b = fits[rows[0].label] = fit_line(lengths, [r.median_s * 1e3 for r in rows])
    print(f"{rows[0].label:>9}: {a:6.1f} ms + {b:6.3f} ms per token in the sequence "
          f"({rows[-1].median_s / rows[0].median_s:.1f}× from {lengths[0]} to {lengths[-1]} tokens)")
a, b = fits["no cache"]
print(f"a no-cache step's per-token part (b·n) outgrows its fixed part (a) at n ≈ {a / b:.0f} tokens")

# A generation of T = 160 tokens after an 8-token prompt, built from these medians: token t
# costs the step at length 8 + t (no cache), or the prefill and then decode steps (cache).
P, T = 8, 160
t_axis = np.arange(1, T + 1)
totals = {"no cache": generation_totals(no_cache_steps, P, T, cached=False),
          "KV cache": generation_totals(cache_steps, P, T, cached=True, prefill=no_cache_steps[0])}
passes = {"no cache": np.cumsum(P + np.arange(T)),
          "KV cache": np.cumsum(np.r_[P, np.ones(T - 1)])}
plot_generation_totals(t_axis, totals, passes, ax=a2,
                       title=f"generating T tokens after {P} (from the step medians)")
fig.suptitle(device_name(), fontsize=9)
fig.tight_layout()
plt.show()
window = slice(T // 2 - 1, T)   # the second half: T = 80 … 160
for label, tot in totals.items():
    print(f"{label:>9}: {tot[-1]:5.1f} s for {T} tokens; total time ∝ T^"
          f"{fit_exponent(t_axis[window], tot[window]):.2f}, token-passes ∝ T^"
          f"{fit_exponent(t_axis[window], passes[label][window]):.2f} "
          f"(fits over T = {T // 2}…{T})")
print(f"the cache makes the whole generation {totals['no cache'][-1] / totals['KV cache'][-1]:.1f}× "
      f"faster at T = {T} (sums of the step medians)")

# %% [markdown]
# Read the fits: without the cache each step's time grows with the sequence, so the total grows
# faster than linearly (the exponent printed for "no cache", heading for the 2 of its token-pass
# count, dashed); with the cache a step costs about the same at every length and the total grows
# linearly. Below the length printed above, a no-cache step's fixed part (reading the weights,
# per-operator overheads) outweighs its per-token part, and the quadratic hides: a 40-token
# generation looks almost linear, which is why this plot uses a short prompt and goes to 160
# tokens.
#
# TTFT and TPOT from the same medians: both start with the same prompt forward; the cache wins on
# every later token.

# %%
ttft = no_cache_steps[0].median_s
tpot = {label: (tot[-1] - tot[0]) / (T - 1) for label, tot in totals.items()}
for label in totals:
    print(f"{label:>9}: TTFT {ttft * 1e3:6.1f} ms | mean TPOT over {T} tokens {tpot[label] * 1e3:6.1f} ms")

# %% [markdown]
# The price is memory that grows linearly with sequence length *and* batch size — for SmolLM2 in
# float32 below, with the weights for scale. The byte count is checked against a real cache:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.viz.roofline import plot_cache_memory

real = ContiguousKVCache.for_model(model, batch=4, max_len=1024)
print("computed bytes == bytes of the real cache tensors:",
      kv_cache_bytes(cfg, 4, 1024, 4) == real.nbytes, f"({real.nbytes / 2**20:.0f} MiB)")
del real

# %%
plot_cache_memory(cfg, batches=(1, 8, 32), max_seq=cfg.max_position_embeddings, bytes_per_el=4)
plt.show()

# %% [markdown]
# ## Measure: the roofline
#
# Two numbers bound any computation on this machine (Williams et al., 2009): how fast memory can
# be streamed (a large copy) and how fast it can multiply (a large matmul). A forward that does F
# FLOPs while moving B bytes has arithmetic intensity I = F / B and can at best run at
# min(peak FLOP/s, bandwidth · I). `llmlab.profiling.roofline` measures the two ceilings (the best of
# 5 runs: a ceiling is what the machine *can* do) and models F and B of a prefill and of a decode
# step (weights read once, activations, KV cache read and written).

# %%
from llmlab.profiling.roofline import RooflinePoint, decode_cost, measure_ceilings, prefill_cost
from llmlab.viz.roofline import explore, plot_roofline

ceil = measure_ceilings(copy_bytes=128 * 2**20, matmul_n=1024, repeats=5)
print(f"{ceil.device}: copy {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
      f"matmul {ceil.peak_flops_per_s / 1e9:.0f} GFLOP/s, ridge point {ceil.ridge_point:.1f} FLOP/byte")

# %% [markdown]
# **Predict, then count.** Before the model's numbers are printed below: how many FLOPs per byte
# does a decode step at batch 1 do in float32, with 128 cached tokens? Nearly all the bytes it
# moves are SmolLM2's weights. Commit a number.

# %%
my_intensity = ...  # YOUR ANSWER: FLOPs per byte

# %%
decode_intensity = decode_cost(cfg, 1, 128).intensity
exercises.check("nb02.predict_decode_intensity", my_intensity, measured=decode_intensity)

# %%
# NBVAL_CHECK_OUTPUT
print(f"modelled intensity, float32: prefill of 128 tokens {prefill_cost(cfg, 1, 128).intensity:.0f}"
      f" FLOP/byte; decode step, batch 1: {decode_intensity:.2f} FLOP/byte")

# %% [markdown]
# **Predict, then measure.** A decode step at batch 16 feeds 16 tokens instead of 1 (each with 128
# cached tokens). Compared with batch 1, how many times as long does the step take? Commit a
# number, the step time at batch 16 over the step time at batch 1; a factor of 2 either way of
# what this machine measures passes.

# %%
my_prediction = ...  # YOUR ANSWER: a number

# %%
CONTEXT = 128
batches = [1, 4] if QUICK else [1, 4, 16]
prefill = forward_step_times(model, [64], repeats=5)[0]
decodes = {b: cached_step_times(model, [CONTEXT + 1], repeats=5, batch=b)[0] for b in batches}
timings = [prefill] + list(decodes.values())
costs = [prefill_cost(cfg, 1, 64)] + [decode_cost(cfg, b, CONTEXT) for b in batches]
points = [RooflinePoint(c, t.median_s) for c, t in zip(costs, timings)]
for p, t in zip(points, timings):
    print(f"{p.label:>22}: {p.seconds * 1e3:7.1f} ms (min {t.lo_s * 1e3:.1f}, max {t.hi_s * 1e3:.1f}), "
          f"{p.intensity:6.2f} FLOP/byte, {p.flops_per_s / 1e9:5.1f} GFLOP/s = "
          f"{p.share_of_roof(ceil):.0%} of the roof there")
plot_roofline(ceil, points, title=f"roofline, measured (median of 5): {device_name()}",
              spreads=[(t.lo_s, t.hi_s) for t in timings])
plt.show()

# %%
longer = next(n for n in range(1, 4097) if prefill_cost(cfg, 1, n).intensity >= ceil.ridge_point)
print(f"ridge point {ceil.ridge_point:.1f} FLOP/byte: the 64-token prefill sits "
      f"{'right' if points[0].intensity >= ceil.ridge_point else 'left'} of it; a prefill is "
      f"past it from {longer} prompt tokens on (model)")
from llmlab.profiling import compare

batch_cmp = compare(decodes[1], decodes[batches[-1]], "batch 1", f"batch {batches[-1]}",
                    quantity="step time")
ratio = 1 / batch_cmp.ratio
print(f"decode step: {batch_cmp.sentence()}, for {batches[-1]}× the tokens")
exercises.check("nb02.predict_batch_decode", my_prediction, measured=ratio,
                batch=batches[-1])

# %% [markdown]
# ### A batch sweep: what one more sequence costs
#
# The count first: a decode step reads every weight once, whatever the batch, so the weight
# bytes per generated token fall as 1/batch. Then the time, for batches of 1 to 64 sequences at
# 128 cached tokens each (median of 5 runs, min–max as a band), with a line fitted over every
# batch from 2 on and its residual. On the right, one matrix alone, SmolLM2's LM head
# (49152 × 576 float32, 113 MB), through the same `F.linear` call the model makes, at each row
# count: the model's step and the library's matmul, side by side.

# %%
import statistics

from llmlab.profiling import fit_linear
from llmlab.profiling.flops import weight_bytes
from llmlab.viz.roofline import matmul_row_times, plot_batch_sweep

BATCHES = [1, 2, 4, 8, 16] if QUICK else [1, 2, 4, 8, 16, 32, 64]
sweep = {b: (decodes[b] if b in decodes else
             cached_step_times(model, [CONTEXT + 1], repeats=5, batch=b)[0]).times_s
         for b in BATCHES}
head = matmul_row_times(model.lm_head.weight, BATCHES, repeats=7)
med = {b: statistics.median(v) for b, v in sweep.items()}
head_med = {b: statistics.median(v) for b, v in head.items()}
many = [b for b in BATCHES if b >= 2]
fit = fit_linear(many, [med[b] for b in many])
wb = weight_bytes(cfg)
for b in BATCHES:
    print(f"batch {b:2d}: {wb / b / 1e6:6.1f} MB of weights per token | step {med[b] * 1e3:6.1f} ms "
          f"= {med[b] / b * 1e3:5.1f} ms per token | LM head alone {head_med[b] * 1e3:5.2f} ms")
print(f"fit over batch ≥ 2: step ≈ {fit.a * 1e3:.1f} ms + {fit.b * 1e3:.2f} ms × batch "
      f"(rms residual {fit.rms * 1e3:.1f} ms)")
fig = plot_batch_sweep(sweep, head, fit, title=device_name())
plt.show()

# %%
big = BATCHES[-1]
per_token = compare(sweep[1], [t / big for t in sweep[big]], "batch 1",
                    f"batch {big}", quantity="time per generated token")
one_more = compare(sweep[1], sweep[2], "batch 1", "batch 2", quantity="step time")
jump_at = next((b for b in BATCHES if head_med[b] > 1.3 * head_med[1]), None)
step_jump = next((b for p, b in zip(BATCHES, BATCHES[1:]) if med[b] > 1.3 * med[p]), None)
step_jump_from = BATCHES[BATCHES.index(step_jump) - 1] if step_jump else None
straight = fit.rms < 0.05 * statistics.fmean(med[b] for b in many)
display(Markdown(
    f"Batching pays per token: {per_token.sentence()}. From one sequence to two, "
    f"{one_more.sentence()}. A line over batch ≥ 2 gives {fit.a * 1e3:.0f} ms for reading "
    f"the weights and the other fixed work plus {fit.b * 1e3:.1f} ms per sequence, "
    + (f"and fits within {fit.rms * 1e3:.1f} ms rms. " if straight else
       f"but its rms residual of {fit.rms * 1e3:.1f} ms says the step is not a straight line "
       "in the batch: it rises in steps. ")
    + (f"The matrix alone shows the machine's part in it: the LM head takes "
       f"{head_med[1] * 1e3:.1f} ms at one row and {head_med[jump_at] * 1e3:.1f} ms at "
       f"{jump_at}, where the same 113 MB are read once either way. The matrix library picks "
       "its routine by the shape (a matrix–vector product for a row or two, other kernels for "
       "more), and here the routine for more rows reads the same bytes more slowly. "
       + (f"The step's own first jump comes at the same place: {med[step_jump_from] * 1e3:.0f} ms "
          f"at batch {step_jump_from}, {med[step_jump] * 1e3:.0f} ms at {step_jump}. That "
          "switch, not the arithmetic of the extra rows, is what the step pays first."
          if step_jump == jump_at else
          f"The step's first jump of 30% comes at batch {step_jump}, so on this run other "
          "parts of the step weigh in as well.")
       if jump_at is not None else
       "The matrix alone stays within 30% of its one-row time up to "
       f"{BATCHES[-1]} rows: on this machine the library reads the weights as fast for many "
       "rows as for one.")))
expect(per_token.verdict == "faster", f"a token at batch {big} cheaper than at batch 1")

# %% [markdown]
# A prefill reuses each weight for all its prompt tokens, so it sits far to the right of every
# decode point on the roofline, past the ridge for prompts longer than the length printed above.
# On a GPU the ridge point is far higher: an H100 SXM's datasheet gives about 990 TFLOP/s of dense
# bfloat16 over 3.35 TB/s, ≈ 300 FLOP/byte (a spec-sheet model, not measured here), so batch-1
# decode sits even further below it, and batching matters even more.

# %% [markdown]
# ## Play: batch size and sequence length
#
# Move the sliders: the left panel shows the KV cache for that batch and length, the right panel
# where one decode step (and a 32-token prefill) of that batch sits on this machine's roofline
# (from the model, drawn on the roof). Notice that the intensity stops growing at large batch and
# long sequences: every sequence reads its *own* KV cache, which batching cannot share.

# %%
import ipywidgets as widgets


def play(batch: int, seq_len: int) -> None:
    explore(batch, seq_len, cfg, ceil)
    plt.show()


widgets.interactive(play,
                    batch=widgets.IntSlider(value=8, min=1, max=256, step=1),
                    seq_len=widgets.IntSlider(value=512, min=16, max=cfg.max_position_embeddings,
                                              step=16))

# %%
explore(8, 512, cfg, ceil)
plt.show()

# %% [markdown]
# ## Exercises
#
# **1.** On a machine whose ridge point is 10 FLOP/byte, what is the smallest batch size at which a
# SmolLM2 decode step with 512 cached tokens (float32) becomes compute-bound? *Hint:*
# `llmlab.profiling.roofline.decode_cost(cfg, batch, 512).intensity`, in a loop. Compare with the
# naive guess "intensity ≈ batch / 2".

# %%
answer = ...  # YOUR ANSWER: an int, the smallest batch size
exercises.check("nb02.compute_bound_batch", answer)

# %% [markdown]
# **2. Stretch: a cache for a left-padded batch.** Extend your cache so `begin(num_new,
# attention_mask)` accepts a `[batch, num_new]` mask (1 for real tokens, 0 for left padding):
# remember which slots are padding, return positions that count real tokens only (a padded row's
# first real token is position 0), and let `attend` hide the padding keys
# (`backend.forward(..., key_padding_mask=...)`, `[batch, n_k]` bool). The check generates for two
# prompts of different lengths at once, which must give each the tokens it gets alone.

# %%
class MyPaddedKVCache(MyKVCache):
    # YOUR CODE HERE: __init__ (extra state), begin, attend, advance
    def begin(self, num_new, attention_mask=None):
        raise NotImplementedError


exercises.check("nb02.padded_kv_cache", MyPaddedKVCache)

# %% [markdown]
# ## Takeaways
#
# - The KV cache turns a quadratic number of token-passes into a linear one: same tokens, the same TTFT, a flat TPOT.
# - It costs 2 · layers · kv_heads · head_dim · bytes per token per sequence: grouped-query attention and batch size decide whether it fits.
# - A decode step is memory-bound (≈ 0.5 FLOP/byte at batch 1, float32); batching climbs the roofline until each sequence's own KV reads cap it.
#
# ## Further reading
#
# - Shazeer. *Fast Transformer Decoding: One Write-Head is All You Need* (incremental decoding and its memory traffic). 2019. [arXiv:1911.02150](https://arxiv.org/abs/1911.02150)
# - Pope et al. *Efficiently Scaling Transformer Inference.* MLSys 2023. [arXiv:2211.05102](https://arxiv.org/abs/2211.05102)
# - Kwon et al. *Efficient Memory Management for Large Language Model Serving with PagedAttention.* SOSP 2023. [arXiv:2309.06180](https://arxiv.org/abs/2309.06180)
# - Ainslie et al. *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints.* EMNLP 2023. [arXiv:2305.13245](https://arxiv.org/abs/2305.13245)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
# - NVIDIA H100 product page (bandwidth, peak FLOP/s): [H100](https://www.nvidia.com/en-us/data-center/h100/)
# - Zhong et al. *DistServe* (TTFT and TPOT as service objectives). OSDI 2024. [arXiv:2401.09670](https://arxiv.org/abs/2401.09670)
# - All references of the workbook: [REFERENCES.md](REFERENCES.md)
