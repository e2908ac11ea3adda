# %% [markdown]
# # 01 · The baseline, and where the time goes
#
# **Why.** A decoder-only language model writes one token at a time (Vaswani et al., 2017;
# Touvron et al., 2023): the next token is predicted from everything written so far, appended, and
# the model is asked again. The textbook loop runs the model over the *whole* sequence at every
# step, so when the input grows from "the dog" to "the dog sat", the work done for "the dog" is done
# again — the redundancy the KV cache of notebook 02 removes.
#
# Users feel two latencies (the serving literature, e.g. Zhong et al., 2024, uses them as service
# objectives): **TTFT**, the time to the first token, spent reading the prompt (*prefill*), and
# **TPOT**, the time per output token after it (*decode*); a reply of n tokens takes about
# TTFT + TPOT · (n − 1).
#
# This notebook measures the baseline honestly — every timing is the median of at least five runs
# after a warm-up, with the spread drawn — and has you write its attention.

# %%
import os

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.device import device_name

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
model = llmlab.load_model("smollm2-135m", attention="naive")
tok = llmlab.load_tokenizer("smollm2-135m")
cfg = model.config
print(device_name())

# %% [markdown]
# ## How: the decode loop, token by token
#
# Without a cache, generation is this loop (a teaching sketch of what `llmlab.generate` does with
# `kv_cache="none"`; the real one also batches, samples and stops at the end-of-sequence token):
#
# ```python
# ids = prompt_ids                                  # [1, P]
# for step in range(max_new_tokens):
#     logits = model(ids)[:, -1]                    # the WHOLE sequence, every step
#     next_id = logits.argmax(-1)                   # greedy
#     ids = torch.cat([ids, next_id[:, None]], 1)   # [1, P + step + 1]
# ```

# %%
# NBVAL_CHECK_OUTPUT
out = llmlab.generate(model, tok, "Explain in two sentences why the sky is blue.",
                      max_new_tokens=8 if QUICK else 16)
print(out.text[:80], "...")
print("prompt tokens:", len(out.prompt_token_ids), "| generated:", len(out.token_ids))

# %% [markdown]
# ## Measure: one step, as the sequence grows
#
# Step t of that loop is one forward pass over P + t tokens. Here is one such step timed at several
# lengths (median of 5 runs, the band is the min–max range), with a straight line fitted to it:
# time ≈ a + b · L, a fixed part a paid by every step and a part b per token in the sequence.

# %%
from llmlab.profiling import fit_linear
from llmlab.viz.baseline import forward_step_times, plot_step_times

lengths = [8, 24, 48] if QUICK else [8, 24, 48, 96]
steps = forward_step_times(model, lengths, repeats=5)
ax = plot_step_times([steps], title=f"one no-cache step = a forward over the whole sequence "
                                    f"({device_name()})")
step_fit = fit_linear(lengths, [s.median_s * 1e3 for s in steps])
a, b = step_fit.a, step_fit.b
ax.plot(lengths, [a + b * n for n in lengths], "k:", label=f"fit: {a:.0f} ms + {b:.2f} ms/token")
ax.legend(fontsize=8)
plt.show()
for s in steps:
    print(f"{s.n:4d} tokens: {s.median_s * 1e3:7.1f} ms (min {s.lo_s * 1e3:.1f}, max {s.hi_s * 1e3:.1f})")
print(f"least-squares fit over all {step_fit.n} lengths: {a:.1f} ms + {b:.3f} ms per token in the "
      f"sequence, rms residual {step_fit.rms:.1f} ms")

# %% [markdown]
# Is such a step limited by reading the 135M weights from memory, or by the arithmetic? The
# **roofline** (Williams et al., 2009; notebook 02 builds it) answers with two numbers measured on
# this machine — how fast it streams memory and how fast it multiplies — and one number per step,
# its **arithmetic intensity**: FLOPs done per byte moved. Below the *ridge point* (peak FLOP/s ÷
# bandwidth) a step waits for memory; above it, for arithmetic. `forward_cost` is the analytic
# model of a forward (the bytes of its weights and activations, logits for the last token).
#
# **Predict, then count.** Before the model's numbers are printed: by what factor is the
# arithmetic intensity of a no-cache step over L = 96 tokens larger than that of a step over
# L = 8? Commit a number.

