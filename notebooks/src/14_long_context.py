# %% [markdown]
# # 14 · Long context
#
# **Why.** A KV cache grows by a fixed number of bytes per token, the same for every token,
# and a long context multiplies it. Per token and layer, with $n_h$ query heads of dimension
# $d_h$, $n_g$ KV heads and $b$ bytes per number (DeepSeek-AI, *DeepSeek-V2*, 2024,
# [arXiv:2405.04434](https://arxiv.org/abs/2405.04434), Table 1):
#
# | attention | bytes per token and layer | |
# |---|---|---|
# | multi-head (MHA) | $2\,n_h d_h b$ | every head keeps its own K and V |
# | grouped-query (GQA) | $2\,n_g d_h b$ | heads share K/V in groups (Ainslie et al., EMNLP 2023, [arXiv:2305.13245](https://arxiv.org/abs/2305.13245)) |
# | multi-head latent (MLA) | $(d_c + d_h^R)\, b$ | one compressed latent per token, K and V rebuilt from it |
#
# Notebook 13 reused K/V across requests; here one request is the problem. There are two ways
# out, and this notebook builds both:
#
# - **Read the long cache faster.** Decoding reads every cached K/V once per token. The paged
#   kernel of notebook 04 gives each (sequence, KV head) *one* program that walks the whole
#   context alone: SmolLM2 at batch 1 decodes with 3 programs, on a GPU with 132 SMs.
#   *Flash-decoding* (Dao, Haziza, Massa, Sizov, [Flash-Decoding for long-context
#   inference](https://crfm.stanford.edu/2023/10/12/flashdecoding.html), 2023) also splits
#   the keys of each sequence across programs and merges their results exactly: up to 8×
#   faster generation of very long sequences in their measurements.
# - **Keep less.** A sliding window keeps the last $w$ tokens; StreamingLLM (Xiao, Tian,
#   Chen, Han, Lewis, *Efficient Streaming Language Models with Attention Sinks*, ICLR 2024,
#   [arXiv:2309.17453](https://arxiv.org/abs/2309.17453)) found that a window alone collapses
#   as soon as the first tokens leave it, and that keeping 4 of them ("attention sinks")
#   beside the window keeps perplexity stable over 4 million tokens.
#
# You first size the problem (KV bytes per token for MHA, GQA, MLA and a window), then
# **build** the merge of split-KV partials, check it and the Triton kernels against unsplit
# attention, model how many splits an H100 wants, and measure SmolLM2's perplexity when a
# window evicts its first tokens, with and without sinks.

# %%
import os
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.attention.paged import paged_attention_reference
from llmlab.attention.split_kv import (choose_num_splits, split_bounds, split_kv_partials,
                                       split_occupancy)
from llmlab.bench.sinks import load_sweep, long_text_ids
from llmlab.cache.sinks import streaming_nll
from llmlab.device import describe
from llmlab.kernels import report as R
from llmlab.viz.long_context import explore_sinks, plot_split_occupancy

if os.environ.get("LLMLAB_THREADS"):      # e.g. 1 on a machine whose cores are busy
    torch.set_num_threads(int(os.environ["LLMLAB_THREADS"]))
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
print("torch threads", torch.get_num_threads())
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")

# %% [markdown]
# ## Predict: one sequence's KV cache
#
# Llama-3-8B has 32 layers and 8 KV heads of 128 (its
# [config.json](https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json)).
# Before the calculator below prints it: how many GiB of bfloat16 K/V does **one** sequence of
# 128k tokens (131,072) need?

# %%
gib_128k = ...  # YOUR ANSWER: a number of GiB

# %%
print(exercises.check("nb14.kv_gib_128k", gib_128k))

# %% [markdown]
# `llmlab.profiling.kv_memory.kv_bytes` is that arithmetic for the three models and the three
# schemes, and for a sliding window that keeps `sinks + window` tokens whatever the context.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.profiling.kv_memory import MODELS, kv_bytes   # the calculator, after the question

print(f"{'model':13s} {'scheme':6s} {'KiB/token':>10s} {'GiB at 128k':>12s}")
for name in MODELS:
    for scheme in ("mha", "gqa", "mla"):
        if scheme == "mla" and not MODELS[name].latent_dim:
            continue
        if scheme == "gqa" and MODELS[name].native == "mla":
            continue
        r = kv_bytes(name, scheme, context=128 * 1024)
        mark = " (its own)" if scheme == MODELS[name].native else ""
        print(f"{r.model:13s} {scheme:6s} {r.per_token / 1024:10.1f} {r.total / 2**30:12.2f}{mark}")
