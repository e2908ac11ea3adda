# %% [markdown]
# # 04b · PagedAttention's fine print (optional)
#
# The appendix of notebook 04. Read 04 first: it builds the blocks, the block tables and the paged
# attention read, and measures on a ShareGPT-like trace that reserving each request's maximum
# length wastes most of the KV pool while paging keeps several times as many sequences in flight.
# This notebook reads the fine print of that result, on the same trace and the same pool, in
# five parts that run on a CPU in seconds, without the model: what paging's remaining waste is
# made of; how the waste of reserving grows with the cap a server must guess; why paging
# preempts, and the prefill those preemptions cost; what the saved memory buys on an H100 (a
# model, labelled as one); and what the compiler makes of the `paged_triton` kernel at each block
# size (compiled for an H100, not run). The roofline of notebook 02 prices the GPU model.

# %%
import os

from IPython.display import Markdown, display

from llmlab import exercises
from llmlab.cache import waste
from llmlab.kernels import report as R
from llmlab.profiling import expect
from llmlab.viz import paged as pviz

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
reqs = waste.load_trace("sharegpt_like", limit=150 if QUICK else None)
BUDGET, CAP = 16384, 1024          # notebook 04's pool and output cap

# %% [markdown]
# ## The unfilled tail
#
# First notebook 04's measurement again, so that this notebook runs alone: the trace, then
# policy (a), each request reserving prompt + 1024 tokens, and policy (c), blocks of 16 allocated
# on demand, in a pool of 16,384 token slots. The categories are notebook 04's: *reservation* is
# held for a token not generated yet, *internal* is held but never to be written, *external* is a
# hole too small for the next request.

# %%
# NBVAL_CHECK_OUTPUT
mean_in = sum(r.prompt_tokens for r in reqs) / len(reqs)
mean_out = sum(r.total_tokens - r.prompt_tokens for r in reqs) / len(reqs)
print(f"{len(reqs)} requests: mean prompt {mean_in:.1f} tokens, mean output {mean_out:.1f} tokens, "
      f"longest output {max(r.total_tokens - r.prompt_tokens for r in reqs)}")
a = waste.simulate(reqs, "max_len", BUDGET, max_tokens=CAP)
c = waste.simulate(reqs, "paged", BUDGET, block_size=16)
for r in (a, c):
    f = r.fractions()
    print(f"{r.label:18s} waste {r.waste:5.1%}  (reservation {f['reservation']:5.1%}, internal "
          f"{f['internal']:5.1%}, external {f['external']:4.1%} of the pool)  "
          f"{r.mean_running:5.1f} sequences in flight  {r.preemptions} preemptions")
fc = c.fractions()
print(f"paged, to two decimals: reservation {fc['reservation']:.2%}, internal {fc['internal']:.2%} "
      "of the pool")
expect(fc["internal"] < 0.1 * fc["reservation"],
       "the paged tail made mostly of slots still to be written (internal under a tenth of "
       "the reservation)")

# %% [markdown]
# Paging leaves one kind of unfilled memory: the tail of each sequence's last block. The
# simulation splits it by what will happen to it. While a sequence is still generating, the
# slots after its newest token will be written in the coming steps, so they count as
# *reservation*: that is nearly all of policy (c)'s waste. Only the slots past a sequence's *final*
# token are never written, and they are held only from the step it enters its last block until
# it finishes and frees it: that is the *internal* share, printed to two decimals above
# (the cell's last line checks that it is under a tenth of the reservation). Both are bounded
# by `block_size − 1` slots per sequence.
#
# ### Exercise 1 (compute): the unfilled tail
#
# Four sequences of 37, 70, 16 and 5 tokens live in blocks of 16 slots. How many slots do their
# blocks hold that no token fills?

# %%
answer = ...  # YOUR ANSWER: an integer
exercises.check("nb04.wasted_slots", answer)

# %% [markdown]
# ## The cap a reservation must guess
#
# The cap is a guess the server must make: any request may run to it. Set it at the trace's
# longest output (printed above) or beyond, and policy (a) holds ever more memory for nothing:

# %%
# NBVAL_CHECK_OUTPUT
caps = (1024, 1536, 2048, 4096)
capped = [waste.simulate(reqs, "max_len", BUDGET, max_tokens=cap) for cap in caps]
fig = pviz.plot_cap_sweep(capped, caps, c)
for cap, r in zip(caps, capped):
    print(f"cap {cap:4d}: waste {r.waste:5.1%}, {r.mean_running:5.1f} sequences in flight "
          f"(paged: {c.mean_running:.1f}, {c.mean_running / r.mean_running:.1f}×)")

# %% [markdown]
# ## Why paging preempts
#
# ### Exercise 2 (explain): why does paging preempt?
#
# Look at the printouts above: paging keeps more sequences in flight than reserving
# prompt + 1024 (the printed ratios), yet it preempted requests (the count in the first
# printout), and policy (a) never does. Why?