# %%
my_growth = ...  # YOUR ANSWER: a number (the factor)

# %%
from llmlab.profiling.roofline import forward_cost, measure_ceilings

growth = forward_cost(cfg, 1, 96).intensity / forward_cost(cfg, 1, 8).intensity
exercises.check("nb01.predict_intensity_growth", my_growth, measured=growth)

# %%
ceil = measure_ceilings(copy_bytes=64 * 2**20, matmul_n=512, repeats=5)
print(f"{ceil.device}: copy {ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s, matmul "
      f"{ceil.peak_flops_per_s / 1e9:.0f} GFLOP/s, ridge point {ceil.ridge_point:.1f} FLOP/byte")
for s in steps:
    cost = forward_cost(cfg, 1, s.n)
    bound = "compute" if cost.intensity >= ceil.ridge_point else "memory"
    print(f"{s.n:4d} tokens: {cost.intensity:6.1f} FLOP/byte ({bound}-bound), "
          f"achieved {cost.flops / s.median_s / 1e9:5.1f} GFLOP/s")
first = next((s.n for s in steps if forward_cost(cfg, 1, s.n).intensity >= ceil.ridge_point), None)
print("shortest measured length past the ridge point:", first)

# %%
from llmlab.profiling import weight_bytes

intensity = [forward_cost(cfg, 1, n).intensity for n in lengths]
per_weight_byte = [forward_cost(cfg, 1, n).flops / weight_bytes(cfg) for n in lengths]
i_fit = fit_linear(lengths, intensity)
emb_share = cfg.vocab_size * cfg.hidden_size * 4 / weight_bytes(cfg)
display(Markdown(
    f"The intensity grows about linearly with L: a line fitted over all {i_fit.n} lengths gives "
    f"{i_fit.a:.1f} + {i_fit.b:.3f}·L FLOP/byte (rms residual {i_fit.rms:.2f} FLOP/byte), so each "
    f"extra token adds about 1/{1 / i_fit.b:.1f} FLOP per byte. Per length, L divided by the "
    "intensity is "
    + ", ".join(f"{n / x:.1f}" for n, x in zip(lengths, intensity))
    + f" at L = {', '.join(map(str, lengths))}."))

# %%
Markdown(
    "So a long enough step crosses this machine's ridge point, from memory-bound to "
    "compute-bound (the intensity is a model: it depends only on the shapes). "
    f"Counting only the weights' bytes, the same FLOPs give L/{lengths[0] / per_weight_byte[0]:.1f} "
    f"to L/{lengths[-1] / per_weight_byte[-1]:.1f} FLOP per byte: a weight in a decoder layer is "
    "read once per forward and does 2 FLOPs per token (a multiply and an add) for its 4 bytes, "
    f"which alone would be L/2, and the embedding table ({emb_share:.0%} of the weight bytes) is "
    "read for the last token's logits only. The activations' bytes also grow with L, so the full "
    "intensity falls a little further below the weights-only line as L grows.")

# %% [markdown]
# ## Measure: what the fixed part a is
#
# Extrapolated to zero tokens, the fit still costs a milliseconds: that is what one step pays
# whatever its length. Two things do not depend on L. The weights are streamed from memory once
# per step (the memory roof: their bytes over the copy bandwidth measured above). And every step
# makes the same operator calls from Python, each paying the interpreter, PyTorch's dispatcher and
# an allocation whatever its size. `llmlab.profiling.overhead` measures both on a step over one
# token: `count_ops` counts the operator calls, `measure_op_overhead` times one tiny operator
# (t_op), and `step_breakdown` splits the step's wall time into the time inside the matrix
# multiplies and everything outside them (median of 7 runs; the split comes from profiled runs).

# %%
from llmlab.profiling.overhead import count_ops, measure_op_overhead, step_breakdown

one_token = torch.randint(0, cfg.vocab_size, (1, 1), generator=torch.Generator().manual_seed(0))


@torch.inference_mode()
def one_token_step():
    return model(one_token, last_only=True)


