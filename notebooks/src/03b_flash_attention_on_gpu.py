# %% [markdown]
# # 03b · FlashAttention on a GPU (optional)
#
# Notebook 03 wrote the tiled loop in PyTorch and ran it on this machine, where its win is memory.
# On a GPU the same loop is also the fast one, because the tile stays on chip: in shared memory
# and registers, next to tensor cores. This optional notebook follows the loop there, in three
# parts that all run on a CPU. First a **model**, labelled as one, of one attention layer on an
# H100 from its datasheet figures, and how small a tile may get before it stops saving bytes.
# Then the loop as a **Triton kernel**: you write its inner loop (a stretch), which runs here
# in Triton's interpreter and compiles for real on a GPU. Last, **what the compiler makes of a
# tile**: registers, spills, shared memory and occupancy of builds compiled for an H100 on this
# machine, and an explorer over the block sizes.

# %%
import matplotlib.pyplot as plt
import torch

import llmlab
import llmlab.attention as A
from llmlab import exercises
from llmlab.device import TRITON_MISSING, describe, has_triton
from llmlab.profiling.hbm import CHIPS, H100

DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")


# %% [markdown]
# ## On a GPU: a model with H100 figures
#
# No GPU runs anything here, so this is a **model**, labelled as one: the roofline
# lower bound max(HBM bytes / bandwidth, FLOPs / peak) of one attention layer (32 heads × d=64,
# causal, bf16) from the H100 SXM datasheet (3.35 TB/s HBM, 989 TFLOP/s dense bf16), for
# standard attention and for the FlashAttention-2 loop order. Real kernels reach a fraction of
# peak (FlashAttention-2 reports 50–73% of the A100's peak FLOP/s), and the K/V re-reads it
# counts are often served from the L2 cache, so the flash line is a pessimistic count of bytes.

# %%
from llmlab.viz.flash import plot_gpu_model

ns_gpu = [1024, 2048, 4096, 8192, 16384, 32768]
fig, gpu = plot_gpu_model(ns_gpu, d=64, heads=32, spec="H100")
for n, t_std, t_fl, f in zip(ns_gpu, gpu["standard"], gpu["flash"], gpu["flops"]):
    t_flops = f / H100.peak_bf16_flops
    print(f"N={n:6d}: standard {t_std * 1e3:7.3f} ms, flash {t_fl * 1e3:6.3f} ms  "
          f"(modelled speed-up {t_std / t_fl:4.1f}×); flash ÷ FLOP-only time {t_fl / t_flops:.1f}")

# %% [markdown]
# In the model, standard attention sits far above the FLOP line at every length: its N² bytes
# grow as fast as its FLOPs, so HBM bandwidth sets its time. FlashAttention-2's loop does about
# Br FLOPs per byte it moves (Br = 128 here), still under the H100's ridge of 295 FLOP/byte, so
# this pessimistic count keeps it on the bandwidth roof too, a small factor above the FLOP line
# (the last column); with its K/V re-reads served from L2 a real kernel gets closer still.
# Either way the model puts FlashAttention several times ahead, and the gap does not close
# with N. `python -m llmlab.bench attention --gpu` measures llmlab's Triton kernel against
# PyTorch's own FlashAttention backend on a real GPU.

# %% [markdown]
# ### Exercise (compute): when does tiling pay in bytes?
#
# The model counts, per head, 2·N·d + 2·N²·d/Br elements for FlashAttention-2's loop (Q read
# and O written once, K and V re-read once per query block) and 4·N·d + 4·N² for standard
# attention (S and P each written and read). A small Br means many passes over K and V. Leave
# out the N·d terms: at which Br do the two N² terms tie, for d = 128? (`tiled_attention_hbm`
# and `standard_attention_hbm` in `llmlab.profiling.hbm` compute the full counts, if you want
# to see the tie.)

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a number
exercises.check("nb03.break_even_block_q", answer)