# %%
exercises.ask("nb04.explain_preemptions")

# %%
my_choice = ...  # YOUR ANSWER: "a", "b", "c" or "d"
exercises.check("nb04.explain_preemptions", my_choice)

# %% [markdown]
# ## What a preemption costs
#
# A preemption is not free. The preempted request's blocks are freed and, when it is admitted
# again, its prompt and everything it had generated are prefilled again. The simulation counts a
# step as one token per sequence and charges nothing for that recompute, so count it separately,
# for pools of three sizes:

# %%
# NBVAL_CHECK_OUTPUT
total = sum(r.total_tokens for r in reqs)
prompt_total = sum(r.prompt_tokens for r in reqs)
print(f"the trace: {total:,} tokens, {prompt_total:,} of them in prompts")
pools = {}
for budget in (BUDGET, 2 * BUDGET, 4 * BUDGET):
    m = waste.simulate(reqs, "max_len", budget, max_tokens=CAP)
    p = waste.simulate(reqs, "paged", budget, block_size=16)
    pools[budget] = (m, p)
    print(f"pool {budget:6,d} slots: {p.mean_running:5.1f} vs {m.mean_running:5.1f} sequences "
          f"({p.mean_running / m.mean_running:.1f}×), {p.preemptions:3d} preemptions, "
          f"{p.recomputed_tokens:6,d} tokens recomputed ({p.recomputed_tokens / total:4.0%} of the "
          f"trace); steps to finish {p.steps:,} vs {m.steps:,} "
          f"({p.steps / m.steps:.0%})")
m1, p1 = pools[BUDGET]
m4, p4 = pools[4 * BUDGET]
vs_prompts = ("more than" if p1.recomputed_tokens > prompt_total else "less than")
slowest = max(p.steps / m.steps for m, p in pools.values())
display(Markdown(
    f"So \"paging fits {p1.mean_running / m1.mean_running:.1f}× as many sequences\" needs its fine "
    f"print. With {BUDGET:,} slots the paged pool is overcommitted: it admits on the prompt alone, "
    f"and over the trace it recomputes {p1.recomputed_tokens:,} tokens, {vs_prompts} all the "
    f"trace's prompts together ({prompt_total:,}). With 4× the memory the ratio is "
    f"{p4.mean_running / m4.mean_running:.1f}×, with {p4.preemptions} preemptions instead of "
    f"{p1.preemptions}. At every pool size paging finishes the trace in at most "
    f"{slowest:.0%} of the steps that reserving the cap takes."))

# %% [markdown]
# That recompute is prefill, the cheapest work per token a GPU does (notebook 02: compute-bound,
# many tokens per weight read), so it costs far less than the decode steps the larger batch
# saves, but it is not nothing, and a real scheduler limits how often it happens (vLLM, for
# instance, admits a request only while a watermark of free blocks remains). Fewer steps for the
# same tokens is the throughput that paging is for, which the next section models on a GPU and
# notebook 05 measures.
#
# ## What the saved memory buys on a GPU (a model)
#
# Nothing here runs on a GPU; it is a labelled model. Take a 13B-parameter Llama-2 (40 layers,
# 40 KV heads of 128, 16-bit: 800 KiB of K/V per token) on one H100 (80 GB, 3.35 TB/s,
# 989 TFLOP/s dense BF16, vendor figures). With 90% of the memory in use, 26 GB of weights leave
# room for about 56,500 token slots (the cell prints the count). Run the trace through that pool
# with policies (a) and (c), then price every decode step with the roofline of notebook 02
# (time = max(bytes / bandwidth, FLOPs / peak) at the mean batch and context), plus the prefill
# FLOPs of every recomputed token.

# %%
rows = pviz.gpu_serving_model(reqs)
fig = pviz.plot_gpu_serving_model(rows)
base, paged_row = rows
for r in rows:
    print(f"{r.policy:8s}: {r.mean_running:5.1f} sequences in flight, one decode step "
          f"{r.step_s * 1e3:4.1f} ms, {r.preemptions} preemptions -> {r.tokens_per_s:6,.0f} tokens/s "
          "(model)")
print(f"KV pool of the model: {base.kv_slots:,} token slots")
print(f"paged / max_len: {paged_row.tokens_per_s / base.tokens_per_s:.2f}× the modelled throughput")

# %% [markdown]
# A decode step is memory-bound: it reads every weight once and every sequence's K/V once. A larger
# batch shares the weight reads among more tokens, so the modelled throughput grows with the
# sequences in flight, less than in proportion because their K/V must be read too. The paged
# kernel itself reads the same K/V bytes as a contiguous one plus a 4-byte block-table entry per
# 16 tokens; Kwon et al. measured their kernel 20–26% slower than FasterTransformer's contiguous
# attention kernel, a small price next to the batch it allows. The model leaves out kernel
# overheads and scheduling gaps; `make gpu-check` measures the kernels on a real GPU.

