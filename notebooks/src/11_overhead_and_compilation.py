# %% [markdown]
# # 11 · Overhead, fusion and compilation
#
# **Why.** Notebooks 02 and 08 priced a decode step by its bytes: the weights stream once per
# step. A real step also *calls* things: an eager decode step of SmolLM2 makes over a thousand
# operator calls from Python, each costing microseconds of interpreter, dispatcher and allocation
# time *whatever the size of its tensor*. The step time is then closer to
#
# $$t_\text{step} \approx \max\left(\frac{\text{bytes}}{\text{bandwidth}},\ \frac{\text{FLOPs}}{\text{peak}}\right) + \text{ops}\cdot t_\text{op}$$
#
# an *overhead roofline*. The faster the matmuls (fewer bytes per weight, a GPU), the more the
# second term matters. Three answers:
#
# - **Fusion.** [FasterTransformer](https://github.com/NVIDIA/FasterTransformer) and
#   TurboTransformers ([arXiv:2010.05680](https://arxiv.org/abs/2010.05680)) fuse the operations
#   between two GEMMs (bias, activation, residual add, layer norm) into one kernel each.
# - **Compilation.** `torch.compile` traces the step into a graph (TorchDynamo) and generates
#   fused kernels for it (Inductor; Ansel et al., ASPLOS 2024). gpt-fast took Llama-2-7B from 25.5
#   to 107 tok/s on an A100 with `torch.compile` and a static KV cache
#   ([PyTorch blog, 2023](https://pytorch.org/blog/accelerating-generative-ai-2/)).
# - **CUDA graphs** record a step's kernel launches once and replay them with one call; vLLM
#   captures the decode step per batch size, and its v0.6.0 reported 2.7× more throughput, mostly
#   from removing CPU overhead ([vLLM blog, 2024](https://blog.vllm.ai/2024/09/05/perf-update.html)).
#
# You will count a step's calls, measure what a call costs, **build** a KV cache whose shapes
# never change, compile SmolLM2's step and split what compiling gained from what a custom kernel
# gained, and model CUDA graphs on a GPU.

# %%
import os
import time

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.compile import graphs_compiled
from llmlab.device import describe
from llmlab.profiling.compare import compare, expect
from llmlab.profiling.overhead import (CompileSplit, OverheadModel, OverheadPoint, compare_parts,
                                       count_ops, make_decode_step, measure_op_overhead,
                                       step_breakdowns, trace_ops)
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
# And what one call costs, in a micro-benchmark: `measure_op_overhead` times thousands of `x + x`
# on a one-element tensor, an operator with no work in it.

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
mm_share = sum(o.duration_us for o in first if o.matmul) / span
other_share = sum(o.duration_us for o in first if not o.matmul) / span
display(Markdown(
    f"In these {len(first)} calls ({span:.0f} µs, under the profiler, which slows calls down), "
    f"{mm_share:.0%} of the time is inside matmuls, {other_share:.0%} inside the other "
    f"operators and {1 - mm_share - other_share:.0%} between calls."))

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
# `step_breakdowns` times each step without the profiler (the four in turn, round after round),
# times the matmuls inside them in profiled runs, and calls the difference "outside": Python,
# the dispatcher, allocations and every small operator.

# %%
configs = {"float32, batch 1": (model, 1), "int8, batch 1": (int8, 1),
           "float32, batch 8": (model, 8), "int8, batch 8": (int8, 8)}
breakdowns = step_breakdowns({label: make_decode_step(m, batch=b, context=32)
                              for label, (m, b) in configs.items()}, repeats=7)
for label, br in breakdowns.items():
    print(f"{label:17s} {br.median_s * 1e3:6.1f} ms per step ({br.min_s * 1e3:.1f}–"
          f"{br.max_s * 1e3:.1f}); outside the matmuls {br.outside_s * 1e3:5.1f} ms "
          f"({br.outside_share:.0%}); {br.ops.total} calls")

# %%
print(exercises.check("nb11.predict_outside_share", answer,
                      measured=breakdowns["int8, batch 1"].outside_share))

# %%
f32, i8 = breakdowns["float32, batch 1"], breakdowns["int8, batch 1"]
parts = compare_parts(f32, i8, "the float32 step", "the int8 step")
said = {k: c.sentence() if c else "too few positive samples to compare on this run"
        for k, c in parts.items()}
