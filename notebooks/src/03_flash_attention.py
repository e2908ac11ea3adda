# %% [markdown]
# # 03 · FlashAttention: exact attention without the N×N matrix
#
# **Why.** Textbook attention computes S = QKᵀ, writes the whole N×N score matrix to memory,
# reads it back for the softmax, writes the probabilities P, and reads them again to multiply by V.
# On a GPU "memory" means HBM, and HBM is the slow level of the hierarchy. The seed article on
# FlashAttention (seed 000, after Fig. 1 of the FlashAttention paper, Dao et al. 2022) gives the
# A100's numbers: on-chip **SRAM ≈ 19 TB/s but only ≈ 20 MB**, **HBM ≈ 1.5 TB/s and 40 GB**.
# So attention is limited by moving bytes, not by arithmetic, and its memory grows as N².
#
# FlashAttention's answer: cut Q, K and V into blocks small enough for SRAM, compute one
# Br×Bc tile of scores at a time, and never write S or P to HBM. The softmax over a whole row is
# assembled block by block with a running maximum and a running sum (*online softmax*), so the
# result is exact, not an approximation. The seed reports 15% (BERT-large) to 3× (GPT-2)
# end-to-end training speed-ups from the paper.
#
# This notebook builds that algorithm in plain PyTorch (`flash`), runs a Triton kernel of it
# (`flash_triton`, FlashAttention-2 loop order), checks both against `naive`, and measures memory.

# %%
import inspect
import math
import os

import matplotlib.pyplot as plt
import torch

import llmlab
import llmlab.attention as A
from llmlab.attention.flash import flash_attention, online_softmax_update
from llmlab.device import device_name
from llmlab.profiling import peak_memory, time_fn
from llmlab.profiling.hbm import (A100, CHIPS, paper_block_sizes, standard_attention_hbm,
                                  tiled_attention_hbm, tiled_attention_hbm_for_sram)

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
print(device_name())

# %% [markdown]
# ## Why: the memory hierarchy in numbers
#
# The chip presets in `llmlab.profiling.hbm` carry vendor datasheet figures (each one cited in
# the source). "smem/SM" is the shared memory one thread block can use — the budget a
# FlashAttention tile must fit in.

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
# What `naive` attention puts in HBM for SmolLM2 (9 query heads) at batch 1, one layer, float32:

# %%
# NBVAL_CHECK_OUTPUT
heads = 9
for n in (2048, 8192, 32768):
    score_bytes = heads * n * n * 4
    passes = 4 * score_bytes            # write S, read S, write P, read P
    print(f"N={n:6d}: one score matrix {score_bytes / 2**30:7.2f} GiB; "
          f"4 passes over it at A100 HBM speed {passes / A100.hbm_bandwidth * 1e3:8.1f} ms per layer")

# %% [markdown]
# ## How (1): the online softmax, step by step
#
# softmax(s)ⱼ = exp(sⱼ − m) / Σₖ exp(sₖ − m) needs the row maximum m and the row sum — both
# over the *whole* row. The tiled loop only ever sees one block of the row. So it keeps, per row,
#
# - `m`: the largest score seen so far,
# - `l`: Σ exp(s − m) over the scores seen so far,
# - `acc`: Σ exp(s − m) · v over the scores seen so far,
#
# and when a new block raises the maximum from m to m_new, everything accumulated so far was
# exponentiated against the wrong maximum: multiply `l` and `acc` by exp(m − m_new) — the
# **rescaling** step — then add the new block. At the end, output = acc / l.

# %%
print(inspect.getsource(online_softmax_update))

# %% [markdown]
# One query row, 12 keys, blocks of 4 keys: watch the state after each block. (The first block
# has nothing to rescale: exp(−∞) = 0.)

# %%
# NBVAL_CHECK_OUTPUT
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
print("max |Δ| < 1e-12:", ((acc / l[:, None]) - exact).abs().max().item() < 1e-12)

# %% [markdown]
# ## How (2): tiling, and which tiles a causal pass visits
#
# `flash_attention(q, k, v, block_q=Br, block_k=Bc)` loops over blocks of Br queries; for each,
# over blocks of Bc keys. With a causal mask (query i sees key j when j ≤ i + N_k − N_q, aligned
# bottom-right as in FlashAttention 2), tiles entirely above the diagonal are **skipped** — never
# loaded — and only tiles the diagonal crosses need a mask. Left: a causal prefill of 64 tokens.
# Right: *chunked prefill* / decode shape, 16 new queries over 64 cached keys: the queries are the
# last 16 positions, so they see almost everything.

