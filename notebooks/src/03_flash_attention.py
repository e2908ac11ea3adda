# %% [markdown]
# # 03 · FlashAttention: exact attention without the N×N matrix
#
# **Why.** Textbook attention computes S = QKᵀ, writes the whole N×N score matrix to memory,
# reads it back for the softmax, writes the probabilities P and reads them again to multiply
# by V. On a GPU that memory is HBM, the large and slow level of the hierarchy. Figure 1 of the
# FlashAttention paper (Dao, Fu, Ermon, Rudra and Ré, NeurIPS 2022) gives the A100's numbers:
# on-chip **SRAM about 19 TB/s but only about 20 MB** in total, **HBM about 1.5 TB/s and 40 GB**.
# Attention is therefore limited by the bytes it moves, not by its arithmetic, and its memory
# grows as N².
#
# FlashAttention cuts Q, K and V into blocks small enough for the chip, computes one Br×Bc
# tile of scores at a time, and never writes S or P to HBM. The softmax of a whole row is
# assembled block by block with a running maximum and a running sum (the *online softmax* of
# Milakov and Gimelshein, 2018), so the result is exact, not an approximation. The paper
# reports end-to-end training 15% faster than the MLPerf 1.1 record on BERT-large, 3× faster
# than the Hugging Face implementation on GPT-2 (sequence length 1K), and 2.4× faster on the
# long-range arena benchmark.
#
# In this notebook you **write** the online-softmax step and then the tiled forward
# (`flash_forward`), which runs inside SmolLM2; you measure its memory against `naive` and
# model its HBM traffic the way the paper does. The optional notebook 03b takes the same loop
# to a GPU: a roofline model with H100 figures, the inner loop of a Triton kernel (a stretch
# that runs on this CPU in Triton's interpreter), and what the compiler makes of a tile.

# %%
import math
import os

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
import llmlab.attention as A
from llmlab import exercises
from llmlab.device import describe
from llmlab.profiling import peak_memory, time_fn
from llmlab.profiling.hbm import (A100, CHIPS, paper_block_sizes, standard_attention_hbm,
                                  tiled_attention_hbm, tiled_attention_hbm_for_sram)

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")

# %% [markdown]
# ## Why: the memory hierarchy in numbers
#
# The chip presets in `llmlab.profiling.hbm` carry vendor datasheet figures (each one cited in
# the source). An SM (*streaming multiprocessor*) is one of the GPU's cores; "smem/SM" is the
# shared memory one thread block on it can use, the budget a FlashAttention tile must fit in.

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'chip':16s} {'HBM':>7s} {'HBM TB/s':>9s} {'SMs':>4s} {'smem/SM':>8s} {'SRAM total':>10s} "
      f"{'bf16 TFLOP/s':>12s} {'FLOP/byte':>9s}")
for c in CHIPS.values():
    print(f"{c.name:16s} {c.hbm_bytes / 1e9:5.0f}GB {c.hbm_bandwidth / 1e12:9.2f} {c.sms:4d} "
          f"{c.smem_per_sm // 1024:5d}KiB {c.sram_total / 2**20:8.1f}MiB "
          f"{c.peak_bf16_flops / 1e12:12.0f} {c.ridge_flops_per_byte:9.0f}")
print(f"\nA100 SRAM bandwidth (FlashAttention paper, Fig. 1): {A100.sram_bandwidth / 1e12:.0f} TB/s, "
      f"{A100.sram_bandwidth / A100.hbm_bandwidth:.0f}× its HBM")

# %% [markdown]
# What `naive` attention puts in HBM for SmolLM2 (9 query heads) at batch 1, one layer, float32
# (a count, not a measurement):

# %%
# NBVAL_CHECK_OUTPUT
heads = 9
for n in (2048, 8192, 32768):
    score_bytes = heads * n * n * 4
    passes = 4 * score_bytes            # write S, read S, write P, read P
    print(f"N={n:6d}: one score matrix {score_bytes / 2**30:7.2f} GiB; "
          f"4 passes over it at A100 HBM speed {passes / A100.hbm_bandwidth * 1e3:8.1f} ms per layer")

