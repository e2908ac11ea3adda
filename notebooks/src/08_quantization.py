# %% [markdown]
# # 08 · Quantization: fewer bytes per weight, measured
#
# **Why.** Notebook 02 showed that decoding one token at batch 1 is memory-bound: every weight
# is read once and used for one multiply-add. SmolLM2 in float32 reads about 538 MB per token,
# so the time per token is roughly those bytes over the memory bandwidth. Storing each weight
# in 8 or 4 bits instead of 32 cuts the bytes, and, if the kernel widens the small weights
# inside the matmul, the time.
#
# The price is rounding error, and the papers are about where it hurts:
#
# - **LLM.int8()** (Dettmers, Lewis, Belkada and Zettlemoyer, NeurIPS 2022) found that large
#   models develop *outlier features*: a few hidden dimensions whose activations are far larger
#   than the rest, appearing systematically from about 6.7B parameters. One scale per row or
#   column is then dominated by the outlier. Their fix multiplies those few dimensions in 16-bit
#   and everything else in int8.
# - **GPTQ** (Frantar, Ashkboos, Hoefler and Alistarh, ICLR 2023) quantizes one column at a time
#   and corrects the not-yet-quantized columns for the error just made, using second-order
#   (Hessian) information from a little calibration data; it reaches 3 and 4 bits on models up
#   to 175B parameters in a few GPU hours.
# - **AWQ** (Lin et al., MLSys 2024) observes that a small share of weights, those that meet
#   large activations, matter most, and protects them by scaling their channels before
#   rounding instead of keeping them in higher precision.
# - **llama.cpp** stores blocks of 32 weights with their own scale (types such as Q8_0, Q4_1)
#   and reports each type by its perplexity and KL divergence against the unquantized model.
#   That is how this notebook reports quality too.
#
# SmolLM2 itself ships as a Q4_1 GGUF file: llmlab loads its weights already dequantized to
# float32. In this notebook you **build** group-wise quantization, check that it finds the
# shipped 4-bit grid again, measure what int8 and int4 do to quality and speed, see what
# GPTQ's rounding buys, find where a quantized decode step spends its time (next to
# llama.cpp on the same file), and play with bits × group size.

# %%
import os

import matplotlib.pyplot as plt
import torch
from safetensors import safe_open

import llmlab
from llmlab import exercises, quant
from llmlab.device import describe
from llmlab.models.registry import model_dir
from llmlab.profiling import time_interleaved
from llmlab.profiling.roofline import measure_bandwidth, measure_matmul_flops
from llmlab.quant import eval as qeval

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")

# %% [markdown]
# ## How (1): quantize one matrix by hand
#
# The simplest format is **symmetric int8 with one scale per output row**: the row's largest
# magnitude maps to 127, every weight becomes round(w / s), and w ≈ q · s. Zero stays exactly
# zero, and a weight's error is at most half a step, s / 2.

# %%
# NBVAL_CHECK_OUTPUT
w = torch.tensor([[0.12, -0.50, 0.03, 0.25],
                  [0.01, 0.02, -0.04, 0.90]])
s = w.abs().amax(dim=1, keepdim=True) / 127
q = torch.round(w / s).to(torch.int8)
print("codes q:\n", q)
print("scales s:", s.squeeze(1))
print("w - q·s:\n", (w - q.float() * s))
print(f"max error {((w - q.float() * s).abs() / s).max():.2f} steps (at most 0.5)")

# %% [markdown]
# Row 2 shows the weakness: its 0.90 sets the step, so its small weights (0.01, 0.02) get only
# one or two levels each. One large weight coarsens its whole row. **Group-wise** formats give
# each run of, say, 32 consecutive inputs its own step and offset (w ≈ q · d + m, with m the
# group's minimum and d = its range / (2^bits − 1)), so an outlier stretches only its own
# group. Groups run along the **input** dimension, the one the matmul sums over, so one d and
# one m multiply a whole partial dot product.
#
# GGUF's **Q4_1** is exactly this with 4 bits and groups ("blocks") of 32: per block a float16
# step d, a float16 minimum m, and 32 four-bit codes packed two per byte. Here is one block of
# SmolLM2's weights:

# %%
w_block = model.layers[0].mlp.down_proj.weight[0, :32].detach()
from llmlab.viz.quant import plot_q4_1_block

plot_q4_1_block(w_block)
plt.show()