ops = count_ops(one_token_step)
t_op = measure_op_overhead()
split = step_breakdown(one_token_step, repeats=7)
roof = forward_cost(cfg, 1, 1).bytes / ceil.bandwidth_bytes_per_s
print(f"a step over 1 token: {split.median_s * 1e3:.1f} ms (min {split.min_s * 1e3:.1f}, "
      f"max {split.max_s * 1e3:.1f}); the fit's intercept a = {a:.1f} ms")
print(f"  inside the {ops.matmul_calls} matrix multiplies: {split.matmul_s * 1e3:.1f} ms "
      f"(memory roof for the {forward_cost(cfg, 1, 1).bytes / 1e6:.0f} MB of weights: {roof * 1e3:.1f} ms)")
print(f"  outside them: {split.outside_s * 1e3:.1f} ms ({split.outside_share:.0%} of the step), over "
      f"{ops.total} operator calls = {split.outside_per_op_s * 1e6:.1f} µs per call")
print(f"  of which bare dispatch, {ops.total} calls × t_op {t_op * 1e6:.2f} µs: {ops.total * t_op * 1e3:.1f} ms")
if split.outside_s < 0:
    print("(the profiled runs were slower than the timed ones: the machine was busy; run it again)")

# %%
inside = split.matmul_s / split.median_s
display(Markdown(
    f"So on this run the fixed part of a step is {split.median_s * 1e3:.0f} ms "
    f"(the fit's intercept says {a:.0f} ms): "
    + (f"mostly the matrix multiplies ({inside:.0%}), which stream the weights at "
       f"{forward_cost(cfg, 1, 1).bytes / split.matmul_s / 1e9:.1f} GB/s against the "
       f"{ceil.bandwidth_bytes_per_s / 1e9:.1f} GB/s of a plain copy"
       if inside >= 0.5 else
       f"mostly outside the matrix multiplies ({1 - inside:.0%}): per-step Python and dispatch "
       f"overhead, and the small operators")
    + f". The overhead outside them is {split.outside_s * 1e3:.0f} ms per step, "
    f"{ops.total * t_op * 1e3:.1f} ms of it the bare cost of {ops.total} operator calls. "
    f"What grows with L is the part per token ({b:.2f} ms): every step redoes all the tokens "
    "before it (exercise 1 at the end counts the token-passes of a whole generation)."
    + ("" if abs(a - split.median_s * 1e3) <= max(2 * step_fit.rms, (split.max_s - split.min_s) * 1e3)
       else f" The line fitted over L = {lengths[0]}…{lengths[-1]} misses the one-token step by "
       f"{abs(a - split.median_s * 1e3):.0f} ms, more than its residual: "
       + ("with one row the matrix library multiplies by its matrix–vector routine, which reads "
          "the weights faster than the routine it takes for several rows (notebook 02's batch "
          "sweep measures the switch), so a step's fixed part depends on how many rows it has."
          if a > split.median_s * 1e3 else
          "a step over one token costs more than the lengths measured predict, so the line "
          "does not extend below them."))))

# %% [markdown]
# Notebook 11 (overhead and compilation) goes after the part outside the matrix multiplies:
# `llmlab.generate(..., compile=True)` runs a decode step through `torch.compile`, which fuses the
# small operators and calls Python once per step instead of once per operator.
#
# ## Measure: a profile by operator
#
# `torch.profiler` records every ATen operator. One forward pass over a 64-token prompt, profiled
# five times; the median self time per operator, with the range:

# %%
from llmlab.viz.baseline import operator_medians

ids = torch.randint(0, cfg.vocab_size, (1, 64))
with torch.inference_mode():
    op_rows = operator_medians(lambda: model(ids), repeats=5, row_limit=8)
for r in op_rows:
    print(f"{r['name']:28s} {r['median_ms']:8.1f} ms  ({r['lo_ms']:.1f}–{r['hi_ms']:.1f})  x{r['calls']}")
from llmlab.profiling.overhead import is_matmul

mm_share = (sum(r["median_ms"] for r in op_rows if is_matmul(r["name"]))
            / sum(r["median_ms"] for r in op_rows))
display(Markdown(
    f"Matrix multiplies (`aten::mm`, `aten::bmm`/`matmul` inside attention) take {mm_share:.0%} of "
    f"the time of these {len(op_rows)} operators"
    + (", the bulk of it" if mm_share >= 0.5 else ", less than the rest")
    + "; the rest is elementwise work (softmax, SiLU, RMSNorm, rotary) that notebook 11 fuses."))

