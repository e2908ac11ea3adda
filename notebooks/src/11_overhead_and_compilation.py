# %% [markdown]
# # 11 · Overhead, fusion and compilation
#
# **Why.** Notebooks 02 and 08 priced a decode step by its bytes: the weights stream once per
# step, so the step should take bytes / bandwidth. A real step also *calls* things. An eager
# PyTorch decode step of SmolLM2 makes about a thousand operator calls from Python (three
# projections, a norm, RoPE, the cache write, attention, an MLP in each of 30 layers), and every
# call costs microseconds of interpreter, dispatcher and allocation time *whatever the size of
# its tensor*. The step time is then closer to
#
# $$t_\text{step} \approx \max\left(\frac{\text{bytes}}{\text{bandwidth}},\ \frac{\text{FLOPs}}{\text{peak}}\right) + \text{ops}\cdot t_\text{op}$$
#
# an *overhead roofline*. As the matmuls get faster (fewer bytes per weight, or a GPU that
# streams 3 TB/s), the second term takes over. The systems that made inference fast attacked
# that term in three ways:
#
# - **Fusion.** NVIDIA's [FasterTransformer](https://github.com/NVIDIA/FasterTransformer) and
#   TurboTransformers (Fang, Yu, Zhao, Zhou, *TurboTransformers: An Efficient GPU Serving System
#   for Transformer Models*, PPoPP 2021, [arXiv:2010.05680](https://arxiv.org/abs/2010.05680))
#   fuse every operation between two GEMMs (bias, activation, residual add, layer norm) into one
#   kernel each, so that a layer launches a handful of kernels instead of dozens.
# - **Compilation.** `torch.compile` traces the Python step into a graph once (TorchDynamo) and
#   generates fused kernels for it (Inductor): Ansel et al., *PyTorch 2*, ASPLOS 2024
#   ([doi:10.1145/3620665.3640366](https://doi.org/10.1145/3620665.3640366)). PyTorch's gpt-fast
#   took Llama-2-7B from 25.5 to 107 tok/s on an A100 with `torch.compile` and a static KV cache
#   alone, before any quantization ([*Accelerating Generative AI with PyTorch II: GPT,
#   Fast*](https://pytorch.org/blog/accelerating-generative-ai-2/), 2023).
# - **Graphs of launches.** A CUDA graph records a step's kernel launches once and replays them
#   with one call: nano-vllm and vLLM capture the decode step per batch size
#   (vLLM's [`CudaGraphManager`](https://docs.vllm.ai/en/v0.13.0/api/vllm/v1/worker/gpu/cudagraph_utils/)). vLLM v0.6.0
#   reported 2.7× more throughput, mostly from removing CPU overhead around the GPU
#   ([vLLM blog, September 2024](https://blog.vllm.ai/2024/09/05/perf-update.html)).
#
# In this notebook you count the operator calls of one decode step and look at a trace of them,
# measure what each call costs on this machine, **build** the piece that lets a compiler turn the
# step into one graph (a KV cache whose shapes never change), compile SmolLM2's decode step with
# it, put eager and compiled steps on the overhead roofline, and model what CUDA graphs do on a
# GPU.

# %%
import os
import time

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.device import describe
from llmlab.profiling.overhead import (OverheadModel, OverheadPoint, count_ops, make_decode_step,
                                       measure_op_overhead, step_breakdown, trace_ops)
from llmlab.profiling.roofline import decode_cost, measure_ceilings
from llmlab.quant import quantize, weight_nbytes

torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
print("torch threads", torch.get_num_threads())
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
int8 = quantize(model, "int8", rounding="rtn")       # notebook 08's int8 weights and C kernels
print(f"weights read per step: float32 {weight_nbytes(model) / 1e6:.0f} MB, "
      f"int8 {weight_nbytes(int8) / 1e6:.0f} MB")