# %% [markdown]
# Every weight sits **exactly** on one of the 16 levels: these weights were dequantized from a
# Q4_1 file, so each one is m + q·d for its block's d and m.
#
# ## Build: group-wise quantize and dequantize
#
# Write `group_quantize(w, bits, group_size)` for `w [out, in]`, returning
# `(q, d, m)`: codes `q [out, in]` (integers in 0..2^bits − 1), and per group of `group_size`
# consecutive inputs of a row a step `d` and a minimum `m`, both `[out, in / group_size]`;
# and `group_dequantize(q, d, m)` returning `[out, in]`. Use m = the group's minimum,
# d = (max − min) / (2^bits − 1), and round to the nearest code.
#
# The check runs your pair on a small matrix first, then on **all 210 linear layers of
# SmolLM2** (4 bits, groups of 32) and compares the model's next-token distributions and
# greedy answer with float32.

# %%
def group_quantize(w, bits=4, group_size=32):
    # YOUR CODE HERE: reshape to [out, in/group, group], find min and max per group,
    # step d, codes q = round((w - m) / d) clamped to 0..2^bits-1; return q, d, m
    raise NotImplementedError


def group_dequantize(q, d, m):
    # YOUR CODE HERE: q · d + m, with d and m repeated over each group
    raise NotImplementedError


exercises.check("nb08.group_quantize", (group_quantize, group_dequantize))

# %% [markdown]
# ## Check (1): the round trip is exact
#
# Why does a correct Q4_1 quantizer give back the shipped weights bit for bit? In each block
# the smallest weight was stored as code 0, so it *is* m; the largest was code 15, so it is
# m + 15·d (one float32 multiply, one add). Quantizing again, llama.cpp's rule takes
# min → m exactly and (max − min)/15 → d up to a relative error near 1e-7, which rounds back
# to the same float16 d. Each weight's (w − m)/d is then within about 1e-6 of its old integer
# code, so rounding returns that code, and q·d + m is computed the same way as before. The
# same argument fails if the blocks are laid out differently: grouping along the output
# dimension mixes weights from different blocks, which share no grid.

# %%
# NBVAL_CHECK_OUTPUT
names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
         "model.layers.15.self_attn.o_proj.weight", "model.layers.29.mlp.up_proj.weight"]
with safe_open(str(model_dir("smollm2-135m") / "model.safetensors"), "pt") as f:
    for name in names:
        W = f.get_tensor(name)
        exact = (quant.q4_1_dequantize(quant.q4_1_quantize(W)) - W).abs().max().item()
        Wt = W.t().contiguous()
        wrong_layout = (quant.q4_1_dequantize(quant.q4_1_quantize(Wt)) - Wt).abs().max().item()
        print(f"{name[6:]:34s} {tuple(W.shape)}: round trip max |Δ| = {exact:.1e}; "
              f"blocks along the output dim: {wrong_layout:.1e}")

# %% [markdown]
# ## Check (2): what int8 and int4 do to the model
#
# `llmlab.quantize(model, scheme)` returns a new model (the float32 one is untouched) whose
# linear layers store int8 (one scale per row), int4 (groups of 32, float16 step and
# minimum) or Q4_1. The tied embedding / lm_head is a fifth of the float32 bytes and is read
# whole by every decode step; the shipped file keeps it in GGUF's Q8_0 (int8 codes, a float16
# scale per block of 32), and so does `quantize` by default (`lm_head="q8_0"`): exactly the
# file's values, at a quarter of float32's bytes. (4 bits there lose far more than the file did;
# `lm_head="int4"` lets you measure it.)
#
# Which kernel runs matters too. A decode step (a few rows) runs llmlab's C kernels
# (`llmlab.kernels.cpu_gemv`): they read the small codes and widen them in registers, in
# float32, so their answer is the dequantized model's up to the order of the additions. Many
# rows (a prompt, or this evaluation) take one dequantize and a float32 matmul: the same
# numbers. PyTorch also ships packed CPU kernels (`torch._weight_int8pack_mm`,
# `torch.ops.aten._weight_int4pack_mm_for_cpu`), but they take and return bfloat16, which keeps
# 8 significant bits: a logit of 12 comes back up to 0.03 off. The last two rows below run the
# int4 model through them (`quant.use_kernels("torch")`), once as it is and once without
# `quant.RefinedHead` (`exact_top=0`), the wrapper that recomputes the 64 largest logits of
# every position in float32 from the head's exact rows, to show what the rounding costs and
# what the refinement buys back.
#
# The quality measures, over the first tokens of a text written for the workbook
# (`data/text/memory_hierarchy.md`): the KL divergence of the next-token distribution from
# float32's (nats per token), top-1 agreement, perplexity, and greedy answers to chat prompts.