# %% [markdown]
# ## How (1): the online softmax
#
# softmax(s)ⱼ = exp(sⱼ − m) / Σₖ exp(sₖ − m) needs the row maximum m and the row sum, both
# over the *whole* row. The tiled loop only ever sees one block of the row, so it keeps, per row,
#
# - `m`: the largest score seen so far,
# - `l`: Σ exp(s − m) over the scores seen so far,
# - `acc`: Σ exp(s − m) · v over the scores seen so far,
#
# and, at the end, output = acc / l. When a new block arrives, its row maximum may exceed m.
# Everything accumulated so far was exponentiated against the old maximum; since
# exp(s − m) = exp(s − m_new) · exp(m_new − m), the old `l` and `acc` are brought to the new
# maximum by one factor per row, exp(m − m_new), which is ≤ 1. That **rescaling** is the
# whole trick. (Subtracting the maximum at all keeps exp from overflowing; the first block has
# nothing to rescale, because exp(−∞) = 0.)
#
# ### Exercise 1 (build): one online-softmax step
#
# Given the running `m` [rows], `l` [rows], `acc` [rows, d], a block of `scores` [rows, cols]
# (masked entries are −inf) and `v_block` [cols, d], return `(m_new, l_new, acc_new)`.
# Useful: `torch.maximum`, `Tensor.amax(dim=-1)`, `torch.exp`, `@`, and `x[:, None]` to
# broadcast a per-row factor over a row of `acc`.

# %%
# NBVAL_CHECK_OUTPUT
def online_softmax_step(m, l, acc, scores, v_block):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb03.online_softmax_step", online_softmax_step)

# %% [markdown]
# Compare with llmlab's: `llmlab.attention.flash.online_softmax_update` is this step (it also
# keeps rows that have seen only masked keys at m = −∞, l = 0). One query row, 12 keys, blocks
# of 4 keys, later blocks holding larger scores: the state after each block.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.attention.flash import online_softmax_update

g = torch.Generator().manual_seed(1)
scores = torch.randn(1, 12, generator=g, dtype=torch.float64)       # one row of QKᵀ·scale
scores[:, 4:8] += 1.5                   # later blocks hold larger scores, so the max grows
scores[:, 8:] += 3.0
values = torch.randn(12, 3, generator=g, dtype=torch.float64)       # V, head_dim 3
m = torch.full((1,), float("-inf"), dtype=torch.float64)
l = torch.zeros(1, dtype=torch.float64)
acc = torch.zeros(1, 3, dtype=torch.float64)
for j in range(0, 12, 4):
    m_old = m
    m, l, acc = online_softmax_update(m, l, acc, scores[:, j:j + 4], values[j:j + 4])
    print(f"keys {j:2d}-{j + 3:2d}: block max {scores[0, j:j + 4].max():+.3f}  running m {m.item():+.3f}  "
          f"rescale exp(m_old - m) = {torch.exp(m_old - m).item():.3f}  l = {l.item():.3f}")
exact = torch.softmax(scores, -1) @ values
print("online acc / l :", [round(x, 6) for x in (acc / l[:, None])[0].tolist()])
print("full softmax·V :", [round(x, 6) for x in exact[0].tolist()])
print(f"max |Δ| = {((acc / l[:, None]) - exact).abs().max().item():.0e} (float64 rounding)")

# %% [markdown]
# ## How (2): tiling, and which tiles a causal pass visits
#
# The tiled forward loops over blocks of Br queries and, for each, over blocks of Bc keys.
# With a causal mask (query i sees key j when j ≤ i + N_k − N_q: aligned bottom-right, as in
# FlashAttention-2, so the last query sees every key), tiles entirely above the diagonal are
# **skipped**, never loaded, and only tiles the diagonal crosses need a mask. Left: a causal
# prefill of 64 tokens. Right: 16 new queries over 64 keys (a chunk of new tokens over a KV
# cache): the queries are the last 16 positions, so they see almost everything. The axes count
# positions; the white grid lines are the block boundaries.