# %% [markdown]
# ## How: count the calls of one decode step
#
# `make_decode_step(model, batch, context)` returns a function that runs one decode step (one
# new token per sequence after `context` cached ones) the way `llmlab.generate` does.
# `count_ops` runs it once under PyTorch's profiler and counts the *top-level* operator calls:
# each time the step crosses from Python into PyTorch's dispatcher (`aten::linear` counts once,
# not also the `aten::mm` it calls inside).

# %%
eager_step = make_decode_step(model, batch=1, context=32)
ops = count_ops(eager_step)
print(f"one eager decode step, float32, batch 1: {ops.total} operator calls, "
      f"{ops.matmul_calls} of them matmuls ({ops.total / model.config.num_layers:.0f} per layer)")
for name, n in ops.by_name.most_common(8):
    print(f"  {n:5d}  {name}")

# %% [markdown]
# And what one call costs: `measure_op_overhead` times thousands of `x + x` on a one-element
# tensor, an operator with no work in it, so what is left is the fixed cost of a call.

# %%
t_op = measure_op_overhead()
print(f"t_op = {t_op * 1e6:.2f} µs per tiny eager operator on this machine; "
      f"{ops.total} calls × t_op = {ops.total * t_op * 1e3:.2f} ms per step before any work")

# %% [markdown]
# ### A trace of the step
#
# `trace_ops` records when each call starts and ends. Below are the first 120 calls of the
# step (about three layers): blue bars are matmuls, orange bars every other operator, and the
# white gaps are time spent in Python between calls.

# %%
from llmlab.viz.overhead import explore_overhead, plot_overhead_roofline, plot_trace

trace = trace_ops(eager_step)
plot_trace(trace, first=120)
plt.show()
first = trace[:120]
span = first[-1].start_us + first[-1].duration_us
inside_mm = sum(o.duration_us for o in first if o.matmul)
inside_other = sum(o.duration_us for o in first if not o.matmul)
display(Markdown(
    f"In these {len(first)} calls ({span:.0f} µs, measured under the profiler, which slows "
    f"calls down), {inside_mm / span:.0%} of the time is inside matmuls, "
    f"{inside_other / span:.0%} inside the other operators and "
    f"{1 - (inside_mm + inside_other) / span:.0%} between calls."))

# %% [markdown]
# ## Predict, then measure: how much of a step is overhead?
#
# The int8 model of notebook 08 reads a quarter of the float32 bytes per step, through C
# kernels; its Python code and its small operators are the float32 model's. At batch 1, which
# share of an int8 decode step is spent *outside* the matrix multiplies?

# %%
exercises.ask("nb11.predict_outside_share")

# %%
answer = ...  # YOUR ANSWER: "a", "b", "c" or "d"

# %% [markdown]
# `step_breakdown` times the step without the profiler (median of several runs), times the
# matmuls inside it with the profiler, and calls the difference "outside": Python, the
# dispatcher, allocations and every small operator.

# %%
breakdowns = {}
for label, m, b in (("float32, batch 1", model, 1), ("int8, batch 1", int8, 1),
                    ("float32, batch 8", model, 8), ("int8, batch 8", int8, 8)):
    br = step_breakdown(make_decode_step(m, batch=b, context=32), repeats=7)
    breakdowns[label] = br
    print(f"{label:17s} {br.median_s * 1e3:6.1f} ms per step ({br.min_s * 1e3:.1f}–"
          f"{br.max_s * 1e3:.1f}); outside the matmuls {br.outside_s * 1e3:5.1f} ms "
          f"({br.outside_share:.0%}); {br.ops.total} calls")

# %%
print(exercises.check("nb11.predict_outside_share", answer,
                      measured=breakdowns["int8, batch 1"].outside_share))

