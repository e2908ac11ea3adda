# %% [markdown]
# # 02 · The KV cache, and the roofline
#
# **Why.** Notebook 01 ran the textbook loop: every new token re-runs the model over the whole
# sequence, so T new tokens cost O(T²) token-passes. The seed article on LLM inference (seed 001)
# points at the waste: at step 2 the input "the dog sat" recomputes the keys and values of
# "the dog", already computed at step 1. Caching K and V removes that: the prompt is processed
# once (**prefill**, TTFT), then each step feeds only the newest token (**decode**, TPOT).
#
# The same article names the catch: with a cache the query of a decode step is a single vector,
# so the big matrix–matrix products (GEMM) become matrix–vector products (GEMV), and the work
# turns from **compute-bound** (prefill) to **memory-bound** (decode). The cache also costs
# memory: the seed article on inference frameworks (seed 000) quotes a 13B model whose weights
# take 26 GB and whose KV cache needs about 3 GB for one prompt sequence. We check that figure,
# build the cache, confirm it changes no token, then measure where prefill and decode sit on
# this machine's roofline.

# %%
import inspect
import os

import matplotlib.pyplot as plt
import numpy as np
import torch

import llmlab
from llmlab.cache import ContiguousKVCache, kv_bytes_per_token, kv_cache_bytes
from llmlab.config import ModelConfig
from llmlab.device import device_name

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
cfg = model.config
print(device_name())

# %% [markdown]
# ## Why, in numbers: how big is a KV cache?
#
# Every layer stores one key and one value vector per KV head for every token:
# **bytes per token = 2 · layers · kv_heads · head_dim · bytes per element**.
# Llama-2-13B has 40 layers and 40 KV heads of dim 128 (no grouped-query attention); SmolLM2-135M
# has 30 layers but only 3 KV heads of dim 64 (its 9 query heads share them, 3 each).

# %%
# NBVAL_CHECK_OUTPUT
llama13b = ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
                       num_heads=40, num_kv_heads=40, head_dim=128, max_position_embeddings=4096)
per_tok_13b = kv_bytes_per_token(llama13b, bytes_per_el=2)
print(f"Llama-2-13B, float16: {per_tok_13b:,} bytes per token (~{per_tok_13b / 1e6:.2f} MB)")
print(f"  one 4096-token sequence: {kv_cache_bytes(llama13b, 1, 4096, 2) / 1e9:.2f} GB "
      "(seed 000: 'about 3 GB per prompt sequence')")
print(f"SmolLM2-135M, float32: {kv_bytes_per_token(cfg, 4):,} bytes per token; "
      f"float16: {kv_bytes_per_token(cfg, 2):,}")

# %% [markdown]
# ## How: a preallocated cache, prefill, then decode
#
# `llmlab.cache.ContiguousKVCache` allocates, per layer, K and V tensors of shape
# `[batch, kv_heads, max_len, head_dim]` once. The attention layer hands the new tokens' rotated
# K/V to `cache.attend`, which writes them into the next slots and attends over everything stored:

# %%
print(inspect.getsource(ContiguousKVCache.attend))

# %% [markdown]
# Rows of a batch are left-padded and share one write offset; `cache.begin` records which new slots
# are real tokens and returns their positions (counting real tokens only), `cache.advance` commits
# them. For a decode step the cache uses one more trick: under grouped-query attention the 3 query
# heads that share a KV head are moved into the query-length axis, so the backend reads the cache
# without copying K/V once per query head:

# %%
from llmlab.cache.contiguous import decode_grouped

print(inspect.getsource(decode_grouped)[inspect.getsource(decode_grouped).index("    b, _"):])

# %% [markdown]
# A whole generation is then one prefill and a loop of decode steps
# (`llmlab.generate(..., kv_cache="contiguous")` does exactly this):