# %%
from llmlab.kernels import cpu_gemv

print(cpu_gemv.describe())
q8 = llmlab.quantize(model, "int8")
q4 = llmlab.quantize(model, "int4", group_size=32)
q4_rough_head = llmlab.quantize(model, "int4", group_size=32, exact_top=0)
ids = qeval.eval_token_ids(tok, 96 if QUICK else 192)
quality = qeval.compare_logits(model, {"int8": q8, "int4": q4}, ids)
with quant.use_kernels("torch"):                    # PyTorch's bfloat16 kernels
    quality.update(qeval.compare_logits(
        model, {"int4, bf16 kernels": q4, "int4, bf16, exact_top=0": q4_rough_head}, ids))
ref_answers = qeval.greedy_answers(model, tok, qeval.CHAT_PROMPTS[:2], max_new_tokens=16)
print(f"over {len(ids) - 1} tokens; fp32 perplexity {quality['int8'].ppl_ref:.2f}")
for name, qm in (("int8", q8), ("int4", q4), ("int4, bf16 kernels", q4),
                 ("int4, bf16, exact_top=0", q4_rough_head)):
    r = quality[name]
    line = (f"{name:23s} {quant.weight_nbytes(qm) / 1e6:4.0f} MB  KLD {r.kld:.1e} nats/token  "
            f"top-1 {r.top1:.1%}  ppl {r.ppl:.2f} ({r.ppl_delta:+.2f})")
    if "bf16" not in name:
        g = qeval.greedy_agreement(ref_answers, qeval.greedy_answers(qm, tok, qeval.CHAT_PROMPTS[:2], 16))
        line += f"  greedy tokens kept {g.fraction:.0%}"
    print(line)

# %% [markdown]
# Read the KLDs with the round trip in mind. The int4 linears reproduce the shipped weights
# exactly (groups of 32 along the inputs, like Q4_1) and the Q8_0 head reproduces the shipped
# table exactly, so the int4 model computed in float32 *is* the float model: its KLD is float32
# rounding (the order of the additions), many orders of magnitude below int8's. Everything the
# two bf16 rows add is the kernels rounding their inputs and outputs to bfloat16; without the
# refined head most of it is the last matmul's: logits are large, and a softmax turns their
# absolute errors into probability errors.
# Greedy answers are fragile: one near-tie flipped early changes every later
# token, which is why KLD and top-1 over a long text are the steadier measures. int8 with **one
# scale per row** is *coarser* than the file's 4-bit blocks wherever a block's range is below
# about 12% of its row's largest weight (15 levels over a small range beat 127 levels over a
# large one): more bits, worse result, because of the group size.
#
# ## Check (3): the same int8 format, rounded with GPTQ
#
# Round-to-nearest treats each weight alone. What we care about is each layer's *output*,
# `X Wᵀ` on the inputs the model really sees, and there the errors of weights that meet
# correlated inputs can cancel. GPTQ (Frantar et al., 2023) keeps the int8 scheme's grid (the
# same scale per row) and picks the codes column by column: after rounding one input column
# it shifts the columns not yet rounded to absorb that error, using H = XᵀX / n, the second
# moment of the layer's inputs over some calibration text. Here that text is prose written
# for the workbook (`data/text/calibration_prose.md`: a story, a how-to, tides, the history of
# the bicycle, a letter, ...), on topics unrelated to the evaluation text;
# `llmlab.quant.gptq` documents the algorithm and its limits.
#
# The cell quantizes with GPTQ on a few hundred calibration tokens (the default is 2,048),
# then compares the two int8 models layer by layer, on the 60 projections
# stored unfused: the weight error, and the output error on the calibration inputs and on
# held-out ones (the evaluation text's).

# %%
calib = quant.calibration_token_ids(tok, 128 if QUICK else 384)
q8_gptq = llmlab.quantize(model, "int8", rounding="gptq", calibration=calib)

names = [f"layers.{i}.{n}" for i in range(len(model.layers))
         for n in ("self_attn.o_proj", "mlp.down_proj")]      # the layers stored unfused