# %%
from llmlab.viz.flash import plot_block_schedule

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), dpi=80)
plot_block_schedule(64, 64, 16, 16, causal=True, ax=axes[0])
plot_block_schedule(16, 64, 8, 16, causal=True, ax=axes[1])
axes[0].get_legend().remove()
fig.tight_layout()

# %% [markdown]
# ### Exercise 2 (build): the tiled forward, `flash_forward(q, k, v, block_m, block_n, causal=True)`
#
# Shapes as in notebook 01: q [batch, heads, n_q, d], k and v [batch, kv_heads, n_k, d];
# query head h reads KV head h // (heads // kv_heads); scale 1/√d; causal aligned
# bottom-right. Return [batch, heads, n_q, d]. The plan, per block of `block_m` query rows:
# start m = −∞, l = 0, acc = 0; for each block of `block_n` keys the rows may see, compute
# that one tile of scores, set the masked ones to −inf, fold it in with your step; then
# write acc / l for those rows. Never build anything of size n_q × n_k.
#
# The checker runs five small cases, each adding one difficulty (several key blocks, lengths
# that the blocks do not divide, causal, fewer queries than keys), fits the exponent of your
# function's peak memory between N = 256 and 1024, and finally registers your function as an
# attention backend of SmolLM2 (`llmlab.attention.register`) and compares the greedy tokens
# with `naive`. While your function runs on the small cases, llmlab's own attention functions
# (and its online-softmax step) and torch's fused attention raise: the loop is yours, and your
# `online_softmax_step` from exercise 1 is the piece to call.

# %%
model = llmlab.load_model("smollm2-135m", attention="naive")
tok = llmlab.load_tokenizer("smollm2-135m")


# %%
# NBVAL_CHECK_OUTPUT
def flash_forward(q, k, v, block_m, block_n, causal=True):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb03.flash_forward", flash_forward, model=model, tokenizer=tok)

# %% [markdown]
# ## Check llmlab's `flash`: the same numbers as `naive`
#
# The library's version of your exercise is the `flash` backend (`flash_attention`, in the
# backend layout q [batch, seq, heads, head_dim]). Exactness first, in float64 against the
# softmax formula written out: the tiled result differs only by rounding. Then float32 against
# `naive` (norm-wise relative error), with grouped-query heads and lengths that are not
# multiples of the block size.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.attention.flash import flash_attention

q = torch.randn(1, 77, 4, 32, dtype=torch.float64)
k = torch.randn(1, 77, 2, 32, dtype=torch.float64)
v = torch.randn(1, 77, 2, 32, dtype=torch.float64)
s = torch.einsum("bqhd,bkhd->bhqk", q, A.expand_kv(k, 4)) / math.sqrt(32)
s = s.masked_fill(~A.causal_mask(77, 77), float("-inf"))
dense = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), A.expand_kv(v, 4))
for br, bc in [(16, 16), (8, 32), (64, 4)]:
    err = (flash_attention(q, k, v, block_q=br, block_k=bc) - dense).abs().max().item()
    print(f"float64 Br={br:2d} Bc={bc:2d}: max |Δ| = {err:.0e}, within 1e-12: {err <= 1e-12}")

cases = [(45, 45, True), (45, 45, False), (7, 60, True), (1, 50, True)]
for sq, sk, causal in cases:
    q = torch.randn(2, sq, 6, 64, device=DEV)
    k = torch.randn(2, sk, 2, 64, device=DEV)
    v = torch.randn(2, sk, 2, 64, device=DEV)
    out = A.get("flash").forward(q, k, v, causal=causal)
    ref = A.get("naive").forward(q, k, v, causal=causal)
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"flash q_len={sq:2d} kv_len={sk:2d} causal={causal!s:5s}: ‖Δ‖/‖ref‖ = {rel:.0e}, "
          f"within 2e-6: {rel <= 2e-6}")