# %%
f32, i8 = breakdowns["float32, batch 1"], breakdowns["int8, batch 1"]
display(Markdown(
    f"From float32 to int8 the time inside the matmuls went from {f32.matmul_s * 1e3:.1f} to "
    f"{i8.matmul_s * 1e3:.1f} ms and the time outside them from {f32.outside_s * 1e3:.1f} to "
    f"{i8.outside_s * 1e3:.1f} ms, so the outside share went from {f32.outside_share:.0%} to "
    f"{i8.outside_share:.0%}. Per call, the int8 step spends {i8.outside_per_op_s * 1e6:.1f} µs "
    f"outside the matmuls, against {t_op * 1e6:.2f} µs for a tiny `x + x`: the small operators "
    "(norms, RoPE, attention, cache writes) do some work of their own."))

# %% [markdown]
# ## Why a compiler needs fixed shapes
#
# `torch.compile` runs the step once under TorchDynamo, which records every tensor operation
# into a graph and *guards* it: the graph is reused only while the inputs keep the shapes,
# dtypes and Python values it was recorded with. Inductor then generates one program for that
# graph: the elementwise operators between two matmuls merge into single loops (fusion), and
# the Python that called them runs once per step instead of once per operator.
#
# Notebook 02's contiguous cache reads `k[:, :, :length]`: a tensor one slot longer at every
# step. To a compiler that is a new shape, a failed guard and a new graph at every position,
# hundreds of compilations for one answer. gpt-fast's answer is a **static KV cache**:
#
# - per layer, K and V are allocated once as `[batch, kv_heads, max_len + 1, head_dim]`; a
#   token at position p lives in slot p, and the extra last slot is a *bin* where padding
#   tokens write and which nobody reads;
# - the step writes its new K/V with a scatter at a **tensor** of slots, so the position is
#   data flowing through the graph, not a number baked into it;
# - attention reads **all** slots under a mask `slot ≤ position of the query` built from that
#   tensor: the slots not written yet (or left over from an earlier request) are masked out.
#
# The price is that every step attends over `max_len` slots whatever the length, which is why
# `llmlab` sizes `max_len` to the generation at hand, in powers of two (`slots_for`).
#
# A custom operator removes that price while keeping the shapes fixed. On a CPU in float32,
# llmlab's `StaticKVCache` calls `llmlab::static_attend`, a C++ kernel registered with PyTorch's
# dispatcher: the graph sees one call with fixed-shape inputs, and inside it the loop over slots
# stops at the query's position, which is data the kernel reads, not a shape. It also writes the
# new K/V in place, where a compiled scatter on a cache that is a graph input is first written
# into a copy of the cache and then copied back. Your function below is the plain-PyTorch
# version, which is also that operator's reference in the tests.

# %% [markdown]
# ## Build: the static cache's write and read
#
# Write `fixed_shape_attend(k_cache, v_cache, slots, q, k, v)`: the part of a static KV cache
# that runs inside the step, for one layer.
#
# - `k_cache`, `v_cache` `[batch, kv_heads, max_len + 1, head_dim]`: this layer's cache; write
#   the new keys and values into them **in place** (the next step must find them);
# - `slots` `[batch, s]` (long): the slot of each new token, which is its position, or `max_len`
#   (the bin) for a padding token;
# - `q` `[batch, s, heads, head_dim]`, `k`, `v` `[batch, s, kv_heads, head_dim]`: the new tokens'
#   queries, keys and values (RoPE applied). SmolLM2 has 9 query heads per 3 KV heads: query head
#   `h` uses KV head `h // (heads // kv_heads)`;
# - return `[batch, s, heads, head_dim]`: query i of row b attends to every slot up to its own
#   position and never to the bin.
#
# Nothing in it may depend on the position as a Python value: no `int(...)` or `.item()` of a
# tensor, no slice whose end comes from the cache's length. The checker tries a small padded
# case, runs SmolLM2's greedy generation with your cache, then compiles two of SmolLM2's layers
# around your function with `torch.compile(fullgraph=True)` and decodes 256 positions: same
# tokens as eager, and no new graph after the first.

# %%
def fixed_shape_attend(k_cache, v_cache, slots, q, k, v):
    raise NotImplementedError