# %% [markdown]
#
# ## Measure: by part of the model, as the prompt grows
#
# Hooks on the attention, MLP, norm and lm_head modules add up where one forward pass spends its
# time (median of 5 runs per part; right: the whole forward, median and range).

# %%
from llmlab.viz.baseline import PARTS, parts_by_length, plot_parts

part_lengths = [32, 256] if QUICK else [32, 128, 512]
parts = parts_by_length(model, part_lengths, repeats=5)
fig = plot_parts(parts)
plt.show()
for n, p in parts.items():
    total = sum(p[k] for k in PARTS)
    print(f"N={n:4d}: {total * 1e3:6.0f} ms, attention {p['attention'] / total:4.0%}, "
          f"mlp {p['mlp'] / total:4.0%}, lm_head {p['lm_head'] / total:4.0%}")
lo, hi = part_lengths[0], part_lengths[-1]
grow = {k: parts[hi][k] / parts[lo][k] for k in ("mlp", "attention")}
share = {n: parts[n]["attention"] / sum(parts[n][k] for k in PARTS) for n in (lo, hi)}
print(f"from N={lo} to N={hi} ({hi // lo}× the tokens): mlp time ×{grow['mlp']:.1f}, "
      f"attention time ×{grow['attention']:.1f}")

# %%
k_tokens = hi // lo
display(Markdown(
    f"The MLP does the same work per token, yet from N = {lo} to {hi} ({k_tokens}× the tokens) its "
    f"time grew ×{grow['mlp']:.1f}: "
    + ("less than the tokens, because at short lengths much of its time is the fixed cost of "
       "streaming its weights (the intercept above), which does not grow with N."
       if grow["mlp"] < 0.8 * k_tokens else "about as much as the tokens."
       if grow["mlp"] <= 1.25 * k_tokens else
       "more than the tokens, which its work does not explain: another process probably shared "
       "the cores during this measurement, so rerun the cell.")
    + f" Attention has four such projections plus the N × N score matrix; its time grew "
    f"×{grow['attention']:.1f}, "
    + ("faster than the MLP's, and its share of the forward went from "
       if grow["attention"] > grow["mlp"] else "no faster than the MLP's here; its share went from ")
    + f"{share[lo]:.0%} to {share[hi]:.0%}. The N² part takes over only at long contexts, which "
    "the next measurement isolates. `lm_head` runs on every position here (a forward that "
    "returns all logits); generation needs only the last one."))

# %% [markdown]
#
# ## Measure: the N² of textbook attention
#
# `naive` attention builds the full `[batch, heads, N, N]` score matrix; `sdpa` is PyTorch's fused
# kernel. SmolLM2's shape: 9 query heads, 3 KV heads, head_dim 64, batch 1, causal.
#
# **Predict first:** by what factor does naive attention's *peak memory* grow when N doubles from
# 1024 to 2048? Write a number.

# %%
my_prediction = ...   # YOUR ANSWER: a factor, e.g. 1.5

# %% [markdown]
# **Compute first:** how many bytes does one float32 score matrix take for SmolLM2 (9 heads) at
# N = 8192, batch 1?

# %%
answer = ...  # YOUR ANSWER: an int
exercises.check("nb01.score_bytes", answer)

# %% [markdown]
# The measurement: one causal attention call per length, five timed runs each after a warm-up,
# and the most memory the call held at once. A power law y ∝ N^k is fitted where the N × N term
# leads: at the lengths where one score matrix is at least a third of naive's peak memory.

# %%
from llmlab.profiling import fit_power
from llmlab.viz.baseline import attention_cost, plot_attention_cost