# %%
from llmlab.viz.flash import plot_block_schedule

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), dpi=80)
plot_block_schedule(64, 64, 16, 16, causal=True, ax=axes[0])
plot_block_schedule(16, 64, 8, 16, causal=True, ax=axes[1])
axes[0].get_legend().remove()
fig.tight_layout()

# %% [markdown]
# The loop itself (block iteration and masking; the rescaling lives in `online_softmax_update`):

# %%
src = inspect.getsource(flash_attention)
print(src[src.index("    offset = seq_k - seq_q"):])

# %% [markdown]
# The Triton kernel `llmlab.kernels.flash_attn` runs the same loop with the FlashAttention-2
# order: one program per block of query rows keeps its Q tile on chip and streams K/V through
# it; the score tile and the running statistics live in registers. With grouped-query attention
# the query heads that share a KV head are packed into one tile, so K/V are read once per group.

# %%
import llmlab.kernels.flash_attn as fk

print(fk.__doc__)

# %% [markdown]
# ## Check: the same numbers as `naive`
#
# Exactness first, in float64 against the softmax formula written out: the tiled result differs
# only by rounding. Then float32 against `naive` (norm-wise relative error), with grouped-query
# heads and lengths that are not multiples of the block size, causal and not, for both backends.

# %%
# NBVAL_CHECK_OUTPUT
q = torch.randn(1, 77, 4, 32, dtype=torch.float64)
k = torch.randn(1, 77, 2, 32, dtype=torch.float64)
v = torch.randn(1, 77, 2, 32, dtype=torch.float64)
s = torch.einsum("bqhd,bkhd->bhqk", q, A.expand_kv(k, 4)) / math.sqrt(32)
s = s.masked_fill(~A.causal_mask(77, 77), float("-inf"))
dense = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), A.expand_kv(v, 4))
for br, bc in [(16, 16), (8, 32), (64, 4)]:
    err = (flash_attention(q, k, v, block_q=br, block_k=bc) - dense).abs().max().item()
    print(f"float64 Br={br:2d} Bc={bc:2d}: max |Δ| <= 1e-12: {err <= 1e-12}")

# %%
# NBVAL_CHECK_OUTPUT
cases = [(45, 45, True), (45, 45, False), (7, 60, True), (1, 50, True)]
for backend in ("flash", "flash_triton"):
    for sq, sk, causal in cases:
        q = torch.randn(2, sq, 6, 64, device=DEV)
        k = torch.randn(2, sk, 2, 64, device=DEV)
        v = torch.randn(2, sk, 2, 64, device=DEV)
        out = A.get(backend).forward(q, k, v, causal=causal)
        ref = A.get("naive").forward(q, k, v, causal=causal)
        rel = ((out - ref).norm() / ref.norm()).item()
        print(f"{backend:12s} q_len={sq:2d} kv_len={sk:2d} causal={causal!s:5s}: "
              f"‖Δ‖/‖ref‖ <= 2e-6: {rel <= 2e-6}")

# %% [markdown]
# And inside the real model: SmolLM2 with its attention swapped. The torch `flash` backend runs a
# short greedy generation; `flash_triton` runs one prompt forward in the Triton interpreter (slow on
# a CPU: every kernel program is executed as Python), and must give the same logits and next token.

# %%
# NBVAL_CHECK_OUTPUT
model = llmlab.load_model("smollm2-135m", attention="naive")
tok = llmlab.load_tokenizer("smollm2-135m")
prompt = "The capital of France is"
ref = llmlab.generate(model, tok, prompt, max_new_tokens=5, chat=False)
got = llmlab.generate(model.set_attention("flash"), tok, prompt, max_new_tokens=5, chat=False)
print("naive :", ref.token_ids, repr(ref.text))
print("flash :", got.token_ids, "same tokens:", got.token_ids == ref.token_ids)

ids = torch.tensor([tok(prompt)["input_ids"]], device=model.device)
with torch.inference_mode():
    logits_ref = model.set_attention("naive")(ids)[0, -1]
    logits_tri = model.set_attention("flash_triton")(ids)[0, -1]
model.set_attention("naive")
print("flash_triton: max |Δ logits| < 1e-3:", (logits_tri - logits_ref).abs().max().item() < 1e-3,
      "| same next token:", logits_tri.argmax().item() == logits_ref.argmax().item())