# %%
print(exercises.check("nb11.fixed_shape_attend", fixed_shape_attend))

# %% [markdown]
# llmlab's own version is `llmlab.cache.static.static_attend`, driven by
# `llmlab.cache.StaticKVCache`; it differs from a plain version in one place: it folds the query
# heads that share a KV head into extra query rows instead of copying K and V per head.

# %% [markdown]
# ## Compile the decode step
#
# `llmlab.generate(..., compile=True)` runs the prompt eagerly, then every decode step through
# one graph compiled over a `StaticKVCache` (vLLM's `enforce_eager=False`). The first call of a
# batch size compiles: that wait is the *cold start* that vLLM's users often report. Inductor
# keeps what it built on disk, so a second process with the same model and shapes skips most of
# it. `graphs_compiled()` counts the graphs compiled in this process.
#
# Compiling all 30 layers of SmolLM2 takes minutes on a 2-core CPU, so this section compiles a
# model made of SmolLM2's embedding, its **first 6 layers** and its head (`first_layers`: the
# same weights, shared). Its graph, its recompiles and its fused kernels are those of the whole
# model, six times shorter; `python -m llmlab.bench overhead` compiles the whole model.

# %%
from llmlab.compile import graphs_compiled
from llmlab.models import first_layers

short = first_layers(model, 6)
prompt = "Give three tips for writing clear code."
before = graphs_compiled()
eager_gen = llmlab.generate(short, tok, prompt, max_new_tokens=48, kv_cache="contiguous",
                            ignore_eos=True)
t0 = time.perf_counter()
compiled_gen = llmlab.generate(short, tok, prompt, max_new_tokens=48, compile=True,
                               ignore_eos=True)
first_call_s = time.perf_counter() - t0
after_first = graphs_compiled()
t0 = time.perf_counter()
again = llmlab.generate(short, tok, prompt, max_new_tokens=48, compile=True, ignore_eos=True)
second_call_s = time.perf_counter() - t0
same = eager_gen.token_ids == compiled_gen.token_ids == again.token_ids
print(f"greedy tokens identical to eager: {same} ({len(eager_gen.token_ids)} tokens)")
print(f"first compiled generation {first_call_s:.1f} s (compiling included), "
      f"the same again {second_call_s:.2f} s")
print(f"graphs compiled by the first call: {after_first - before}; by the second: "
      f"{graphs_compiled() - after_first}")

# %% [markdown]
# Now one decode step of the short model, eager and compiled. `make_decode_step(...,
# compile=True)` runs the step `generate` just compiled (same batch and bucket of slots, so the
# graph is reused), and `count_ops` sees what still crosses the dispatcher. Inductor generates
# C++ loops for the elementwise work (norms, RoPE, SiLU, the residual adds) and calls them
# directly; the matmuls stay operator calls. On a CPU, `compile=True` adds one graph pass of
# llmlab's (`llmlab.compile._gemv_pass`): a float32 matmul of a few rows against a weight becomes
# `llmlab::f32_gemv`, a C kernel that streams the weight once (batch-1 decode is a
# matrix-*vector* product, which a BLAS tuned for big matrices does not stream at full speed);
# without a C compiler the pass is off and Inductor calls BLAS's `aten::mm`. The printout names
# the calls that are left.

# %%
short_eager = {b: step_breakdown(make_decode_step(short, batch=b, context=32), repeats=7)
               for b in (1, 8)}
compiled_step_fn = make_decode_step(short, batch=1, context=32, steps=200, compile=True)
compiled_step_fn()
new_graphs = graphs_compiled() - after_first
compiled_br = step_breakdown(compiled_step_fn, repeats=7)
e1 = short_eager[1]
print(f"new graphs for this step: {new_graphs}")
for label, br in (("eager", e1), ("compiled", compiled_br)):
    print(f"{label:9s} {br.ops.total:4d} operator calls, {br.median_s * 1e3:5.1f} ms per step "
          f"({br.min_s * 1e3:.1f}–{br.max_s * 1e3:.1f}), {br.outside_s * 1e3:4.1f} ms outside "
          "the matmuls")