# %% [markdown]
# ## Stretch (build): the inner loop of a Triton kernel
#
# Triton (Tillet, Kung and Cox, 2019) writes GPU kernels in Python over *blocks*: a program
# works on a whole tile at once (`tl.load` of a block of pointers, `tl.dot` of two tiles), and a
# grid of programs covers the problem. `llmlab.exercises.flash_triton_skeleton` holds a
# FlashAttention-2-order kernel with everything but the online softmax: from its program ids it
# finds its block of BLOCK_M query rows and its head (and the KV head that head reads), loads
# the Q tile, starts m = −∞, l = 0, acc = 0, calls **your** `inner_loop`, and stores acc / l.
#
# Your `inner_loop` visits keys [0, hi) in blocks of BLOCK_N (`hi` already stops at the causal
# diagonal). The loads are written; the tile of keys comes back transposed, [d, BLOCK_N], so
# `tl.dot(q, k)` is the score tile. Keys at or past `n_k` load as zeros: mask them to −inf, as
# well as (when CAUSAL) keys j > i + causal_offset, where `offs_m` holds each row's i. Then the
# update you wrote in notebook 03's exercise 1, with `tl.maximum`, `tl.max(x, 1)`, `tl.sum(x, 1)`, `tl.exp`,
# `tl.where` and `x[:, None]`.
#
# On this CPU the kernel runs in the **Triton interpreter** (`TRITON_INTERPRET=1`, which
# `llmlab.device` sets on a machine without CUDA): every program executes as NumPy, exact but
# thousands of times slower than the compiled kernel, so the check uses lengths up to 48,
# including lengths that are not multiples of the block size. Where Triton is not installed
# (it ships for Linux), these cells print a note instead.

# %%
if has_triton():
    import triton
    import triton.language as tl
    from llmlab.exercises.flash_triton_skeleton import load_k_block, load_v_block
else:
    print(TRITON_MISSING)

# %%
if has_triton():
    @triton.jit
    def inner_loop(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, n_k, hi,
                   causal_offset, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        # acc [BLOCK_M, d], l_i and m_i [BLOCK_M] (float32); q [BLOCK_M, d]; qk_scale = 1/√d
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)                 # key positions
            k = load_k_block(K, stride_kn, offs_n, offs_d, n_k)      # [d, BLOCK_N]
            v = load_v_block(V, stride_vn, offs_n, offs_d, n_k)      # [BLOCK_N, d]
            # YOUR CODE HERE: the score tile, its masks, the online-softmax update
        return acc, l_i, m_i

    print(exercises.check("nb03.flash_triton_inner_loop", inner_loop))
else:
    print(TRITON_MISSING)

# %% [markdown]
# Compare with llmlab's: the `flash_triton` backend (`llmlab.kernels.flash_attn`) is the full
# kernel. Beyond your loop it packs the query heads that share a KV head into one tile (K/V
# read once per group), splits the key loop into a masked and an unmasked phase so only the
# blocks that need a mask pay for one, uses exp2 with pre-scaled scores, and handles packed
# sequences (`cu_seqlens`). Checked against `naive`, then inside SmolLM2 for one prompt
# forward:

# %%
if has_triton():
    for sq, sk, causal in [(45, 45, True), (7, 60, True), (1, 50, True)]:
        q = torch.randn(2, sq, 6, 64, device=DEV)
        k = torch.randn(2, sk, 2, 64, device=DEV)
        v = torch.randn(2, sk, 2, 64, device=DEV)
        out = A.get("flash_triton").forward(q, k, v, causal=causal)
        ref = A.get("naive").forward(q, k, v, causal=causal)
        rel = ((out - ref).norm() / ref.norm()).item()
        print(f"flash_triton q_len={sq:2d} kv_len={sk:2d} causal={causal}: ‖Δ‖/‖ref‖ = {rel:.0e}, "
              f"within 2e-6: {rel <= 2e-6}")
    model = llmlab.load_model("smollm2-135m", attention="naive")
    tok = llmlab.load_tokenizer("smollm2-135m")
    ids = torch.tensor([tok("The capital of France is")["input_ids"]], device=model.device)
    with torch.inference_mode():
        logits_ref = model.set_attention("naive")(ids)[0, -1]
        logits_tri = model.set_attention("flash_triton")(ids)[0, -1]
    model.set_attention("naive")
    err = (logits_tri - logits_ref).abs().max().item()
    print(f"SmolLM2 with flash_triton: max |Δ logits| = {err:.0e} (within 1e-3: {err < 1e-3}); "
          f"same next token: {logits_tri.argmax().item() == logits_ref.argmax().item()}")
else:
    print(TRITON_MISSING)