# %%
# NBVAL_CHECK_OUTPUT
prompt = "The capital of France is"
ref = llmlab.generate(model.set_attention("naive"), tok, prompt, max_new_tokens=5, chat=False,
                      kv_cache="contiguous")
got = llmlab.generate(model.set_attention("flash"), tok, prompt, max_new_tokens=5, chat=False,
                      kv_cache="contiguous")
model.set_attention("naive")
print("naive :", ref.token_ids, repr(ref.text))
print("flash :", got.token_ids, "same tokens:", got.token_ids == ref.token_ids)

# %% [markdown]
# ## Measure: peak memory against N
#
# One attention call, causal, batch 1, one head, head_dim 64, float32, on this machine.
# `peak_memory` counts every tensor the call allocates. `naive` holds N×N matrices; `flash`
# (Br = 256, Bc = 512) holds Q, K, V, the output and one Br×Bc tile; `sdpa` is PyTorch's fused
# kernel.
#
# ### Exercise 3 (predict, then measure)
#
# Before running the next cell: at N = 4096, how many times more peak memory does `naive`
# need than `flash`? Commit a number; within a factor of 2 of the measurement counts.

# %%
my_prediction = ...  # YOUR ANSWER: a number, e.g. 3

# %%
from llmlab.viz.flash import plot_peak_memory, plot_times

d, BR, BC = 64, 256, 512
measured = [256, 512, 1024, 2048] if QUICK else [256, 512, 1024, 2048, 4096]
modelled = [8192, 16384, 32768]
backends = {
    "naive": lambda q, k, v: A.get("naive").forward(q, k, v, causal=True),
    "sdpa": lambda q, k, v: A.get("sdpa").forward(q, k, v, causal=True),
    "flash": lambda q, k, v: flash_attention(q, k, v, block_q=BR, block_k=BC),
}
mem = {name: [] for name in backends}
runs = {name: [] for name in backends}          # every timed run, for the spread
mem_4096 = {}                                   # measured even when QUICK stops at 2048
for n in sorted(set(measured) | {4096}):
    q, k, v = (torch.randn(1, n, 1, d, device=DEV) for _ in range(3))
    for name, fn in backends.items():
        peak = peak_memory(lambda: fn(q, k, v), device=DEV).peak_bytes
        if n == 4096:
            mem_4096[name] = peak
        if n in measured:
            mem[name].append(peak)
            runs[name].append(time_fn(lambda: fn(q, k, v), repeats=7, warmup=1, device=DEV).times_s)
ratio_4096 = mem_4096["naive"] / mem_4096["flash"]


def naive_model(n):  # two float32 N×N matrices alive at once + Q, K, V, O
    return 2 * n * n * 4 + 4 * n * d * 4


def flash_model(n):  # Q, K, V, O copies + the score tile and its exp
    return 4 * n * d * 4 + 3 * BR * BC * 4


def slope(ns, ys):  # least-squares exponent e of y ∝ N^e
    xs = torch.tensor(ns, dtype=torch.float64).log()
    ys = torch.tensor(ys, dtype=torch.float64).log()
    return float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())


top = measured[-3:]
print(f"device: {llmlab.device.device_name()}")
for name in backends:
    print(f"{name:6s} peak memory ∝ N^{slope(top, mem[name][-3:]):.2f} (fitted over N = {top}); "
          f"at N={measured[-1]}: {mem[name][-1] / 2**20:7.2f} MiB")
print(f"naive ÷ flash peak memory at N=4096: {ratio_4096:.1f}×")
print(f"measured ÷ model at N={measured[-1]}: naive {mem['naive'][-1] / naive_model(measured[-1]):.2f}, "
      f"flash {mem['flash'][-1] / flash_model(measured[-1]):.2f}")
series = {"naive": mem["naive"] + [naive_model(n) for n in modelled],
          "flash": mem["flash"] + [flash_model(n) for n in modelled]}