def layer_inputs(token_ids):
    """{layer name: its input X [tokens, in]} over token_ids, from the float model."""
    seen, hooks = {}, []
    for name in names:
        def keep(module, inputs, output, name=name):    # returns None: changes nothing
            seen[name] = inputs[0].reshape(-1, inputs[0].shape[-1])
        hooks.append(model.get_submodule(name).register_forward_hook(keep))
    with torch.inference_mode():
        model(torch.tensor([token_ids]))
    for h in hooks:
        h.remove()
    return seen


x_calib, x_held = layer_inputs(calib), layer_inputs(ids)
for label, qm in (("round to nearest", q8), ("GPTQ", q8_gptq)):
    werr = cerr = herr = 0.0
    for name in names:
        d = model.get_submodule(name).weight.detach() - qm.get_submodule(name).dequantized_weight()
        werr += d.square().sum().item()
        cerr += (x_calib[name] @ d.T).square().mean().item()
        herr += (x_held[name] @ d.T).square().mean().item()
    print(f"{label:16s} over the 60 o/down projections: weight error² {werr:.3f}; output error² "
          f"per token on calibration text {cerr:.3f}, on held-out text {herr:.3f}")
gq = qeval.compare_logits(model, {"GPTQ": q8_gptq}, ids)["GPTQ"]
print(f"int8 KLD over the same {len(ids) - 1} tokens: round to nearest {quality['int8'].kld:.1e}, "
      f"GPTQ {gq.kld:.1e} nats/token (top-1 {quality['int8'].top1:.1%} -> {gq.top1:.1%})")

# %% [markdown]
# Read the three columns in order. GPTQ's weights are *further* from the float32 ones than
# round-to-nearest's: it spends weight error where the inputs do not look. On the calibration
# text, the inputs it was fitted to, the output error nearly vanishes (with fewer calibration
# tokens than a layer has inputs, the fit can be exact). On held-out text it falls far less,
# about by half here, and for some single layers it even rises: like any fit, GPTQ partly
# learns its calibration sample. The model's KLD still improves.
#
# Rounding is one half; the grid is the other. `llmlab.quantize(model, "int8", equalize=True)`
# keeps the format (one scale per output row) but first multiplies each input channel of a
# layer by a scale s chosen from the same calibration statistics, and divides the preceding
# RMSNorm's weight (or v_proj's or up_proj's rows) by it, so the float model is unchanged and
# channels that meet large inputs get finer steps: AWQ's idea, with s chosen per channel by an
# error model (`llmlab.quant.equalize`). With both, on the full 2,048 calibration tokens, over
# the whole evaluation text, `python -m llmlab.bench quant` measured a KLD of 9.2e-4
# nats/token against round-to-nearest's 3.2e-3, at the same decode speed (2-core AMD EPYC VM,
# 2026-12-01). That takes a few minutes, so this notebook leaves it to the benchmark.
#
# ## Predict, then measure
#
# Before the next cell runs: how many times the float32 tokens/s will int4 decode at batch 1
# here? (Weight bytes are printed above; decode is memory-bound.)

# %%
my_int4_speedup = ...  # YOUR ANSWER, e.g. 3.0

# %%
bandwidth = measure_bandwidth()
peak = measure_matmul_flops()
NEW = 8 if QUICK else 16
prompt = [ids[:32]]
schemes = {"fp32": model, "int8": q8, "int4": q4}
runs = {}                          # interleaved: a noisy moment hits every scheme alike
for name, m in schemes.items():
    runs[(name, "decode")] = lambda m=m: llmlab.generate(m, tok, prompt, max_new_tokens=NEW,
                                                         kv_cache="contiguous", ignore_eos=True)
    runs[(name, "prefill")] = lambda m=m: m(torch.tensor([ids[:128]]), last_only=True)
measured = time_interleaved(runs, repeats=5, warmup=1)
timings = {name: {what: measured[(name, what)] for what in ("decode", "prefill")}
           for name in schemes}
for name, t in timings.items():
    d, p = t["decode"], t["prefill"]
    print(f"{name}: decode {NEW / d.median_s:5.1f} tok/s (min-max {NEW / max(d.times_s):.1f}-"
          f"{NEW / min(d.times_s):.1f}), prefill {128 / p.median_s:6.0f} tok/s")
measured_speedup = timings["fp32"]["decode"].median_s / timings["int4"]["decode"].median_s
print(f"int4 decode speedup over fp32: {measured_speedup:.2f}x (median of 5, prompt prefill "
      f"included); the bytes bound is {quant.weight_nbytes(model) / quant.weight_nbytes(q4):.1f}x")
print(f"machine: copy bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul {peak / 1e9:.0f} GFLOP/s")