# %% [markdown]
# ## What the compiler makes of a tile (compiled for H100, not run)
#
# The model above treats Br and Bc as free choices, bounded only from below: under the
# break-even of the exercise, Br = d/2, the K/V re-reads cost more bytes than S and P. On a GPU
# they are bounded from above too: the tile must fit the hardware of one SM, and only the
# compiler knows what it needs. Triton's compiler and NVIDIA's
# `ptxas`, which ship with Triton, can build the kernel for an H100 (`sm_90`) on this CPU machine
# without a GPU; `python -m llmlab.kernels.report` does that and reads the result back from the
# binary (`data/kernel_builds.json` holds every tile the explorer below offers). Nothing here
# ran on a GPU. What the build reports:
#
# - **registers per thread.** The score tile S and the accumulator live in registers, spread over
#   the tile's threads (32 per warp). A thread may hold at most **255** 32-bit registers, and an SM
#   has 64 K of them for all its resident threads (CUDA C++ Programming Guide, *Technical
#   Specifications per Compute Capability*).
# - **spills.** What does not fit in 255 registers goes to *local memory*: per-thread memory that
#   lives in device memory, so every spill is a load or store with DRAM latency behind the caches
#   (Programming Guide, *Device Memory Accesses*, "Local Memory").
# - **shared memory per block.** Triton stages the K and V tiles in shared memory, one copy per
#   pipeline stage (3 by default), so that the next tiles load while this one is multiplied; an
#   H100 block may use at most 227 KB of its SM's 228 KB.
# - **occupancy.** Resident warps on an SM over the 64 it can hold. Registers and shared memory
#   are divided among the resident blocks, so a block that takes a lot leaves room for few
#   others, and fewer warps are left to hide memory latency (CUDA C++ Best Practices Guide,
#   *Occupancy*).
# - **HGMMA.** The tensor-core instruction of Hopper's `wgmma` (a warpgroup of 4 warps multiplies
#   tiles read from shared memory); HMMA is the warp-level `mma.sync` of the A100. Their count in
#   the machine code shows that `tl.dot` runs on tensor cores.
#
# **Why 128×128 at d = 128 is a bad tile for 4 warps.** The accumulator is Br × d float32:
# 128 × 128 values over 128 threads is 128 registers per thread. The score tile S is Br × Bc
# float32: another 128 per thread. That is already 256, over the cap of 255, before P, the
# softmax statistics and the addresses: the compiler must spill. Shared memory is no better:
# K and V tiles of 128 × 128 bf16 are 32 KiB each, times 3 stages, plus Q, close to the whole
# 227 KB, so one block fits on an SM and 4 warps of 64 are resident. The same tile on 8 warps
# halves the registers per thread. This is the trade-off FlashAttention-2 describes (Dao, 2023,
# §3.3): larger blocks mean fewer loads and stores, but past a size register spills slow the
# kernel down or the shared memory needed exceeds what the GPU has, so it uses blocks of
# {64, 128} × {64, 128}, chosen by head dimension and shared memory. FlashAttention-3 (Shah et
# al., 2024), written for the H100's `wgmma` and TMA, even moves registers from the warps that
# only load data to the warps that multiply (`setmaxnreg`): registers are the scarce resource.

# %%
from llmlab.kernels import report as R

meta = R.table_meta()
print(f"builds compiled on this CPU machine with Triton {meta['triton']} on {meta['date']}; "
      f"none ran on a GPU")

# %%
# NBVAL_CHECK_OUTPUT
print("compiled for H100 (sm_90), not run: the FlashAttention kernel, bf16, head_dim 128, causal")
print(f"{'Br×Bc':>8s} {'warps':>5s} {'regs/thread':>11s} {'spill B/thread':>14s} {'smem KiB':>8s} "
      f"{'blocks/SM':>9s} {'occupancy':>9s} {'HGMMA':>5s}  limited by")
for bm, bn, w in [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 128, 4), (128, 128, 8)]:
    b = R.lookup("flash", "H100", "bf16", block_m=bm, block_n=bn, head_dim=128, num_warps=w)
    print(f"{f'{bm}×{bn}':>8s} {w:5d} {b.registers:11d} {b.spill_bytes:14d} "
          f"{b.shared_bytes / 1024:8.0f} {b.blocks_per_sm:9d} {b.occupancy:9.0%} "
          f"{b.tensor_core_ops['HGMMA']:5d}  {b.occupancy_limiter}")
if has_triton():
    from llmlab.kernels.flash_attn import tile_configs
    print("the autotuner's tiles for this case (Br, Bc, warps, stages):",
          tile_configs("sm_90", 128, "bf16"))