# %%
# NBVAL_CHECK_OUTPUT
ids = torch.tensor([tok("The capital of France is")["input_ids"]])
cache = ContiguousKVCache.for_model(model, batch=1, max_len=ids.shape[1] + 8)
with torch.inference_mode():
    positions = cache.begin(ids.shape[1])                                   # prefill
    logits = model(ids, positions=positions, cache=cache, last_only=True)
    cache.advance()
    new = []
    for _ in range(8):                                                      # decode
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        new.append(int(nxt))
        positions = cache.begin(1)
        logits = model(nxt, positions=positions, cache=cache, last_only=True)
        cache.advance()
print(repr(tok.decode(new)), "| cache:", cache.length, "slots used of", cache.max_len)

# %% [markdown]
# ## Check: same logits, same tokens
#
# First the logits: a batch of two prompts of different lengths (so one is left-padded) goes
# through prefill + 12 decode steps, and is compared with one no-cache forward over the full
# sequences (the baseline, with its attention mask).

# %%
# NBVAL_CHECK_OUTPUT
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
print("max |Δ logits| over real tokens < 1e-3:", err < 1e-3)

# %% [markdown]
# Then the tokens: greedy generation with and without the cache, past the end-of-sequence token
# (`ignore_eos=True`) so every run generates the same number of tokens. These two runs are also
# what we time below.

# %%
# NBVAL_CHECK_OUTPUT
N_NEW = 16 if QUICK else 40
question = "Explain in two sentences why the sky is blue."
no_cache = llmlab.generate(model, tok, question, max_new_tokens=N_NEW, ignore_eos=True)
cached = llmlab.generate(model, tok, question, max_new_tokens=N_NEW, ignore_eos=True,
                         kv_cache="contiguous")
print("prompt tokens:", len(cached.prompt_token_ids), "| new tokens:", len(cached.token_ids))
print("same greedy tokens:", no_cache.token_ids == cached.token_ids)
print(repr(cached.text[:70]))

# %% [markdown]
# ## Measure: quadratic against linear, TTFT and TPOT
#
# `token_times_s` holds when each token arrived. Without the cache each step is slower than the
# last (it re-reads a longer sequence), so the total grows quadratically; with the cache every
# decode step costs about the same, and the total grows linearly.

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.3), dpi=80)
for g, label in ((no_cache, "no cache"), (cached, "KV cache")):
    t = np.array(g.token_times_s)
    a1.plot(np.arange(1, len(t) + 1), np.diff(np.concatenate([[0.0], t])) * 1e3, ".-", label=label)
    a2.plot(np.arange(1, len(t) + 1), t, ".-", label=label)
a1.set(xlabel="token #", ylabel="ms for this token", title="time per token", yscale="log")
a2.set(xlabel="tokens generated", ylabel="seconds since start", title="total time")
for a in (a1, a2):
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
fig.suptitle(device_name(), fontsize=9)
fig.tight_layout()
plt.show()

# %%
for g, label in ((no_cache, "no cache"), (cached, "KV cache")):
    m = g.metrics
    print(f"{label:>9}: TTFT {m.ttft_s * 1e3:7.1f} ms | TPOT {m.tpot_s * 1e3:7.1f} ms | "
          f"{m.tokens_per_s:5.1f} tokens/s")
print(f"speed-up of the whole generation: {no_cache.metrics.e2e_s / cached.metrics.e2e_s:.1f}x "
      f"for {N_NEW} tokens (it grows with the length)")

# %% [markdown]
# TTFT is about the same either way (both run the prompt once before the first token); the cache
# wins on TPOT. The price is memory that grows linearly with sequence length *and* batch size —
# for SmolLM2 in float32 below, with the weights for scale. The formula is checked against the
# bytes of a real cache:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.viz.roofline import plot_cache_memory

real = ContiguousKVCache.for_model(model, batch=4, max_len=1024)
print("formula == bytes of the real cache tensors:",
      kv_cache_bytes(cfg, 4, 1024, 4) == real.nbytes, f"({real.nbytes / 2**20:.0f} MiB)")
del real