display(Markdown(
    f"At batch 1, {said['step']}. Inside the matmuls, {f32.matmul_s * 1e3:.1f} → "
    f"{i8.matmul_s * 1e3:.1f} ms: {said['inside']}. Outside them, {f32.outside_s * 1e3:.1f} → "
    f"{i8.outside_s * 1e3:.1f} ms: {said['outside']}. The outside share went from "
    f"{f32.outside_share:.0%} to {i8.outside_share:.0%}."))

# %% [markdown]
# What a call costs *in a step* is t_call = (step time − time in the matmuls) / calls. It is not
# the micro-benchmark's t_op: `x + x` on one element in a loop stays in cache and takes the
# dispatcher's shortest path, while a step's calls also pay for the Python between them, for
# composite operators (`aten::linear`), real-size allocations and the small operators' own work
# (norms, RoPE, attention), with the weights streaming through pushing code and data out of
# the caches. The roofline below uses t_call.

# %%
t_call = f32.outside_per_op_s
print(f"t_op   = {t_op * 1e6:5.2f} µs  (x + x on one element, in a loop)")
print(f"t_call = {t_call * 1e6:5.2f} µs  = ({f32.median_s * 1e3:.1f} ms float32 step − "
      f"{f32.matmul_s * 1e3:.1f} ms in its matmuls) / {f32.ops.total} calls")
print(f"t_call / t_op = {t_call / t_op:.1f}; in the trace above, "
      f"{1 - mm_share - other_share:.0%} of the time is between calls and "
      f"{other_share:.0%} inside the small operators")

# %% [markdown]
# ## Why a compiler needs fixed shapes
#
# `torch.compile` runs the step once under TorchDynamo, which records its tensor operations into
# a graph and *guards* it: the graph is reused while the inputs keep the shapes, dtypes and
# Python values it was recorded with. Inductor then generates code for the graph: the elementwise
# operators between two matmuls merge into single loops, and the Python that called them runs
# once per step instead of once per operator.
#
# Notebook 02's contiguous cache reads `k[:, :, :length]`, one slot longer at every step. Default
# `torch.compile` (`dynamic=None`) compiles the first length as a static graph; when the length
# changes, the guard fails and the recompile marks that dimension dynamic (*automatic dynamic
# shapes*), so the second graph is symbolic in the length and serves every later one. Counted on a
# small attention over a growing K/V, against `dynamic=False`, which keeps every graph static:

# %%
# NBVAL_CHECK_OUTPUT
def attend(q, k, v):
    return (q @ k.transpose(-1, -2) / 8).softmax(-1) @ v


q = torch.randn(1, 9, 1, 64)
for dynamic, lengths in ((None, range(32, 64)), (False, range(32, 36))):
    fn, before, new_at = torch.compile(attend, dynamic=dynamic), graphs_compiled(), []
    with torch.inference_mode():
        for n in lengths:
            seen = graphs_compiled()
            fn(q, torch.randn(1, 9, n, 64), torch.randn(1, 9, n, 64))
            new_at += [n] if graphs_compiled() > seen else []
    print(f"dynamic={dynamic}: {graphs_compiled() - before} graphs for {len(lengths)} lengths "
          f"(a new graph at lengths {new_at})")

# %% [markdown]
# So default `torch.compile` pays two graphs for a growing cache, not one per position. llmlab
# still compiles with `dynamic=False` over a **static KV cache**, as gpt-fast does: one graph per
# batch bucket, for known sizes, and what CUDA graphs need, since they replay fixed shapes at fixed
# addresses (PyTorch records a new CUDA graph for each size a dynamic graph meets).
#
# - per layer, K and V are allocated once as `[batch, kv_heads, max_len + 1, head_dim]`; position
#   p lives in slot p, and the last slot is a *bin* where padding tokens write and nobody reads;
# - the step writes its new K/V with a scatter at a **tensor** of slots: the position is data in
#   the graph, not a number baked into it;
# - attention reads **all** slots under the mask `slot ≤ position of the query`.
#
# The price, attending over `max_len` slots whatever the length, is why llmlab sizes `max_len` in
# powers of two (`slots_for`); on a CPU, its C++ operator `llmlab::static_attend` stops the loop
# over slots at the query's position, which it reads as data. Your function below is the
# plain-PyTorch version.

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
# Nothing in it may depend on the position as a Python value (no `int(...)`, `.item()` or slice
# ending at the cache's length). The checker tries a padded case, runs SmolLM2's greedy generation
# with your cache, then compiles two layers around it (`fullgraph=True`) for 256 positions: same
# tokens as eager, no new graph after the first.

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
# one graph over a `StaticKVCache` (vLLM's `enforce_eager=False`). The first call of a batch size
# compiles (the *cold start*); Inductor keeps what it built on disk for the next process.
# Compiling all 30 layers takes minutes on a 2-core CPU, so this section compiles SmolLM2's
# embedding, **first 6 layers** and head (`first_layers`, the same weights); `python -m
# llmlab.bench overhead` compiles the whole model.