# %% [markdown]
# Read the rows against the argument above: the 128-row tiles on 4 warps hit the 255-register
# cap and spill, and their shared memory leaves room for one block per SM. On 8 warps each
# thread holds half of the accumulator and of S: the 128×64 tile then builds without spills,
# while 128×128 spills far less but still sits at the cap. The 64×64 tile fits in registers,
# and its 3 stages of K and V take about half of the shared memory. The autotuner of `flash_triton` only tries tiles that
# build without spills (`tests/test_kernel_compile.py` checks it on every run).
#
# ## Play: the block-size explorer
#
# Choose Br, Bc, head_dim, warps, N and a chip. Top left: the tile's on-chip bytes (Q, K+V, the
# fp32 score tile and accumulator, the statistics) against the chip's shared memory per SM (a
# conservative count: on a GPU the score tile and accumulator sit in registers). Top right: the
# modelled HBM traffic. Bottom left: what the compiler made of exactly this tile for the chosen
# chip, bf16 (from the table above: compiled on this CPU machine, not run): registers of 255,
# shared memory of the per-block limit, occupancy, and below them spills and tensor-core
# instructions. Bottom right: the Triton kernel timed with these blocks: compiled on a GPU, in
# the Triton interpreter on a CPU (at N ≤ 128; the interpreter runs every program as NumPy, so
# this measures Python, not a GPU).

# %%
import ipywidgets as widgets
from llmlab.viz.flash import flash_explorer

tiles = R.WIDGET_TILES["flash"]         # every choice below has a build in the table
widgets.interactive(
    lambda block_q=64, block_k=64, head_dim=64, num_warps=4, n=4096, chip="H100":
        flash_explorer(block_q, block_k, head_dim, n, chip, num_warps=num_warps).figure,
    block_q=widgets.SelectionSlider(options=tiles["block_m"], value=64, description="Br"),
    block_k=widgets.SelectionSlider(options=tiles["block_n"], value=64, description="Bc"),
    head_dim=widgets.SelectionSlider(options=tiles["head_dim"], value=64, description="head_dim"),
    num_warps=widgets.SelectionSlider(options=tiles["num_warps"], value=4, description="warps"),
    n=widgets.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 16384, 32768], value=4096,
                              description="N"),
    chip=list(CHIPS))

# %%
r = flash_explorer(block_q=128, block_k=128, head_dim=128, n=8192, chip="H100", num_warps=4)
b = r.build
print(f"tile {r.footprint_bytes / 1024:.0f} KiB of {r.smem_bytes // 1024} KiB: fits={r.fits}; "
      f"modelled traffic tiled/standard = {r.tiled_bytes / r.standard_bytes:.2f}")
print(f"compiled for H100 (sm_90), not run: {b.registers} registers/thread, {b.spill_bytes} B spilled, "
      f"{b.shared_bytes / 1024:.0f} KiB shared, occupancy {b.occupancy:.0%} ({b.occupancy_limiter})")
if r.measured_s is not None:
    print(f"measured {r.measured_s * 1e3:.1f} ms, median of 5 (min {r.measured_spread[0] * 1e3:.1f}, "
          f"max {r.measured_spread[1] * 1e3:.1f}): {r.measured_what}, N={r.measured_n}")
else:
    print(r.measured_what)

# %% [markdown]
# ## Takeaways
#
# - In the roofline model of an H100, standard attention is bound by moving S and P through HBM; the FlashAttention-2 loop moves about d/Br as much and stays several times ahead at every N.
# - A tile is a register and shared-memory budget per SM: past 255 registers per thread the compiler spills, and a large tile leaves room for few warps.
# - Triton writes the loop over tiles (`tl.load`, `tl.dot`); the online softmax is the same five lines as in PyTorch.
#
# ## Further reading
#
# - Dao. *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning.* 2023 (ICLR 2024). [arXiv:2307.08691](https://arxiv.org/abs/2307.08691) (§3.3: block sizes, registers and shared memory)
# - Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao. *FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision.* 2024 (NeurIPS 2024). [arXiv:2407.08608](https://arxiv.org/abs/2407.08608) (wgmma, TMA, warp specialization, register reallocation on the H100)
# - NVIDIA. *CUDA C++ Programming Guide*: [technical specifications per compute capability](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications) (255 registers per thread, 64 K per SM, shared memory per SM and per block) and [local memory](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#device-memory-accesses) (where spills go); *CUDA C++ Best Practices Guide*, [occupancy](https://docs.nvidia.com/cuda/cuda-c-best-practices-guide/index.html#occupancy); [*Hopper Tuning Guide*](https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html); PTX ISA, [warpgroup-level matrix instructions (wgmma)](https://docs.nvidia.com/cuda/parallel-thread-execution/index.html#asynchronous-warpgroup-level-matrix-instructions)
# - Tillet, Kung, Cox. *Triton: An Intermediate Language and Compiler for Tiled Neural Network Computations.* MAPL 2019. [doi:10.1145/3315508.3329973](https://doi.org/10.1145/3315508.3329973); [Triton tutorials](https://triton-lang.org/main/getting-started/tutorials/index.html)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
# - NVIDIA H100 product page (bandwidth, memory, peak FLOP/s): [H100](https://www.nvidia.com/en-us/data-center/h100/)