# %% [markdown]
# ## Measure: peak memory against N
#
# One attention call, causal, batch 1, one head, head_dim 64, float32, on this machine's CPU.
# `peak_memory` counts every tensor the call allocates. `naive` holds N×N matrices; `flash`
# holds Q, K, V, the output and one Br×Bc tile. Past the measured sizes the curve continues
# with an analytic count (two float32 N×N matrices alive at once, plus the inputs), drawn hollow;
# the printed ratio shows how close that count is to the measurement where both exist.

# %%
from llmlab.viz.flash import plot_peak_memory

d, BR, BC = 64, 256, 512
measured = [256, 512, 1024, 2048] if QUICK else [256, 512, 1024, 2048, 4096]
modelled = [8192, 16384, 32768]
backends = {
    "naive": lambda q, k, v: A.get("naive").forward(q, k, v, causal=True),
    "sdpa": lambda q, k, v: A.get("sdpa").forward(q, k, v, causal=True),
    f"flash Br={BR} Bc={BC}": lambda q, k, v: flash_attention(q, k, v, block_q=BR, block_k=BC),
}
if DEV == "cuda":
    backends["flash_triton"] = lambda q, k, v: A.get("flash_triton").forward(q, k, v, causal=True)
mem = {name: [] for name in backends}
secs = {name: [] for name in backends}
for n in measured:
    q, k, v = (torch.randn(1, n, 1, d, device=DEV) for _ in range(3))
    for name, fn in backends.items():
        mem[name].append(peak_memory(lambda: fn(q, k, v), device=DEV).peak_bytes)
        secs[name].append(time_fn(lambda: fn(q, k, v), repeats=1, warmup=0, device=DEV).median_s)


def naive_model(n):  # two float32 N×N matrices alive at once + Q, K, V, O
    return 2 * n * n * 4 + 4 * n * d * 4


def flash_model(n):  # Q, K, V, O copies + the score tile and its exp
    return 4 * n * d * 4 + 3 * BR * BC * 4


print("naive measured / model at N=%d: %.2f" % (measured[-1], mem["naive"][-1] / naive_model(measured[-1])))
fl = f"flash Br={BR} Bc={BC}"
print("flash measured / model at N=%d: %.2f" % (measured[-1], mem[fl][-1] / flash_model(measured[-1])))
series = {"naive": mem["naive"] + [naive_model(n) for n in modelled],
          fl: mem[fl] + [flash_model(n) for n in modelled]}
fig = plot_peak_memory(measured + modelled, series, modelled_from=modelled[0])
for n in measured:
    i = measured.index(n)
    print(f"N={n:5d}: naive {mem['naive'][i] / 2**20:8.1f} MiB  sdpa {mem['sdpa'][i] / 2**20:6.2f} MiB  "
          f"flash {mem[fl][i] / 2**20:6.2f} MiB   time naive {secs['naive'][i] * 1e3:7.1f} ms  "
          f"sdpa {secs['sdpa'][i] * 1e3:6.1f} ms  flash {secs[fl][i] * 1e3:7.1f} ms")
print(f"modelled at N=32768: naive {series['naive'][-1] / 2**30:.1f} GiB vs flash {series[fl][-1] / 2**20:.1f} MiB")

# %% [markdown]
# On a CPU the torch `flash` loop is not faster than `sdpa` (which is itself a fused, tiled kernel
# in C++): here the win is memory. Speed comes from keeping the tile in SRAM on a GPU, which the
# Triton kernel does; `python -m llmlab.bench attention --gpu` measures it against PyTorch's own
# FlashAttention backend.
#
# ## Measure: the HBM-traffic model
#
# `llmlab.profiling.hbm` counts the bytes each algorithm moves (a model, not a measurement).
# Standard attention: Θ(N·d + N²). Tiled, FlashAttention-2 order: Q read once and O written once,
# K and V read once per block of Br queries: Θ(N²·d/Br) — and with the largest tile SRAM of size
# M allows (the paper's Br ≈ M/4d), Θ(N²·d²/M).

# %%
from llmlab.viz.flash import plot_traffic_model

fig, traffic = plot_traffic_model([512, 1024, 2048, 4096, 8192, 16384, 32768], d=64,
                                  block_q=128, block_k=64, spec="H100")