top = ", ".join(f"{name} ×{n}" for name, n in compiled_br.ops.by_name.most_common(4))
print(f"the compiled step's most frequent calls: {top}")

# %% [markdown]
# ## Measure: eager and compiled on the overhead roofline
#
# Each step goes on the plot at its operator count (x) and its measured time (y, median with
# min–max). The dashed line of each batch is the memory/compute roof alone (from this machine's
# measured copy bandwidth and matmul peak), the solid line the roof plus ops × t_op. Hollow
# markers are what the model predicts for each step.

# %%
ceil = measure_ceilings(copy_bytes=128 * 2**20, matmul_n=1024, repeats=5)
omodel = OverheadModel.from_ceilings(ceil, t_op)


def point(label, batch, br):
    cost = decode_cost(short.config, batch, 32, 4)
    return OverheadPoint(label, batch, br.ops.total, cost.bytes, cost.flops,
                         br.median_s, br.min_s, br.max_s)


points = [point("eager", 1, short_eager[1]), point("compiled", 1, compiled_br),
          point("eager", 8, short_eager[8])]
print(f"copy bandwidth {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
      f"matmul peak {ceil.peak_flops_per_s / 1e9:.0f} GFLOP/s, t_op {t_op * 1e6:.2f} µs")
plot_overhead_roofline(points, omodel, title="SmolLM2's first 6 layers: eager and compiled")
plt.show()

# %%
pe, pc = points[0], points[1]
roof1 = omodel.roof_seconds(pe.bytes, pe.flops)
display(Markdown(
    f"At batch 1 the roof alone is {roof1 * 1e3:.1f} ms; eager measured "
    f"{pe.median_s * 1e3:.1f} ms ({roof1 / pe.median_s:.0%} of the memory roof) and the "
    f"compiled step {pc.median_s * 1e3:.1f} ms ({roof1 / pc.median_s:.0%}). Compiling removed "
    f"{pe.ops - pc.ops} of {pe.ops} operator calls ({pe.ops / pc.ops:.1f}× fewer), which the "
    f"model prices at {(pe.ops - pc.ops) * t_op * 1e3:.1f} ms; the step took "
    f"{abs(pc.median_s - pe.median_s) * 1e3:.1f} ms {'less' if pc.median_s < pe.median_s else 'more'}. Outside the matmuls it went from "
    f"{e1.outside_s * 1e3:.1f} to {compiled_br.outside_s * 1e3:.1f} ms; inside them "
    f"from {e1.matmul_s * 1e3:.1f} ms (`aten::linear`, which calls the BLAS) to "
    f"{compiled_br.matmul_s * 1e3:.1f} ms"
    + (" (`llmlab::f32_gemv`, the graph pass's C loop, which reads each thread's weight rows "
       "as one sequential stream)" if compiled_br.ops.by_name["llmlab::f32_gemv"] else "")
    + ". "
    + (f"The compiled step was {pe.median_s / pc.median_s:.2f}× faster." if pc.median_s < pe.median_s
       else "The compiled step was not faster here: Dynamo checks its guards on the inputs at "
            "every call, and Inductor's loops use OpenMP threads, which lose most when other "
            "work holds the cores. Fewer calls pay only when the calls were the cost.")))

# %% [markdown]
# ## Play: batch × mode
#
# The widget draws one batch's points on the overhead roofline. `t_op scale` asks *what if each
# operator call cost less*, for example because a CUDA graph replays the launches: the model's
# lines move, the measured points do not. At which scale would the eager step reach its roof?

# %%
import ipywidgets as widgets


def play(batch: int, t_op_scale: float) -> None:
    explore_overhead(points, omodel, batch=batch, t_op_scale=t_op_scale)
    plt.show()


widgets.interactive(play, batch=widgets.Dropdown(options=[1, 8], value=1),
                    t_op_scale=widgets.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.1))