ns = [128, 256, 512, 1024, 2048]
cost = [attention_cost(n, backend=b, repeats=5) for b in ("naive", "sdpa") for n in ns]
fig = plot_attention_cost(cost, title=f"one causal attention call, 9 heads, d=64 ({device_name()})")
plt.show()
rows = {b: [r for r in cost if r["backend"] == b] for b in ("naive", "sdpa")}
regime = [r["n"] for r in rows["naive"] if r["score_bytes"] >= r["peak_bytes"] / 3]
fits = {}
for backend, rs in rows.items():
    rs_in = [r for r in rs if r["n"] in regime]
    fits[backend] = {k: fit_power(regime, [r[k] for r in rs_in]) for k in ("seconds", "peak_bytes")}
    mem, t = fits[backend]["peak_bytes"], fits[backend]["seconds"]
    doubling = ", ".join(f"×{b['seconds'] / a['seconds']:.1f}" for a, b in zip(rs_in, rs_in[1:]))
    print(f"{backend:6s}: peak memory ∝ N^{mem.exponent:.2f} (rms residual {mem.rms:.0%}); "
          f"time ∝ N^{t.exponent:.2f} (rms residual {t.rms:.0%}; per doubling of N {doubling}); "
          f"at N = {ns[-1]}: {rs[-1]['seconds'] * 1e3:.1f} ms, peak {rs[-1]['peak_bytes'] / 2**20:.0f} MiB")
print(f"fits over the {len(regime)} lengths N = {', '.join(map(str, regime))}, where one score "
      "matrix is at least a third of naive's peak")
if any(f["seconds"].rms > 0.15 for f in fits.values()):
    print("a residual above 15% means one power law does not describe the time over these "
          "lengths: the growth per doubling shows where it bends")
print(f"one [1, 9, N, N] float32 score matrix at N = {ns[-1]}: {rows['naive'][-1]['score_bytes'] / 2**20:.0f} MiB "
      "(compare with your count at N = 8192)")

# %%
naive_peak = {r["n"]: r["peak_bytes"] for r in cost if r["backend"] == "naive"}
exercises.check("nb01.predict_memory_growth", my_prediction, measured=naive_peak[2048] / naive_peak[1024])

# %%
exp_mem = {b: fits[b]["peak_bytes"].exponent for b in ("naive", "sdpa")}
peak_at = {b: rows[b][-1]["peak_bytes"] for b in ("naive", "sdpa")}
display(Markdown(
    f"Over N = {regime[0]}…{regime[-1]}, naive attention's peak memory grows as N^{exp_mem['naive']:.2f}"
    + (", close to the N² of its score matrix: the scores and their softmax are the largest "
       "tensors of the call." if exp_mem["naive"] > 1.7 else
       ", short of N² at these sizes: the inputs and outputs still weigh in.")
    + f" `sdpa` grows as N^{exp_mem['sdpa']:.2f} and needs "
    f"{peak_at['naive'] / peak_at['sdpa']:.0f}× less at N = {ns[-1]}: PyTorch's fused kernel does "
    "not keep the matrix either. That matrix is what FlashAttention (notebook 03) never writes out."))

# %% [markdown]
#
# ## Build: naive attention, inside the real model
#
# Write the textbook formula, softmax(Q Kᵀ / √d + mask) · V, softmax included, for the shapes
# SmolLM2 uses:
#
# - `q` is `[batch, heads, n_q, d]`, `k` and `v` are `[batch, kv_heads, n_k, d]`, with
#   `heads = 9`, `kv_heads = 3` in SmolLM2 (**grouped-query attention**): each KV head serves a
#   contiguous group of `heads // kv_heads` query heads.
# - `causal=True` masks the future, **aligned bottom-right**: the n_q queries are the *last* n_q
#   positions of the n_k keys, so when n_q < n_k (a prompt continued, or one decode query) every
#   query still sees all the keys before it.
# - The softmax is yours, from `exp`, `amax` and `sum` (torch's softmax and fused attention, and
#   llmlab's attention functions, raise during the check). It must hold for scores as large as
#   ±100: float32's `exp` overflows to inf past 88.7, and softmax(s) = softmax(s − c) for any
#   constant c per row.
# - Return `[batch, heads, n_q, d]`.
#
# The check first tests small tensors (including n_q < n_k, grouped heads and large scores), then
# registers your function as an attention backend with `llmlab.attention.register` and runs
# SmolLM2 with it: the logits must be within 1e-4 of `naive`'s and the greedy tokens identical.

# %%
import math


def naive_attention(q, k, v, causal=True):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb01.naive_attention", naive_attention)