# %%
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
expect(same and graphs_compiled() == after_first,
       "the compiled generation giving eager's tokens with no graph after the first call")

# %% [markdown]
# ## Measure: what compiling gained, and what the custom kernel gained
#
# On a CPU, `compile=True` does two things. It compiles the step: Inductor generates C++ loops
# for the elementwise work (norms, RoPE, SiLU, adds), and the matmuls stay operator calls. And
# llmlab's graph pass (`llmlab/compile.py`) turns each few-row float32 matmul into
# `llmlab::f32_gemv`, a C kernel that streams the weight once (batch-1 decode is a
# matrix-*vector* product, which a BLAS tuned for big matrices may stream slower). To credit each,
# three steps are timed in the same rounds: **eager**; **compiled** with PyTorch's matmuls
# (`compile=True, gemv=False`); **compiled + f32_gemv**, the step `generate` runs. The batch-8
# eager step rides along for the roofline.

# %%
steps = {"eager": make_decode_step(short, batch=1, context=32),
         "compiled": make_decode_step(short, batch=1, context=32, steps=200, compile=True,
                                      gemv=False),
         "compiled + f32_gemv": make_decode_step(short, batch=1, context=32, steps=200,
                                                 compile=True),
         "eager, batch 8": make_decode_step(short, batch=8, context=32)}
for step in steps.values():
    step()                                   # compiles the graphs (the first one may be cached)
print(f"graphs compiled for these steps: {graphs_compiled() - after_first}")
short_br = step_breakdowns(steps, repeats=9, profiled_repeats=5)
for label, br in short_br.items():
    print(f"{label:20s} {br.ops.total:4d} operator calls, {br.median_s * 1e3:5.1f} ms per step "
          f"({br.min_s * 1e3:.1f}–{br.max_s * 1e3:.1f}); matmuls {br.matmul_s * 1e3:4.1f} ms, "
          f"outside {br.outside_s * 1e3:4.1f} ms")
for label in ("compiled", "compiled + f32_gemv"):
    top = ", ".join(f"{n} ×{k}" for n, k in short_br[label].ops.by_name.most_common(3))
    print(f"{label}: most frequent calls {top}")

# %%
cost1 = decode_cost(short.config, 1, 32, 4)
split = CompileSplit(short_br["eager"], short_br["compiled"], short_br["compiled + f32_gemv"],
                     cost1.bytes)
display(Markdown(split.markdown()))

# %% [markdown]
# ## The steps on the overhead roofline
#
# x: operator calls; y: measured time (median, min–max). Dashed: the memory/compute roof alone
# (this machine's copy bandwidth and matmul peak); solid: roof + ops × t_call (the float32 step's
# own cost per call, above). Hollow markers: the model's prediction per step.

# %%
ceil = measure_ceilings(copy_bytes=128 * 2**20, matmul_n=1024, repeats=5)
omodel = OverheadModel.from_ceilings(ceil, t_call)
batch_of = {"eager": 1, "compiled": 1, "compiled + f32_gemv": 1, "eager, batch 8": 8}
points, gaps = [], {}
for label, br in short_br.items():
    cost = decode_cost(short.config, batch_of[label], 32, 4)
    points.append(OverheadPoint(label.replace(", batch 8", ""), batch_of[label], br.ops.total,
                                cost.bytes, cost.flops, br.median_s, br.min_s, br.max_s))
    gaps[label] = omodel.gap(br, cost.bytes, cost.flops, label)


def signed_ms(seconds: float) -> str:
    return f"{round(seconds * 1e3, 1) + 0.0:+.1f}"   # + 0.0: no "-0.0"


print(f"copy bandwidth {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
      f"matmul peak {ceil.peak_flops_per_s / 1e9:.0f} GFLOP/s, t_call {t_call * 1e6:.2f} µs")
for g in gaps.values():
    print(f"{g.label:20s} measured {g.measured_s * 1e3:5.1f} ms, model {g.modelled_s * 1e3:5.1f} "
          f"ms: gap {signed_ms(g.gap_s):>5s} = inside the matmuls {signed_ms(g.inside_s):>5s} "
          f"+ outside {signed_ms(g.outside_s):>5s}")
plot_overhead_roofline(points, omodel, title="SmolLM2's first 6 layers (model: t_op = t_call)")
plt.show()