# %%
exercises.check("nb08.predict_int4_speedup", my_int4_speedup, measured=measured_speedup)

# %% [markdown]
# ## Measure: every scheme on notebook 02's roofline
#
# A token costs 2 FLOPs per parameter. Decode reads every weight byte once per token, so its
# intensity is 2·params / bytes, a few FLOPs per byte: on the sloped, memory-bound part of the
# roof, where fewer bytes move the point right *and* up. Prefill reads the weights once for the
# whole prompt (here 128 tokens), far right, near the compute roof, where fewer bytes change
# little. Error bars: min to max of the five runs.

# %%
from llmlab.viz.quant import plot_scheme_roofline

params = sum(p.numel() for p in model.parameters())
rows = []
for name, m in (("fp32", model), ("int8", q8), ("int4", q4)):
    d, p = timings[name]["decode"], timings[name]["prefill"]
    rows.append({"scheme": name, "params": params, "bytes": quant.weight_nbytes(m),
                 "decode_tok_s": NEW / d.median_s, "prefill_tok_s": 128 / p.median_s,
                 "prefill_tokens": 128,
                 "decode_spread": (NEW / max(d.times_s), NEW / min(d.times_s)),
                 "prefill_spread": (128 / max(p.times_s), 128 / min(p.times_s))})
plot_scheme_roofline(rows, bandwidth, peak)
plt.title(f"measured on {describe()['device']}", fontsize=9)
plt.show()
for r in rows[1:]:
    print(f"{r['scheme']}: decode {r['decode_tok_s'] / rows[0]['decode_tok_s']:.2f}x fp32, "
          f"prefill {r['prefill_tok_s'] / rows[0]['prefill_tok_s']:.2f}x fp32")

# %% [markdown]
# Compare the decode and prefill ratios printed above. Weight-only quantization is meant for
# the memory-bound phase; in the compute-bound one it saves bytes that were not the limit (there
# the quantized model dequantizes each matrix once and runs the float32 matmul: one extra pass
# over the weights, small next to the prompt's FLOPs). `python -m llmlab.bench quant`
# measures every scheme at batch 1 and 8 on the whole evaluation text.
#
# ## Where the time goes, and what llama.cpp does differently
#
# The int4 model reads about a fifth of float32's bytes, yet decodes nowhere near five times
# faster. To see why, time one decode step twice: as it is, and with every linear layer
# replaced by one that returns zeros without reading a weight. The second time is everything
# *outside* the matmuls: norms, RoPE, attention over the cache, and the Python and dispatcher
# work of launching some 60 small operations per layer. The difference is the matmuls, which
# we can compare with their memory roof (weight bytes / copy bandwidth).
#
# llama.cpp, the tool most people reach for on a CPU, runs the same Q4_1 file. Where the
# `llama_cpp` package is installed (`pip install llama-cpp-python`), the cell also times its
# decode on the same prompt and draws its whole step as a dashed line.

# %%
from llmlab.bench.quant import llama_cpp_decode_rate, step_breakdown
from llmlab.viz.quant import plot_step_breakdown

steps = step_breakdown({"fp32": model, "int8": q8, "int4": q4}, ids[:32], bandwidth,
                       steps=6 if QUICK else 12, repeats=1 if QUICK else 3)
lc = llama_cpp_decode_rate(None, ids[:32], NEW, 1 if QUICK else 3, torch.get_num_threads())
lc_ms = None if isinstance(lc, str) else 1000 / lc
plot_step_breakdown(steps, lc_ms)
plt.title(f"one decode step, measured on {describe()['device']}", fontsize=9)
plt.show()
for r in steps:
    print(f"{r['scheme']}: step {r['step ms']:.1f} ms = {r['outside matmuls ms']:.1f} outside the "
          f"matmuls + {r['matmuls ms']:.1f} in them ({r['of copy bw']:.0%} of copy bandwidth; "
          f"roof {r['roof ms']:.1f} ms)")
print(lc if isinstance(lc, str) else f"llama.cpp Q4_1: {lc_ms:.1f} ms a step ({lc:.0f} tok/s)")