fig = plot_peak_memory(measured + modelled, series, modelled_from=modelled[0])
fig, medians = plot_times(measured, runs, title=f"one causal attention call, {llmlab.device.device_name()}")
n_last = measured[-1]
print(f"median time at N={n_last}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in medians.items())
      + f"; flash ÷ sdpa = {medians['flash'][-1] / medians['sdpa'][-1]:.1f}×")

# %%
exercises.check("nb03.predict_peak_memory", my_prediction, measured=ratio_4096)

# %% [markdown]
# Past the measured sizes the memory curves continue with the analytic counts above (hollow
# points): two float32 N×N matrices for `naive`, four N×d tensors and a tile for `flash`; the
# printed ratios say how close those counts are where both exist.

# %%
exps = {name: slope(top, mem[name][-3:]) for name in backends}
speed = medians["flash"][-1] / medians["sdpa"][-1]
display(Markdown(
    f"The fitted exponents are the lesson: {exps['naive']:.2f} for `naive`"
    + (" (the N² of its matrices)" if exps["naive"] > 1.7 else "")
    + f", {exps['flash']:.2f} for `flash` and {exps['sdpa']:.2f} for `sdpa`"
    + (" (at most linear: no N×N matrix)." if max(exps["flash"], exps["sdpa"]) < 1.2 else ".")
    + f"\n\nOn this {'GPU' if DEV == 'cuda' else 'CPU'} the torch `flash` loop takes "
    f"{speed:.1f}× the time of `sdpa` at N = {n_last}"
    + (": it is Python issuing one small matrix product per tile, while `sdpa` is a fused, "
       "tiled C++ kernel. Here the win of the torch loop is memory; the speed comes from a "
       "compiled kernel that keeps the tile in SRAM and registers (notebook 03b)."
       if speed > 1 else ": even as a Python loop it keeps up with the fused kernel here.")))


# %% [markdown]
# ## The HBM-traffic model: FlashAttention-1's derivation
#
# Count the bytes one head moves across HBM (`llmlab.profiling.hbm`, a model). Standard
# attention writes S, reads it, writes P, reads it: Θ(N·d + N²).
#
# FlashAttention-1 (Algorithm 1 of the paper) puts the **K/V blocks in the outer loop**. It loads
# K_j and V_j once; then, for every block of queries, it loads Q_i together with the partial
# output O_i and its statistics ℓ_i, m_i from HBM, folds in the tile, and writes O_i, ℓ_i, m_i
# back. So Q is read, and O read and written, once per K/V block: ⌈N/Bc⌉ passes of about
# 3·N·d elements, **Θ(N²·d/Bc)**. The paper sizes the blocks from the on-chip memory M
# (counted in elements): Bc = ⌈M/4d⌉, so that a K, a V, a Q and an O block fit, and
# Br = min(⌈M/4d⌉, d), so that the Br×Bc score tile fits too. Substituting Bc gives its
# Theorem 2: **Θ(N²·d²/M)**. Bc is never capped, so the traffic keeps falling as M grows
# (until one block holds all N keys); the cap on Br changes nothing, because in this loop order
# the passes are counted in K/V blocks.

# %%
# NBVAL_CHECK_OUTPUT
n, d = 8192, 64
std = standard_attention_hbm(n, d).total
print(f"N={n}, d={d}, bf16, one head: standard attention moves {std / 2**20:.0f} MiB (model)")
print(f"{'SRAM M':>8s} {'Br':>4s} {'Bc':>5s} {'FA1 MiB':>8s} {'FA1/standard':>13s}")
for kib in (8, 16, 32, 64, 164, 228):
    br, bc = paper_block_sizes(d, kib * 1024)
    t = tiled_attention_hbm_for_sram(n, d, kib * 1024).total
    print(f"{kib:6d}KiB {br:4d} {bc:5d} {t / 2**20:8.0f} {t / std:13.2f}")

# %%
from llmlab.viz.flash import plot_traffic_vs_sram