# %% [markdown]
# ## What the compiler makes of `paged_triton` at each block size (compiled for H100, not run)
#
# Triton and NVIDIA's `ptxas` (shipped with Triton) can build the kernel for an H100 (`sm_90`) on
# this CPU machine; `python -m llmlab.kernels.report` reads back what each build uses, and
# `data/kernel_builds.json` keeps the result for every block size of notebook 04's widget. Nothing
# ran on a GPU. Notebook 03b explains the columns: registers per thread (at most 255; beyond that, spills to
# local memory, which lives in DRAM), shared memory per block, theoretical occupancy (resident
# warps over the SM's 64), and tensor-core instructions (HGMMA, Hopper's `wgmma`; HMMA, the
# warp-level `mma.sync`). Sources: NVIDIA CUDA C++ Programming Guide (technical specifications
# per compute capability; local memory) and CUDA C++ Best Practices Guide (occupancy).
#
# llmlab's kernel takes its tile from the wrapper, not from the pool: 16 packed query rows ×
# 64 keys per step in bfloat16 (`default_tile`), whatever the block size. The block size only
# enters the address of each key, `block_table[j // block_size] * block_size + j % block_size`.

# %%
# NBVAL_CHECK_OUTPUT
sizes = R.WIDGET_TILES["paged"]["block_size"]    # 1, 2, 4, ..., 256: each has a kernel build
print("compiled for H100 (sm_90), not run: paged_triton, bf16, head_dim 64, 3 query heads per KV head")
print(f"{'block':>5s} {'tile':>19s} {'regs/thread':>11s} {'spill B':>7s} {'smem KiB':>8s} "
      f"{'occupancy':>9s} {'HMMA':>4s} {'HGMMA':>5s}")
paged_builds = {s: R.lookup("paged", "H100", "bf16", block_size=s, head_dim=64) for s in sizes}
for s, b in paged_builds.items():
    print(f"{s:5d} {b.config:>19s} {b.registers:11d} {b.spill_bytes:7d} {b.shared_bytes / 1024:8.0f} "
          f"{b.occupancy:9.0%} {b.tensor_core_ops['HMMA']:4d} {b.tensor_core_ops['HGMMA']:5d}")
regs = [b.registers for b in paged_builds.values()]
print(f"registers/thread over block sizes {sizes[0]}..{sizes[-1]}: {min(regs)} to {max(regs)}; "
      f"spilling builds: {sum(b.spills for b in paged_builds.values())}")

# %% [markdown]
# The builds hardly differ (the printed range): the block size changes a division and a
# remainder, not the tile, so the work per step and the registers and shared memory it needs
# stay the same. What a GPU would feel is elsewhere: with blocks smaller than the 64-key step,
# its keys come from 64 / block_size different blocks, each a separate lookup in the table and
# a separate place in memory. The 16-row tile's dots are too small for a warpgroup's `wgmma`
# (it needs 64 rows), so even the H100 build uses the warp-level HMMA. Notebook 04's block-size
# widget draws each build beside the waste simulation and the CPU time (`chip` picks the GPU it
# is compiled for).

# %% [markdown]
# ## Takeaways
#
# * Paging's only waste is the tail of each sequence's last block, and nearly all of it will be
#   written in the coming steps; reserving a cap wastes more the larger the cap.
# * Paging admits a request on its prompt alone, so an overcommitted pool preempts, and every
#   preempted token is prefilled again; more memory makes that rare.
# * On a GPU (a model) the larger batch shares each step's weight reads among more tokens; the
#   paged kernel's build is the same at every block size, which changes only where keys are read.
#
# ## Further reading
#
# - Kwon, Li, Zhuang, Sheng, Zheng, Yu, Gonzalez, Zhang, Stoica. *Efficient Memory Management for Large Language Model Serving with PagedAttention.* SOSP 2023. [arXiv:2309.06180](https://arxiv.org/abs/2309.06180) (§4.5, scheduling and preemption: recompute or swap; §7.1, the kernel's overhead against FasterTransformer's)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
# - NVIDIA H100 product page (bandwidth, memory, peak FLOP/s): [H100](https://www.nvidia.com/en-us/data-center/h100/)
# - NVIDIA. *CUDA C++ Programming Guide*: [technical specifications per compute capability](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications) and [local memory](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#device-memory-accesses); *CUDA C++ Best Practices Guide*, [occupancy](https://docs.nvidia.com/cuda/cuda-c-best-practices-guide/index.html#occupancy)
# - vLLM documentation: [docs.vllm.ai](https://docs.vllm.ai/) (the scheduler and its preemption)