# %%
plot_cache_memory(cfg, batches=(1, 8, 32), max_seq=cfg.max_position_embeddings, bytes_per_el=4)
plt.show()

# %% [markdown]
# ## Measure: the roofline
#
# Two numbers bound any kernel on this machine: how fast memory can be streamed (a large copy) and
# how fast it can multiply (a large matmul). A forward that does F FLOPs while moving B bytes has
# arithmetic intensity I = F / B and can at best run at min(peak FLOP/s, bandwidth · I).
# `llmlab.profiling.roofline` measures the two ceilings and models F and B of a prefill and of a
# decode step (weights read once, activations, KV cache read and written); then we time real
# forwards and place them on the plot.

# %%
from llmlab.profiling.roofline import (decode_cost, measure_ceilings, prefill_cost,
                                       time_decode_step, time_prefill)
from llmlab.viz.roofline import explore, plot_roofline

ceil = measure_ceilings(copy_bytes=128 * 2**20, matmul_n=1024, repeats=3)
print(f"{ceil.device}: copy {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
      f"matmul {ceil.peak_flops_per_s / 1e9:.0f} GFLOP/s, ridge point {ceil.ridge_point:.1f} FLOP/byte")

# %%
# NBVAL_CHECK_OUTPUT
print(f"modelled intensity, float32: prefill of 128 tokens {prefill_cost(cfg, 1, 128).intensity:.0f}"
      f" FLOP/byte; decode step, batch 1: {decode_cost(cfg, 1, 128).intensity:.2f} FLOP/byte")

# %%
CONTEXT = 128
batches = [1, 4] if QUICK else [1, 4, 16]
points = [time_prefill(model, 1, 64 if QUICK else 128, repeats=2)]
points += [time_decode_step(model, b, CONTEXT, repeats=3) for b in batches]
for p in points:
    print(f"{p.label:>22}: {p.seconds * 1e3:7.1f} ms, {p.intensity:6.2f} FLOP/byte, "
          f"{p.flops_per_s / 1e9:5.1f} GFLOP/s = {p.share_of_roof(ceil):.0%} of the roof there")
plot_roofline(ceil, points, title=f"roofline, measured: {device_name()}")
plt.show()

# %% [markdown]
# At batch 1 a decode step does about 2 FLOPs per 4-byte weight it reads: intensity ≈ 0.5, deep in
# the memory-bound region, so its best possible speed is set by bandwidth, not by arithmetic. More
# sequences per step reuse each weight read (the GEMV becomes a skinny GEMM) and the point climbs
# toward the compute roof. Prefill is already there.

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
# **1.** How many bytes of KV cache does one token take in Llama-2-7B in float16 (32 layers, 32 KV
# heads, head_dim 128)? *Hint:* `llmlab.cache.kv_bytes_per_token`, or by hand.

# %%
from llmlab.exercises import nb02

# YOUR CODE HERE
answer = None  # an int: bytes per token
# END
nb02.check_kv_bytes_7b(answer)

# %% [markdown]
# **2.** On a machine whose ridge point is 10 FLOP/byte, what is the smallest batch size at which a
# SmolLM2 decode step with 512 cached tokens (float32) becomes compute-bound? *Hint:*
# `llmlab.profiling.roofline.decode_cost(cfg, batch, 512).intensity`, in a loop. Compare with the
# naive guess "intensity ≈ batch / 2".

# %%
# YOUR CODE HERE
answer = None  # an int: the smallest batch size
# END
nb02.check_compute_bound_batch(answer, cfg, context=512, ridge_point=10.0)

# %% [markdown]
# ## Takeaways
#
# - The KV cache turns O(T²) token-passes into O(T): same tokens, TTFT unchanged, TPOT flat.
# - It costs 2 · layers · kv_heads · head_dim · bytes per token per sequence: grouped-query attention and batch size decide whether it fits.
# - Decode is memory-bound (≈ 0.5 FLOP/byte at batch 1, float32); batching climbs the roofline until each sequence's own KV reads cap it.