sram_kib = [8, 16, 32, 64, 128, 164, 228]
fig, by_sram = plot_traffic_vs_sram(8192, 64, sram_kib)
fa1 = by_sram["FlashAttention-1"]
print(f"FlashAttention-1 traffic ∝ M^{slope(sram_kib, fa1):.2f} from {sram_kib[0]} to {sram_kib[-1]} KiB "
      f"(Theorem 2: M^-1); {fa1[0] / fa1[-1]:.0f}× less at {sram_kib[-1]} KiB than at {sram_kib[0]} KiB")

# %% [markdown]
# Two lessons in the table and the plot. Tiles that are too small move *more* bytes than the
# naive algorithm: at 8 KiB Q and O cross HBM N/16 times. And every doubling of SRAM halves
# the traffic: Θ(N²·d²/M) holds across the whole range. (The *memory* saving does not depend
# on M at all: the N×N matrix is gone whatever the tile.)
#
# ## FlashAttention-2's loop order
#
# FlashAttention-2 (Dao, 2023) **swaps the loops**: query blocks outside, K/V blocks inside.
# Q_i is loaded once, O_i's accumulator stays on chip while every K_j, V_j streams through, and
# O_i is written once. Now K and V are re-read once per query block: **Θ(N²·d/Br)**.
# Br is not derived from M: it is chosen so that the Br×Bc score tile and the Br×d accumulator
# fit in registers, 64 or 128 rows in practice. llmlab's torch `flash`, your
# `flash_forward` and the Triton kernel all use this order. The dashed lines above are this
# order at Br = 64 and 128: independent of M. Against N:

# %%
from llmlab.viz.flash import plot_traffic_model

fig, traffic = plot_traffic_model([512, 1024, 2048, 4096, 8192, 16384, 32768], d=64,
                                  block_q=128, block_k=64, spec="H100")
ns_t = [512, 1024, 2048, 4096, 8192, 16384, 32768]
print(f"standard ∝ N^{slope(ns_t[-3:], traffic['standard'][-3:]):.2f}, "
      f"tiled ∝ N^{slope(ns_t[-3:], traffic['tiled'][-3:]):.2f} (N = {ns_t[-3]}..{ns_t[-1]}); "
      f"tiled/standard at N={ns_t[-1]}: {traffic['tiled'][-1] / traffic['standard'][-1]:.2f}")

# %% [markdown]
# Both grow as N² (the tiled loop still computes every tile), but the tiled count carries d/Br
# instead of a constant: at Br = 128 and d = 64 it moves about a quarter of the bytes.
#
# ### Exercise 4 (explain): why did FlashAttention-2 swap the loops?
#
# Why put the query blocks outside? Test each option against the two plots above before you
# pick one.

# %%
exercises.ask("nb03.explain_loop_order")

# %%
my_choice = ...  # YOUR ANSWER: "a", "b", "c" or "d"
exercises.check("nb03.explain_loop_order", my_choice)

# %% [markdown]
# The reasons, from the FlashAttention-2 paper: with long sequences batch × heads is often
# smaller than the number of SMs (132 on an H100), and FlashAttention-1 parallelized only over
# batch × heads; FlashAttention-2 also parallelizes over query blocks. Each program owns its
# output rows, so O never goes back to HBM between key blocks. And it divides by ℓ once at the
# end instead of rescaling the output after every block, trimming the non-matmul work, which
# runs far slower than the tensor cores. Throughout, the score tile and the accumulator live in
# registers; only the K/V blocks pass through shared memory. How small Br may be before the
# K/V re-reads cost more bytes than standard attention is a question for notebook 03b, which
# takes this loop to a GPU.
#
# ### Exercise 5 (compute): causal skipping
#
# With N = 1024 and Br = Bc = 128, how many tiles does a causal pass never load?
# `llmlab.attention.flash.block_schedule` shows them (0 = skipped), or count by hand.

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER
exercises.check("nb03.skipped_tiles", answer)