# %% [markdown]
# The full matrix, float32, int8 and int4 × eager, compiled and compiled + fused at batch 1
# and 8, with HF transformers and (where `llama_cpp` is installed) llama.cpp on the shipped Q4_1
# file in the same run, is `python -m llmlab.bench overhead`. Its last measured numbers are in
# the README's results table, with the machine named.

# %% [markdown]
# ## Fusion by hand
#
# Inductor fuses the small operators automatically. The kernels it cannot write for you are the
# ones where you change the *computation*: `llmlab.layers.fused.fuse_model` concatenates each
# layer's q/k/v weights into one matrix (one matmul instead of three) and gate/up into one, then
# takes the results apart in fused kernels (`llmlab/kernels/fused.py`: `add_rmsnorm`, `swiglu`,
# `qkv_rope`, in Triton with PyTorch references). Counted eagerly:

# %%
import copy

from llmlab.layers.fused import fuse_model

fused = fuse_model(copy.deepcopy(model), "torch")
fused_ops = count_ops(make_decode_step(fused, batch=1, context=32))
full_eager_gen = llmlab.generate(model, tok, prompt, max_new_tokens=48, kv_cache="contiguous")
print(f"eager, unfused: {ops.total} calls ({ops.matmul_calls} matmuls); eager, fused: "
      f"{fused_ops.total} calls ({fused_ops.matmul_calls} matmuls)")
gen_fused = llmlab.generate(fused, tok, prompt, max_new_tokens=48, kv_cache="contiguous")
print("fused greedy tokens identical to unfused:", gen_fused.token_ids == full_eager_gen.token_ids)

# %% [markdown]
# ### Stretch: RMSNorm with the residual add, in Triton
#
# Between the attention and the MLP a decoder layer computes `h = x + residual`, then
# `rmsnorm(h) · weight`. Unfused that is an add, a square, a mean, an rsqrt and two multiplies,
# each reading and writing a row. Write the Triton kernel that does all of it in one pass, one
# program per row: load a row of `X` and `R`, store `H = X + R`, store
# `OUT = H / sqrt(mean(H²) + eps) · W`. Rows are `n_cols` long and contiguous; `BLOCK` is the
# next power of two ≥ `n_cols`, so mask the columns past the row. Without a GPU it runs in
# Triton's interpreter.

# %%
from llmlab.device import TRITON_MISSING, has_triton