# %%
# NBVAL_CHECK_OUTPUT
n, d = 8192, 64
std = standard_attention_hbm(n, d).total
print(f"N={n}, d={d}, bf16, one head: standard attention moves {std / 2**20:.0f} MiB")
print(f"{'SRAM M':>8s} {'Br':>4s} {'Bc':>5s} {'tiled MiB':>10s} {'tiled/standard':>15s}")
for kib in (8, 16, 32, 64, 164, 228):
    br, bc = paper_block_sizes(d, kib * 1024)
    t = tiled_attention_hbm_for_sram(n, d, kib * 1024).total
    print(f"{kib:6d}KiB {br:4d} {bc:5d} {t / 2**20:10.0f} {t / std:15.2f}")

# %% [markdown]
# Two lessons in that table. Tiles that are too small (Br < d/2) move *more* bytes than the naive
# algorithm: K and V are re-read N/Br times. And the paper caps Br at d, so past M = 4d² elements
# more SRAM only widens Bc: the traffic stops falling. (The memory saving does not depend on M at
# all: the N×N matrix is gone whatever the tile.)
#
# ## Play: the block-size explorer
#
# Choose Br, Bc, head_dim, N and a chip. The left panel stacks the tile's on-chip bytes (Q, K+V,
# the fp32 score tile and accumulator, the statistics) against the chip's shared memory per SM;
# the middle panel shows the modelled HBM traffic; the right one times the Triton kernel with
# those blocks — compiled on a GPU, in the interpreter on a CPU (at N ≤ 128, where it measures
# Python, not a GPU).

# %%
import ipywidgets as widgets
from llmlab.viz.flash import flash_explorer

pow2 = [16, 32, 64, 128, 256]
widgets.interactive(
    lambda block_q=64, block_k=64, head_dim=64, n=4096, chip="H100":
        flash_explorer(block_q, block_k, head_dim, n, chip).figure,
    block_q=widgets.SelectionSlider(options=pow2, value=64, description="Br"),
    block_k=widgets.SelectionSlider(options=pow2, value=64, description="Bc"),
    head_dim=widgets.SelectionSlider(options=[32, 64, 128, 256], value=64, description="head_dim"),
    n=widgets.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384, 32768], value=4096,
                              description="N"),
    chip=list(CHIPS))

# %%
r = flash_explorer(block_q=128, block_k=64, head_dim=128, n=8192, chip="H100")
print(f"tile {r.footprint_bytes / 1024:.0f} KiB of {r.smem_bytes // 1024} KiB: fits={r.fits}; "
      f"modelled traffic tiled/standard = {r.tiled_bytes / r.standard_bytes:.2f}; "
      f"measured {r.measured_s * 1e3:.1f} ms ({r.measured_what}, N={r.measured_n})")

# %% [markdown]
# ## Exercises
#
# 1. **The rescaling step.** Write one online-softmax step: given the running `m` [rows],
#    `l` [rows], `acc` [rows, d], a block of `scores` [rows, cols] and `v_block` [cols, d], return
#    `(m_new, l_new, acc_new)`. Hint: `torch.maximum`, `Tensor.amax(dim=-1)`, `torch.exp`, and
#    `@`; the old `l` and `acc` must be multiplied by exp(m − m_new).

# %%
from llmlab.exercises.nb03 import check_rescale, check_skipped_tiles, check_smallest_block_q


def rescale_step(m, l, acc, scores, v_block):
    # YOUR CODE HERE
    raise NotImplementedError


check_rescale(rescale_step)

# %% [markdown]
# 2. **When does tiling pay in bytes?** For N = 4096, d = 64, Bc = 64, non-causal, what is the
#    smallest power-of-two Br for which the tiled algorithm moves fewer modelled HBM bytes than
#    standard attention? Hint: `tiled_attention_hbm(4096, 64, Br, 64).total` and
#    `standard_attention_hbm(4096, 64).total`.

# %%
answer = ...  # YOUR CODE HERE
check_smallest_block_q(answer)

# %% [markdown]
# 3. **Causal skipping.** With N = 1024 and Br = Bc = 128, how many tiles does a causal pass
#    never load? Hint: `llmlab.attention.flash.block_schedule` (0 = skipped), or count by hand.

# %%
answer = ...  # YOUR CODE HERE
check_skipped_tiles(answer)

# %% [markdown]
# ## Takeaways
#
# - Attention is bound by HBM traffic; FlashAttention never writes the N×N scores, so memory grows as N, not N².
# - The online softmax (running max, running sum, rescale by exp(m − m_new)) makes the tiled result exact.
# - Block sizes trade on-chip footprint against HBM re-reads of K and V: Θ(N²d²/M); causal masks skip half the tiles.