# %% [markdown]
# ## Play: which tiles a pass visits
#
# Choose the queries, the keys, Br and Bc: the plot shows the tiles the loop computes, those the
# diagonal crosses (computed with a mask), and those a causal pass never loads; below it, the
# HBM bytes the FlashAttention-2 order moves for these blocks (the model above, one head,
# d = 64, bf16) against standard attention at N = the keys.

# %%
import ipywidgets as widgets
from llmlab.viz.flash import plot_block_schedule


def show_tiles(n_q=256, n_k=256, block_q=64, block_k=64, causal=True):
    fig, grid = plot_block_schedule(n_q, n_k, block_q, block_k, causal=causal)
    plt.show()
    if n_q == n_k:
        t = tiled_attention_hbm(n_k, 64, block_q, block_k, causal=causal).total
        print(f"modelled HBM traffic, tiled ÷ standard: {t / standard_attention_hbm(n_k, 64).total:.2f}")


widgets.interactive(show_tiles,
                    n_q=widgets.IntSlider(value=256, min=16, max=1024, step=16),
                    n_k=widgets.IntSlider(value=256, min=16, max=1024, step=16),
                    block_q=widgets.SelectionSlider(options=[16, 32, 64, 128], value=64),
                    block_k=widgets.SelectionSlider(options=[16, 32, 64, 128], value=64),
                    causal=True)

# %%
show_tiles(768, 768, 128, 128)


# %% [markdown]
# ## Takeaways
#
# - Attention is bound by HBM traffic; FlashAttention never writes the N×N scores, so its memory grows as N, not N².
# - The online softmax (running max, running sum, rescale by exp(m − m_new)) makes the tiled result exact.
# - FlashAttention-1's loop order moves Θ(N²d²/M) bytes, falling with SRAM; FlashAttention-2 swaps the loops for parallelism and moves Θ(N²d/Br).
#
# ## Further reading
#
# - Dao, Fu, Ermon, Rudra, Ré. *FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness.* NeurIPS 2022. [arXiv:2205.14135](https://arxiv.org/abs/2205.14135) (Algorithm 1, Theorem 2, Fig. 1)
# - Notebook 03b (optional): the same loop on a GPU, modelled with H100 figures, written as a Triton kernel, and compiled for sm_90.
# - Dao. *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning.* 2023 (ICLR 2024). [arXiv:2307.08691](https://arxiv.org/abs/2307.08691)
# - Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao. *FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision.* 2024 (NeurIPS 2024). [arXiv:2407.08608](https://arxiv.org/abs/2407.08608) (wgmma, TMA, warp specialization, register reallocation on the H100)
# - NVIDIA. *CUDA C++ Programming Guide*: [technical specifications per compute capability](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications) (255 registers per thread, 64 K per SM, shared memory per SM and per block) and [local memory](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#device-memory-accesses) (where spills go); *CUDA C++ Best Practices Guide*, [occupancy](https://docs.nvidia.com/cuda/cuda-c-best-practices-guide/index.html#occupancy); [*Hopper Tuning Guide*](https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html); PTX ISA, [warpgroup-level matrix instructions (wgmma)](https://docs.nvidia.com/cuda/parallel-thread-execution/index.html#asynchronous-warpgroup-level-matrix-instructions)
# - Milakov, Gimelshein. *Online normalizer calculation for softmax.* 2018. [arXiv:1805.02867](https://arxiv.org/abs/1805.02867)
# - Rabe, Staats. *Self-attention Does Not Need O(n²) Memory.* 2021. [arXiv:2112.05682](https://arxiv.org/abs/2112.05682)
# - Tillet, Kung, Cox. *Triton: An Intermediate Language and Compiler for Tiled Neural Network Computations.* MAPL 2019. [doi:10.1145/3315508.3329973](https://doi.org/10.1145/3315508.3329973); [Triton tutorials](https://triton-lang.org/main/getting-started/tutorials/index.html)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
# - NVIDIA A100 and H100 product pages (bandwidth, memory, peak FLOP/s): [A100](https://www.nvidia.com/en-us/data-center/a100/), [H100](https://www.nvidia.com/en-us/data-center/h100/)