w = kv_bytes("llama-3-8b", context=128 * 1024, window=1020, sinks=4)
print(f"Llama-3-8B, 4 sinks + 1020-token window: {w.cached_tokens} tokens kept, "
      f"{w.total / 2**30:.3f} GiB at 128k ({w.per_token / 1024:.1f} KiB per token of context)")

# %% [markdown]
# ## How: partial outputs and their log-sum-exp
#
# For one query, softmax attention over keys $1..n$ with scores $x_j = q\cdot k_j / \sqrt{d}$
# is $\mathrm{out} = \sum_j e^{x_j} v_j \,/\, \sum_j e^{x_j}$. Split the keys into ranges
# $R_1 \dots R_S$. Program $s$ sees only its range and returns two things:
#
# $$o_s = \frac{\sum_{j \in R_s} e^{x_j} v_j}{\sum_{j \in R_s} e^{x_j}}, \qquad
#   \mathrm{lse}_s = \log \sum_{j \in R_s} e^{x_j}$$
#
# Each $o_s$ is a proper softmax average, but over its own range only, and $\mathrm{lse}_s$
# says how much softmax mass that range holds. A range a short sequence does not reach holds
# no key: its $o_s$ is zeros and its $\mathrm{lse}_s = -\infty$.
#
# `llmlab.attention.split_kv.split_kv_partials` computes the partials from the paged pool
# (in PyTorch; the Triton kernel writes the same ones). Four sequences of ragged lengths,
# SmolLM2's 9 query heads over 3 KV heads, 4 splits each:

# %%
g = torch.Generator().manual_seed(0)
lens, block, kv_heads, heads, head_dim = [37, 70, 5, 129], 16, 3, 9, 64
blocks = [-(-n // block) for n in lens]
k_pool = torch.randn(sum(blocks) + 2, block, kv_heads, head_dim, generator=g)
v_pool = torch.randn(sum(blocks) + 2, block, kv_heads, head_dim, generator=g)
order = torch.randperm(sum(blocks) + 2, generator=g).tolist()
table = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32)
for b, nb in enumerate(blocks):
    table[b, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
seqlens = torch.tensor(lens, dtype=torch.int32)
q = torch.randn(len(lens), 1, heads, head_dim, generator=g)
o_parts, lse_parts = split_kv_partials(q, k_pool, v_pool, seqlens, table, 4, tile=32)
print("o  ", tuple(o_parts.shape), "  [splits, batch, 1, heads, head_dim]")
print("lse", tuple(lse_parts.shape), "      [splits, batch, 1, heads]")
for b, n in enumerate(lens):
    print(f"sequence of {n:3d} keys: ranges {split_bounds(n, 4, 32)}, lse of head 0: "
          + ", ".join(f"{float(x):6.2f}" for x in lse_parts[:, b, 0, 0]))

# %% [markdown]
# ## Build: merge the partials
#
# Write `merge_splits(o, lse)`: `o [splits, ..., head_dim]` and `lse [splits, ...]` as
# above; return the attention output over *all* keys, `[..., head_dim]`. Every query sees at
# least one key, but a split may see none. Work out which weight each $o_s$ needs so that
# $\sum_s w_s o_s$ is the softmax over every key, and keep every `exp` finite (the scores of a
# real model reach the hundreds).
#
# The checker merges partials like those above (4 ragged sequences, 4 splits, some of them
# empty) against unsplit attention, then runs SmolLM2 through the paged engine with every
# layer's decode attention split in 4 and merged by your function: the greedy tokens must be
# the unsplit ones.

# %%
def merge_splits(o, lse):
    raise NotImplementedError


# %%
print(exercises.check("nb14.lse_merge", merge_splits))

# %% [markdown]
# ## Check: the Triton kernels
#
# llmlab's merge is `llmlab.attention.split_kv.merge_partials`. In Triton
# (`llmlab.kernels.paged_attn.paged_attention_split`), a first kernel runs on a grid of
# (query tiles, sequence × KV head, **split**), each program walking only its run of key
# tiles and writing a float32 partial and its lse; a second kernel merges them, one program
# per 16 rows. Without a GPU both run in Triton's interpreter. Against the unsplit kernel of
# notebook 04, at the ragged lengths above (none a multiple of the 16-token block or the
# 32-key tile):

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.attention.paged import paged_attention_triton   # llmlab's merge and kernels, after the build
from llmlab.attention.split_kv import merge_partials
from llmlab.kernels.paged_attn import paged_attention_split

want = paged_attention_reference(q, k_pool, v_pool, seqlens, table)
merged, _ = merge_partials(o_parts, lse_parts)
kernel_device = "cuda" if torch.cuda.is_available() else "cpu"   # compiled there, else interpreted
on_kernel = [t.to(kernel_device) for t in (q, k_pool, v_pool, seqlens, table)]
unsplit = paged_attention_triton(*on_kernel).cpu()
split4, lse4, _, _ = paged_attention_split(*on_kernel, 4, return_partials=True)
split4, lse4 = split4.cpu(), lse4.cpu()
print(f"PyTorch merge vs unsplit reference: max |error| < 1e-5 (float32 rounding): "
      f"{float((merged - want).abs().max()) < 1e-5}")
print(f"Triton split (4) vs Triton unsplit: max |error| < 1e-5 (float32 rounding): "
      f"{float((split4 - unsplit).abs().max()) < 1e-5}")
print("the kernels' merged lse equals log Σ_s exp(lse_s) of the PyTorch partials:",
      bool(torch.allclose(lse4, torch.logsumexp(lse_parts, dim=0), atol=1e-4)))

# %% [markdown]
# ## Model: how many splits on an H100
#
# More splits mean more programs, but each split adds a partial to write and merge.
# `choose_num_splits` follows FlashAttention-2's rule (`num_splits_heuristic` in
# [`flash_api.cpp`](https://github.com/Dao-AILab/flash-attention/blob/main/csrc/flash_attn/flash_api.cpp)):
# no split when the unsplit grid fills 80% of the chip's program slots; otherwise the fewest
# splits whose *wave efficiency* (programs / slots, over its round-up) is within 85% of the
# best. The slots per SM come from the compile report: how many programs of the split kernel
# fit on one SM of an H100 by registers and shared memory (built ahead of time for sm_90,
# `python -m llmlab.kernels.report --kernel paged_split`).
#
# The plot is a **model** (`split_occupancy`): programs run in waves of `slots`, a wave lasts
# one split's walk over its keys, the merge costs a second launch plus the partials' bytes.
# It leaves out that a full chip is limited by HBM bandwidth, not by programs.

# %%
build = R.lookup("paged_split", "H100", "bf16", block_size=16, head_dim=64)
print(f"split kernel, sm_90 bfloat16, head_dim 64: {build.registers} registers/thread, "
      f"{build.spill_bytes} B spilled, {build.shared_bytes / 1024:.0f} KiB shared -> "
      f"{build.blocks_per_sm} programs per SM (limited by {build.occupancy_limiter})")
cases = {"SmolLM2, batch 1, 32k": (1, 3, 32768), "Llama-3-8B, batch 1, 32k": (1, 8, 32768),
         "Llama-3-8B, batch 16, 4k": (16, 8, 4096)}
plot_split_occupancy(cases, num_sms=132, blocks_per_sm=build.blocks_per_sm)
plt.show()

# %%
picked, waves = {}, {}
for label, (batch, kvh, ctx) in cases.items():
    s = choose_num_splits(batch * kvh, -(-ctx // 64), 132, build.blocks_per_sm)
    one, best = (split_occupancy(batch, kvh, ctx, n, 132, build.blocks_per_sm) for n in (1, s))
    picked[label] = (s, one.step_time / best.step_time)
    waves[label] = (one.waves, best.waves)
    print(f"{label:26s} {s:4d} splits: slots busy {one.sm_busy:5.1%} -> {best.sm_busy:5.1%}, "
          f"waves {one.waves} -> {best.waves}, modeled step {one.step_time / best.step_time:5.1f}x faster")


def extreme(pick):
    """Every case at the highest (or lowest) speed-up as printed: a tie names them all."""
    x = pick(round(v, 1) for _, v in picked.values())
    ks = [k for k, (_, v) in picked.items() if round(v, 1) == x]
    if len(ks) == 1:
        return ks[0]
    alike = len({(picked[k][0], waves[k]) for k in ks}) == 1
    return (" and ".join(ks) + f", tied at {x:.1f}×"
            + (f" (the same {picked[ks[0]][0]} splits and the same waves, split or not, so the "
               "model gives them equally long steps)" if alike else ""))


display(Markdown(
    "In this model, " + "; ".join(f"{k} takes {s} split{'s' * (s > 1)} "
                                  f"({x:.1f}× the unsplit step's speed)"
                                  for k, (s, x) in picked.items())
    + f". Splitting pays most for {extreme(max)}, and least for {extreme(min)}: what it fixes "
    "is a grid with fewer programs than the chip has slots."))

# %% [markdown]
# ## How: a window with attention sinks
#
# A rolling cache keeps the first $s$ tokens and the last $w$, and evicts everything between.
# Positions follow StreamingLLM's section 3.2: RoPE is applied at positions **within the
# cache**, not in the text. Keys are cached *before* RoPE; at each step the $c$ kept keys are
# rotated at $0 \dots c-1$ and the query at $c-1$. With $s = 4$, $w = 4$, decoding token 9
# of the text:
#
# ```
# text index     0  1  2  3  .  .  6  7  8  9      (4, 5 evicted)
# cache position 0  1  2  3        4  5  6  7      the query: 9 -> 7
# ```
#
# RoPE scores depend only on the difference of two positions, so the window's distances are
# the text's; what changes is the distance to the sinks, which never exceeds the cache's size.
# `llmlab.cache.sinks.SinkKVCache` does this for every layer of SmolLM2 (it asks the model to
# rotate at position 0, where RoPE is the identity, and rotates itself), and takes a chunk of
# tokens at a time, each with its own window, with the same result as one at a time.
#
# ## Measure: SmolLM2 past its window
#
# The text is the first 1,024 tokens of the workbook's own prose (`data/text/`), scored on the
# predictions after token `skip` (where every window of the sweep below has started to
# evict). `python -m llmlab.bench sinks` measured the full cache and every window × sinks
# setting of the widget below on it (committed); this run measures a window of 256 alone and
# with 4 sinks again, live:

# %%
sweep = load_sweep()
committed = {(r["sinks"], r["window"]): r["ppl"] for r in sweep["rows"]}
ids = long_text_ids(tok, sweep["tokens"])
WINDOW = 256
live = []
for sinks in (0, 4):
    t0 = time.perf_counter()
    nll = streaming_nll(model, ids, sinks, WINDOW, chunk=sweep["chunk"])
    ppl = float(torch.exp(nll[sweep["skip"]:].mean()))
    live.append({"sinks": sinks, "window": WINDOW, "ppl": ppl})
    print(f"{sinks} sinks + {WINDOW} recent tokens: perplexity {ppl:6.2f} "
          f"(committed sweep {committed[(sinks, WINDOW)]:.2f}; {time.perf_counter() - t0:.1f} s)")
full_ppl = committed[(0, None)]
alone_ppl, sinks_ppl = live[0]["ppl"], live[1]["ppl"]
print(f"full cache (every token), from the sweep: {full_ppl:.2f} "
      f"({sweep['meta']['device']}, {sweep['meta']['date']})")

# %%
display(Markdown(
    f"Over tokens {sweep['skip']}–{sweep['tokens'] - 1} of the text, the window of {WINDOW} "
    f"alone has {alone_ppl / full_ppl:.2f}× the full cache's perplexity ({alone_ppl:.1f} "
    f"against {full_ppl:.1f}); keeping 4 sinks beside it brings it to "
    f"{sinks_ppl / full_ppl:.2f}× ({sinks_ppl:.1f}), with a cache of {WINDOW + 4} tokens "
    f"instead of {sweep['tokens']}. Across the sweep, the window alone ranges from "
    + ", ".join(f"{committed[(0, w)] / full_ppl:.1f}× (window {w})" for w in
                sorted(w for s_, w in committed if s_ == 0 and w is not None))
    + " and 4 sinks from "
    + ", ".join(f"{committed[(4, w)] / full_ppl:.2f}×" for w in
                sorted(w for s_, w in committed if s_ == 4 and w is not None)) + "."))

# %% [markdown]
# Why did the window alone do so much worse, and why do 4 tokens that say nothing about the
# rest of the text repair it?

# %%
exercises.ask("nb14.explain_sinks")

# %%
sinks_answer = ...  # YOUR ANSWER: "a", "b", "c" or "d"

# %%
print(exercises.check("nb14.explain_sinks", sinks_answer, alone=alone_ppl / full_ppl,
                      with_sinks=sinks_ppl / full_ppl))

# %% [markdown]
# ## Play: window × sinks
#
# The widget reads the committed sweep (`python -m llmlab.bench sinks`, every window and sink
# count below on the same text; the rings are this run's measurements). Left: perplexity
# against the window per sink count; right: the loss along the text for the chosen setting
# and for its window alone, against the full cache. Where does the window alone depart from
# the full cache, and how many sinks does it take to come back?

# %%
windows = sorted({r["window"] for r in sweep["rows"] if r["window"] is not None})
sink_counts = sorted({r["sinks"] for r in sweep["rows"] if r["window"] is not None})


def play_sinks(window: int, sinks: int) -> None:
    row = explore_sinks(sweep, window, sinks, live)
    plt.show()
    print(f"window {window} + {sinks} sinks: perplexity {row['ppl']:.2f}, "
          f"{row['vs_full']:.2f}× the full cache's")


widgets.interactive(play_sinks, window=widgets.SelectionSlider(options=windows, value=WINDOW),
                    sinks=widgets.SelectionSlider(options=sink_counts, value=4))

# %% [markdown]
# ## Stretch: one decode query of the sinks cache
#
# Write `sinks_attention(q, k, v, sinks, window, rope)` for one new token: `q [batch, 1,
# heads, head_dim]`; `k`, `v [batch, n, kv_heads, head_dim]`, **every** token so far with the
# query's own last, none of them rotated. Keep the sinks and the window, rotate with
# `rope(x, positions)` (`x [batch, m, heads, head_dim]`, `positions [m]`) as StreamingLLM
# does, and return `[batch, 1, heads, head_dim]` (query head h reads KV head
# `h // (heads // kv_heads)`). The checker tries random cases, then decodes a SmolLM2 text
# token by token with your function in every layer against `SinkKVCache`'s losses.

# %%
def sinks_attention(q, k, v, sinks, window, rope):
    raise NotImplementedError


# %%
print(exercises.check("nb14.sinks_attention", sinks_attention))

# %% [markdown]
# ## Takeaways
#
# - A KV cache costs the same bytes for every token of context: 2 × layers × KV heads × head
#   dimension × bytes per number for GQA, less for a compressed latent (MLA), and a constant for
#   a window, whatever the context.
# - Split-KV decode gives one long sequence many programs: each range of keys returns its
#   output and its log-sum-exp, and weighting each output by its share of the softmax mass
#   merges them exactly.
# - A window alone loses the first tokens, where the heads park attention; keeping a few of them
#   as sinks beside the window brings perplexity back near the full cache's, at a fixed size.
#
# ## Further reading
#
# - Dao, Haziza, Massa, Sizov. [Flash-Decoding for long-context
#   inference](https://crfm.stanford.edu/2023/10/12/flashdecoding.html). 2023.
# - Dao. *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning.*
#   ICLR 2024. [arXiv:2307.08691](https://arxiv.org/abs/2307.08691); its split rule:
#   `num_splits_heuristic` in
#   [`flash_api.cpp`](https://github.com/Dao-AILab/flash-attention/blob/main/csrc/flash_attn/flash_api.cpp)
# - Xiao, Tian, Chen, Han, Lewis. *Efficient Streaming Language Models with Attention Sinks.*
#   ICLR 2024. [arXiv:2309.17453](https://arxiv.org/abs/2309.17453)
# - DeepSeek-AI. *DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
#   Model* (section 2.1: multi-head latent attention). 2024.
#   [arXiv:2405.04434](https://arxiv.org/abs/2405.04434)
# - Ainslie et al. *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
#   Checkpoints.* EMNLP 2023. [arXiv:2305.13245](https://arxiv.org/abs/2305.13245); Jiang et al.
#   *Mistral 7B* (a sliding window in a released model). 2023.
#   [arXiv:2310.06825](https://arxiv.org/abs/2310.06825)