# %%
ge, gg = gaps["eager"], gaps["compiled + f32_gemv"]
rate = cost1.bytes / short_br["eager"].matmul_s
spread = max(br.max_s / br.min_s for br in short_br.values())
display(Markdown(
    f"The eager step sits {signed_ms(ge.gap_s)} ms from its model point "
    f"({ge.modelled_s * 1e3:.1f} ms): {signed_ms(ge.inside_s)} ms of that is inside the "
    f"matmuls, which read the step's {cost1.bytes / 1e6:.0f} MB at {rate / 1e9:.1f} GB/s where "
    f"a copy streams {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, and "
    f"{signed_ms(ge.outside_s)} ms is outside them (the 6-layer step's calls against t_call "
    f"of the 30-layer one). The compiled + f32_gemv step sits {signed_ms(gg.gap_s)} ms from "
    f"its model point: {signed_ms(gg.inside_s)} ms inside the matmuls and "
    f"{signed_ms(gg.outside_s)} ms outside, "
    + ("where the graph's own loops (Inductor's fused norms, RoPE, SiLU) and its guard checks "
       "cost time that no operator call counts." if gg.outside_s > 0 else
       "so its remaining calls and loops cost less than t_call per call.")
    + (f" These steps' slowest runs took up to {spread:.1f}× their fastest: the machine was "
       "busy, so rerun the measurement before reading the gaps." if spread > 1.5 else "")))

# ## Play: batch × mode
#
# The widget draws one batch's points on the overhead roofline. `t_op scale` asks *what if each
# operator call cost less* (t_call × scale), for example because a CUDA graph replays the
# launches: the model's lines move, the measured points do not.

# %%
import ipywidgets as widgets


def play(batch: int, t_op_scale: float) -> None:
    explore_overhead(points, omodel, batch=batch, t_op_scale=t_op_scale)
    plt.show()


widgets.interactive(play, batch=widgets.Dropdown(options=[1, 8], value=1),
                    t_op_scale=widgets.FloatSlider(value=1.0, min=0.0, max=2.0, step=0.1))

# %% [markdown]
# The full matrix (float32, int8, int4 × eager, compiled, compiled + fused, batch 1 and 8, beside
# HF transformers and llama.cpp where installed) is `python -m llmlab.bench overhead`; its last
# numbers are in the README's results table, with the machine named.

# %% [markdown]
# ## Fusion by hand
#
# Inductor fuses the small operators automatically. What it cannot do for you is change the
# *computation*: `llmlab.layers.fused.fuse_model` concatenates each layer's q/k/v weights into
# one matrix (one matmul instead of three) and gate/up into one, then takes the results apart in
# fused kernels (`llmlab/kernels/fused.py`: `add_rmsnorm`, `swiglu`, `qkv_rope`). Counted eagerly:

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
# Between attention and the MLP a layer computes `h = x + residual`, then `rmsnorm(h) · weight`:
# unfused, six operators each reading and writing a row. Write the Triton kernel doing it in one
# pass, one program per row: load a row of `X` and `R`, store `H = X + R`, store
# `OUT = H / sqrt(mean(H²) + eps) · W`. Rows are `n_cols` long and contiguous; `BLOCK` is the next
# power of two ≥ `n_cols`, so mask the columns past the row. Without a GPU it runs in Triton's
# interpreter.

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
# ## Predict: CUDA graphs
#
# On a GPU each eager operator is a Python call *and* a kernel launch, while the GPU streams
# SmolLM2's 270 MB of bfloat16 weights in under 0.1 ms. The model below puts an H100's published
# roofs (3.35 TB/s, 989 TFLOP/s bfloat16) beside the eager step's calls at the micro-benchmark's
# t_op, a lower bound on a call's CPU cost (t_call includes small-operator work a GPU would do):
# eager, the step takes the longer of its kernels' roof and its launches (calls × t_op); a CUDA
# graph replays the step's kernels with one launch (10 µs here). A model, not a measurement.
#
# **Predict, then measure.** With the eager step's calls and t_op printed at the top of this
# notebook, and SmolLM2's bfloat16 weights as the bytes of a batch-1 step, what gain (eager time /
# graph time) does the model give at batch 1?

# %%
my_gain = ...  # YOUR PREDICTION: eager / graph step time at batch 1, e.g. 2.0

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
exercises.check("nb11.predict_graph_gain", my_gain, calls=ops.total, t_op=t_op, roof_s=rows[0][1])