# %% [markdown]
# Two things separate the int4 step from its roof. First, the time outside the matmuls is the
# same for every scheme and is now a large share of a quantized step: quantization shrinks
# only the matmuls, so the rest caps the speedup (Amdahl's law). Second, the matrix–vector
# kernels read their small weights below the copy bandwidth (the percentages above): each call
# is a short product over a matrix of 0.3-2 MB, and widening a 4-bit code to float32 takes
# several vector instructions per 8 weights. llama.cpp removes both: it builds the whole forward as one
# graph of C kernels, so there is no per-operation Python, and its CPU kernels for Q4_1 use the
# vector units' integer dot products: the activations are rounded to 8-bit blocks first, so one
# AVX2 instruction multiplies 32 pairs of bytes and sums them in pairs, where llmlab's kernels,
# which keep the activations in float32 (exact, as the KLDs above show), first widen every
# code to a float.
# On a GPU the same two costs are what CUDA graphs and fused dequantize-in-GEMM kernels
# (`llmlab.kernels.quant_gemm`) remove.
#
# ## Play: bits × group size
#
# The grid below simulates the group-wise format at each setting on every linear layer
# (dequantized weights in float32, no kernel) and measures the KLD against float32 on a short
# window of the text. The widget shows the weight bytes, the KLD and the decode tokens/s that
# the measured bandwidth would allow at those bytes: a **model** (bytes / bandwidth), not a
# measurement. "one per row" is a single group per output row.

# %%
grid = qeval.sweep_bits_group(model, ids[:48 if QUICK else 64], bits_list=(3, 4, 8),
                              groups=(32, None))
for (b, g), v in grid.items():
    print(f"{b} bits, {'row' if g is None else g:>3}: {v['bytes'] / 1e6:5.0f} MB, "
          f"KLD {v['kld']:.1e}, top-1 {v['top1']:.0%}")

# %%
import ipywidgets as widgets
from llmlab.viz.quant import explore_bits_group

widgets.interactive(lambda bits=4, group_size=32: explore_bits_group(grid, bits, group_size,
                                                                     bandwidth).figure,
                    bits=widgets.SelectionSlider(options=[3, 4, 8], value=4, description="bits"),
                    group_size=widgets.Dropdown(options=[("32", 32), ("one per row", None)],
                                                value=32, description="group"))

# %%
choice = explore_bits_group(grid, 4, None, bandwidth, draw=False)
per_group = explore_bits_group(grid, 4, 32, bandwidth, draw=False)
print(f"4-bit, one scale per row: KLD {choice.kld:.1e}; groups of 32: {per_group.kld:.1e} "
      f"for {(per_group.weight_bytes / choice.weight_bytes - 1):.0%} more bytes")

# %% [markdown]
# ## Explain
#
# Why does 4-bit with groups of 32 beat 4-bit with one scale per row?
#
# - (a) smaller groups use fewer bits per weight
# - (b) a group's step is set by its own range, so an outlier weight coarsens only its own group
# - (c) rounding to nearest is only correct for small groups
# - (d) the matmul runs faster with small groups

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb08.explain_group_size", answer)

# %% [markdown]
# ## Stretch: the cost of a Q4_1 block
#
# How many bytes per weight does Q4_1 store, counting everything in a block?

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: bytes per weight
exercises.check("nb08.q4_1_bytes_per_weight", answer)

# %% [markdown]
# ## Takeaways
#
# - Batch-1 decode in float32 is memory-bound, so fewer weight bytes speed it up; prefill is compute-bound and barely moves.
# - Once the bytes shrink, the rest of the step (Python, small ops, attention) and the kernels' efficiency set the speed: the int4 speedup measured above is well below its bytes ratio.
# - Where the scales sit matters as much as the bits: groups of 32 along the input dimension beat one scale per row.
# - Rounding can be smarter than nearest: GPTQ keeps the format and lowers each layer's output error, far more on its calibration text than on other text.
# - Measure quality as llama.cpp does (KLD, top-1, perplexity, greedy tokens) against the float model, on a fixed text.
#
# ## Further reading
#
# - Dettmers, Lewis, Belkada, Zettlemoyer. *LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale.* NeurIPS 2022. [arXiv:2208.07339](https://arxiv.org/abs/2208.07339)
# - Frantar, Ashkboos, Hoefler, Alistarh. *GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers.* ICLR 2023. [arXiv:2210.17323](https://arxiv.org/abs/2210.17323)
# - Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han. *AWQ: Activation-aware Weight Quantization for On-Device LLM Compression and Acceleration.* MLSys 2024. [arXiv:2306.00978](https://arxiv.org/abs/2306.00978)
# - llama.cpp (its quantization types and the `perplexity` tool's KL-divergence mode): [github.com/ggml-org/llama.cpp](https://github.com/ggml-org/llama.cpp); the GGUF format: [ggml/docs/gguf.md](https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