if has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_kernel(X, R, W, OUT, H, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        # YOUR CODE HERE
        pass

    print(exercises.check("nb11.add_rmsnorm_kernel", add_rmsnorm_kernel))
else:
    print(TRITON_MISSING)

# %% [markdown]
# ## Predict, explain: CUDA graphs
#
# On a GPU the same calls cost more: each eager operator is a Python call *and* a kernel
# launch, a few microseconds of CPU time, while a GPU streams SmolLM2's 270 MB of bfloat16
# weights in under 0.1 ms. The model below puts an H100's published roofs (3.35 TB/s of HBM3,
# 989 TFLOP/s dense bfloat16) beside this machine's t_op and the eager step's operator count:
# eager, the CPU's launches set the pace whenever they take longer than the kernels; a CUDA
# graph launches the whole step with one call. It is a model, not a measurement.

# %%
h100 = OverheadModel(bandwidth_bytes_per_s=3.35e12, peak_flops_per_s=989e12, t_op=t_op,
                     device="H100 (model)")
rows = []
for b in (1, 8, 64, 256):
    cost = decode_cost(model.config, b, 512, 2)
    roof = h100.roof_seconds(cost.bytes, cost.flops)
    eager_s = max(roof, h100.dispatch_seconds(ops.total))   # launches overlap the kernels
    graph_s = roof + 10e-6                                   # one replay call
    rows.append((b, roof, eager_s, graph_s))
    print(f"batch {b:3d}: roof {roof * 1e3:6.3f} ms, eager ≥ {eager_s * 1e3:6.3f} ms, "
          f"graph ≈ {graph_s * 1e3:6.3f} ms, modelled gain {eager_s / graph_s:5.1f}×")

fig, ax = plt.subplots(figsize=(6, 3), dpi=80)
ax.plot([r[0] for r in rows], [r[2] / r[3] for r in rows], "o-")
ax.set(xscale="log", xlabel="batch", ylabel="eager / graph step time (model)",
       title="CUDA graphs on an H100, modelled with this machine's t_op")
ax.grid(True, alpha=0.3)
plt.show()

# %%
if torch.cuda.is_available():
    gpu = llmlab.load_model("smollm2-135m", attention="sdpa", device="cuda", dtype=torch.bfloat16)
    for b in (1, 8):
        eager_t = step_breakdown(make_decode_step(gpu, batch=b, context=32), repeats=9)
        graph_t = step_breakdown(make_decode_step(gpu, batch=b, context=32, compile=True),
                                 repeats=9)
        print(f"GPU batch {b}: eager {eager_t.median_s * 1e3:.2f} ms, CUDA graph "
              f"{graph_t.median_s * 1e3:.2f} ms ({eager_t.median_s / graph_t.median_s:.1f}×)")
else:
    print("no GPU here: the CUDA-graph step is modelled above, not measured "
          "(on a CUDA machine this cell measures it)")

# %%
exercises.ask("nb11.explain_cuda_graphs")

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb11.explain_cuda_graphs", answer)

# %% [markdown]
# ## Takeaways
#
# - A decode step costs its bytes *and* its calls: about a thousand eager operator calls per
#   SmolLM2 step, each a few microseconds whatever its size. The overhead roofline adds
#   ops × t_op to the bytes / bandwidth roof.
# - The faster the matmuls (quantized weights, a GPU), the larger the share of the calls.
# - A compiler can remove the calls only if the step keeps one shape: the static KV cache writes
#   at a tensor of slots and reads all slots under a position mask, so one graph serves every
#   position. Count recompiles; there should be none after the warm-up.
# - Fusion changes the computation (one matmul for q/k/v, one pass for add + RMSNorm);
#   compilation fuses what is left between the matmuls; CUDA graphs remove the launches.
# - Compiling costs a cold start, kept on disk for the next process.
#
# ## Further reading
#
# - Ansel et al. *PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
#   Transformation and Graph Compilation.* ASPLOS 2024.
#   [doi:10.1145/3620665.3640366](https://doi.org/10.1145/3620665.3640366)
# - PyTorch team. *Accelerating Generative AI with PyTorch II: GPT, Fast.* 2023.
#   [pytorch.org/blog/accelerating-generative-ai-2](https://pytorch.org/blog/accelerating-generative-ai-2/);
#   code: [github.com/pytorch-labs/gpt-fast](https://github.com/pytorch-labs/gpt-fast)
# - Fang, Yu, Zhao, Zhou. *TurboTransformers: An Efficient GPU Serving System for Transformer
#   Models.* PPoPP 2021. [arXiv:2010.05680](https://arxiv.org/abs/2010.05680)
# - NVIDIA FasterTransformer: [github.com/NVIDIA/FasterTransformer](https://github.com/NVIDIA/FasterTransformer)
# - vLLM: its CUDA-graph manager, [docs.vllm.ai](https://docs.vllm.ai/en/v0.13.0/api/vllm/v1/worker/gpu/cudagraph_utils/);
#   *vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction*,
#   [blog.vllm.ai](https://blog.vllm.ai/2024/09/05/perf-update.html)
# - nano-vllm (CUDA graphs for decode in a small engine): [github.com/GeeeekExplorer/nano-vllm](https://github.com/GeeeekExplorer/nano-vllm)
# - NVIDIA. *Getting Started with CUDA Graphs.* 2019.
#   [developer.nvidia.com/blog/cuda-graphs](https://developer.nvidia.com/blog/cuda-graphs/)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for
#   Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