# %% [markdown]
# **Compare with llmlab's.** The library's `naive` backend (`llmlab/attention/reference.py`) does
# the same with torch's softmax, which subtracts the row maximum inside, and two differences worth
# knowing. Its tensors are `[batch, seq, heads, d]`, the layout
# of FlashAttention's API, so it transposes first. And it fills masked scores with the most
# negative *finite* float rather than `-inf`, and runs the softmax in at least float32:
#
# ```python
# scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
# probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
# ```
#
# With a padding mask a query can have *every* key masked; `-inf` everywhere makes its softmax
# 0/0 = NaN, which then leaks into the next layer. (The stretch exercise below runs into this.)
#
# ## Check: naive and sdpa give the same answer

# %%
# NBVAL_CHECK_OUTPUT
prompt = tok("The three laws of thermodynamics are", return_tensors="pt")["input_ids"]
planets = "The three planets closest to the sun are"
with torch.inference_mode():
    ref = model(prompt)
    model.set_attention("sdpa")
    new = model(prompt)
    fast = llmlab.generate(model, tok, planets, max_new_tokens=8, chat=False)
    model.set_attention("naive")
    base = llmlab.generate(model, tok, planets, max_new_tokens=8, chat=False)
err = (new - ref).abs().max().item()
print(f"max |Δ logits| = {err:.1e}, below 1e-4: {err < 1e-4}")
print("same greedy tokens:", fast.token_ids == base.token_ids, base.token_ids)

# %% [markdown]
# ## Play: one attention call at your N
#
# Pick N and a backend; the bar chart compares the size of one score matrix with the peak memory
# actually measured for the call (a `TorchDispatchMode` counts every tensor the call allocates).

# %%
import ipywidgets as widgets

from llmlab.viz.baseline import explore_attention

widgets.interactive(lambda n=512, backend="naive": explore_attention(n, backend),
                    n=widgets.IntSlider(value=512, min=64, max=2048, step=64),
                    backend=["naive", "sdpa"])

# %%
fig, r = explore_attention(1024, "naive")

# %% [markdown]
# ## Exercises
#
# **1.** With no KV cache, how many token-passes does generating `T = 100` tokens after a `P = 30`
# token prompt cost? (Step t, from 0, runs the model over P + t tokens.)

# %%
answer = ...  # YOUR ANSWER: an int
exercises.check("nb01.token_passes", answer)

# %% [markdown]
# **2. Stretch: padding.** A batch of prompts of different lengths is *left-padded* to one length,
# and the attention must ignore the padding keys. Write `padded_attention(q, k, v,
# key_padding_mask, causal=True)` with `key_padding_mask` `[batch, n_k]` bool, True for real
# tokens, combined with the causal mask. A padding *query* at the start of a row has every key
# masked: its output is not used, but it must not be NaN. The check runs SmolLM2 on a left-padded
# batch of two prompts with it.

# %%
def padded_attention(q, k, v, key_padding_mask, causal=True):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb01.padded_attention", padded_attention)

# %% [markdown]
# ## Takeaways
#
# - The baseline recomputes the whole sequence each step: quadratic work for linear output. A step costs a fixed part (the weights streamed once, plus per-step overhead) and a part per token.
# - A no-cache step's FLOPs per byte grow about in proportion to L (SmolLM2's shapes give L/2.5 at 8 tokens and L/3.1 at 96): short steps wait on memory, long ones on arithmetic; the measured ridge point says where on this machine.
# - Attention's N² score matrix makes its share grow with N and limits long contexts; swapping `naive` for `sdpa` (or your own attention) changes speed and memory, not the answer.
#
# ## Further reading
#
# - Vaswani et al. *Attention Is All You Need.* NeurIPS 2017. [arXiv:1706.03762](https://arxiv.org/abs/1706.03762)
# - Touvron et al. *LLaMA: Open and Efficient Foundation Language Models.* 2023. [arXiv:2302.13971](https://arxiv.org/abs/2302.13971)
# - Ainslie et al. *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints.* EMNLP 2023. [arXiv:2305.13245](https://arxiv.org/abs/2305.13245)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
# - Zhong et al. *DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving* (TTFT and TPOT). OSDI 2024. [arXiv:2401.09670](https://arxiv.org/abs/2401.09670)
# - Dao et al. *FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness.* NeurIPS 2022. [arXiv:2205.14135](https://arxiv.org/abs/2205.14135)
# - All references of the workbook: [REFERENCES.md](REFERENCES.md)