# %%
b_hi, roof_hi, eager_hi, graph_hi = rows[-1]
Markdown(f"The launches cost the same {ops.total * t_op * 1e3:.2f} ms at every batch. At batch 1 "
         f"the kernels' roof is {rows[0][1] * 1e3:.3f} ms, so the CPU's launches set the pace and "
         f"a replay removes nearly all of the step; at batch {b_hi} the roof has grown to "
         f"{roof_hi * 1e3:.3f} ms (the KV cache of {b_hi} sequences and the FLOPs of {b_hi} "
         f"tokens), " + ("and the launches hide behind the kernels" if roof_hi >= ops.total * t_op
                         else "still shorter than the launches") +
         f": the modelled gain is {eager_hi / graph_hi:.1f}×.")

# %%
if torch.cuda.is_available():
    gpu = llmlab.load_model("smollm2-135m", attention="sdpa", device="cuda", dtype=torch.bfloat16)
    for b in (1, 8):
        gpu_br = step_breakdowns({
            "eager": make_decode_step(gpu, batch=b, context=32),
            "graph": make_decode_step(gpu, batch=b, context=32, compile=True)}, repeats=9)
        c = compare(gpu_br["eager"].times_s, gpu_br["graph"].times_s, "the eager step",
                    "the CUDA-graph step")
        print(f"{torch.cuda.get_device_name()}, batch {b}: eager "
              f"{gpu_br['eager'].median_s * 1e3:.2f} ms, CUDA graph "
              f"{gpu_br['graph'].median_s * 1e3:.2f} ms per step: {c.sentence()}")
else:
    print("no GPU here: the CUDA-graph step is modelled above, not measured "
          "(on a CUDA machine this cell measures it)")

# %% [markdown]
# ## Takeaways

# %%
graphs_note = ("measured above" if torch.cuda.is_available() else "modelled here, not measured")
display(Markdown(
    f"- A step costs its bytes *and* its calls: {ops.total} eager calls per SmolLM2 step at "
    f"t_call = {t_call * 1e6:.1f} µs each here (a tiny op in a loop: {t_op * 1e6:.2f} µs), "
    f"{f32.outside_share:.0%} of the float32 step, {i8.outside_share:.0%} of the int8 one.\n"
    f"- Credit a compiled step's gain to its causes: {split.takeaway()}.\n"
    "- A compiler removes calls over fixed shapes: default `torch.compile` marks a growing "
    "length dynamic after one recompile, but llmlab's static KV cache keeps one graph per batch "
    "bucket, as CUDA graphs need. Fusion changes the computation; compilation fuses what lies "
    f"between the matmuls; CUDA graphs remove the launches ({graphs_note})."))

# %% [markdown]
# ## Further reading
#
# - Ansel et al. *PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
#   Transformation and Graph Compilation.* ASPLOS 2024.
#   [doi:10.1145/3620665.3640366](https://doi.org/10.1145/3620665.3640366)
# - PyTorch. *Dynamic Shapes* (automatic dynamic shapes, `dynamic=None`):
#   [docs.pytorch.org](https://docs.pytorch.org/docs/stable/torch.compiler_dynamic_shapes.html);
#   *CUDAGraph Trees*: [docs.pytorch.org](https://docs.pytorch.org/docs/stable/torch.compiler_cudagraph_trees.html)
# - PyTorch team. *Accelerating Generative AI with PyTorch II: GPT, Fast.* 2023.
#   [pytorch.org/blog](https://pytorch.org/blog/accelerating-generative-ai-2/);
#   code: [github.com/pytorch-labs/gpt-fast](https://github.com/pytorch-labs/gpt-fast)
# - Fang, Yu, Zhao, Zhou. *TurboTransformers: An Efficient GPU Serving System for Transformer
#   Models.* PPoPP 2021. [arXiv:2010.05680](https://arxiv.org/abs/2010.05680)
# - vLLM's CUDA-graph manager, [docs.vllm.ai](https://docs.vllm.ai/en/v0.13.0/api/vllm/v1/worker/gpu/cudagraph_utils/);
#   *vLLM v0.6.0*, [blog.vllm.ai](https://blog.vllm.ai/2024/09/05/perf-update.html);
#   nano-vllm: [github.com/GeeeekExplorer/nano-vllm](https://github.com/GeeeekExplorer/nano-vllm)
# - NVIDIA. *Getting Started with CUDA Graphs.* 2019.
#   [developer.nvidia.com/blog/cuda-graphs](https://developer.nvidia.com/blog/cuda-graphs/)
# - Williams, Waterman, Patterson. *Roofline.* CACM 52(4), 2009.
#   [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
