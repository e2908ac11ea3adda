# %% [markdown]
# # 06 · Mixture of experts: routing, dispatch, and what sparsity buys
#
# **Why.** A mixture-of-experts (MoE) layer replaces one feed-forward network by many
# *experts* and a small *router* that sends each token to only a few of them. Shazeer et al.
# (ICLR 2017) introduced the sparsely-gated layer; GShard (Lepikhin et al., 2020) and the
# Switch Transformer (Fedus, Zoph and Shazeer, JMLR 2022) scaled it inside Transformers, with
# top-2 and top-1 routing, a per-expert *capacity* and an auxiliary load-balancing loss.
# **Mixtral 8x7B** (Jiang et al., 2024) is an open MoE decoder: every layer holds 8 SwiGLU
# experts, and the router picks **2 of the 8** for each token. A token can therefore reach
# about **47B parameters but uses about 13B**: capacity grows while the compute per token stays
# that of a much smaller model. The paper reports Mixtral matching or beating Llama 2 70B on
# most benchmarks while using about 5× fewer active parameters (13B against 70B).
#
# Sparsity only pays if the code exploits it. In this notebook you **write** Mixtral's routing
# and a grouped dispatch (sort tokens by expert, one matrix multiply per expert), and run them
# inside two real MoE models. Then you compare three ways of running the experts (`dense`,
# `loop`, `grouped`) against HF transformers, upcycle SmolLM2-135M into an 8-expert MoE, look at
# what an untrained router does, and measure what sparsity saves here (and model it on a GPU).

# %%
import os

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch

import llmlab
from llmlab import exercises
from llmlab.device import TRITON_MISSING, describe, device_name, has_triton
from llmlab.layers import moe_stats as S
from llmlab.profiling import expect, fit_power
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")

# %% [markdown]
# ## Why, in numbers: total against active parameters
#
# `compute_account` counts parameters and FLOPs per token (an analytic model: 2 FLOPs per
# multiply-add, attention at context 0). For Mixtral 8x7B's published configuration it should
# land on the paper's 47B and 13B.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.viz.moe import plot_compute_accounts

dense_cfg = llmlab.ModelConfig.from_file(llmlab.models.resolve("smollm2-135m"))
moe_cfg = llmlab.ModelConfig(**{**dense_cfg.to_dict(), "num_experts": 8, "num_experts_per_tok": 2,
                                "model_type": "mixtral"})
accounts = [S.compute_account(dense_cfg, "smollm2-135m"),
            S.compute_account(moe_cfg, "smollm2-135m-moe8"),
            S.compute_account(S.MIXTRAL_8X7B, "Mixtral 8x7B")]
for a in accounts:
    print(f"{a.name:18s} total {a.total_params / 1e9:6.2f}B  active {a.active_params / 1e9:6.2f}B "
          f"({a.active_fraction:4.0%})  GFLOP/token {a.flops_per_token / 1e9:6.2f} "
          f"(all experts: {a.flops_per_token_all_experts / 1e9:6.2f})")
print(f"the Mixtral paper: {S.MIXTRAL_PAPER_TOTAL_PARAMS / 1e9:.0f}B total, "
      f"{S.MIXTRAL_PAPER_ACTIVE_PARAMS / 1e9:.0f}B active")

# %%
fig = plot_compute_accounts(accounts)

# %% [markdown]
# Attention, embeddings and norms are shared by all experts, which is why Mixtral is "8x7B" but
# 47B, not 56B. Running every expert on every token would cost 3.7× the FLOPs of top-2 (the
# last column above).
#
# ## How: routing
#
# The router is one linear layer, `gate` of shape [experts, hidden]: for each token it gives one
# logit per expert. Mixtral turns the logits into probabilities with a softmax, keeps the
# **top-k** experts (k = 2), and **renormalizes** those k weights so that they sum to one. The
# layer's output for a token is the weighted sum of its k experts' outputs.
#
# ## How: three ways to run the chosen experts
#
# * **dense** runs all E experts on all tokens and multiplies the unchosen ones by zero:
#   correct, and E/k times the work.
# * **loop** asks, for each expert, "which tokens chose you?" (`torch.where`), gathers them,
#   runs the expert, and adds the weighted result back.
# * **grouped** sorts the (token, expert) pairs by expert once. Each expert's rows then form one
#   contiguous slice, so one matrix multiply per projection and expert covers them (on a GPU,
#   one *grouped GEMM* kernel covers every expert: `llmlab.kernels.moe_gemm`), and the results
#   go back to their tokens.
#
# Here is the grouping on a toy batch: 4 tokens, top-2 of 5 experts, with the choices
# `[[3, 0], [0, 1], [3, 1], [2, 0]]`. The flattened pairs are numbered token by token (pair
# 2t + j is token t's j-th choice); sorted by expert, with ties kept in pair order:
#
# | sorted row | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
# |---|---|---|---|---|---|---|---|---|
# | pair | 1 | 2 | 7 | 3 | 5 | 6 | 0 | 4 |
# | expert | 0 | 0 | 0 | 1 | 1 | 2 | 3 | 3 |
# | token | 0 | 1 | 3 | 1 | 2 | 3 | 0 | 2 |
#
# Expert 0 owns sorted rows 0–2, expert 1 rows 3–4, expert 2 row 5, expert 3 rows 6–7, and
# expert 4 none: the boundaries are `[0, 3, 5, 6, 8, 8]`, a running sum of the experts' counts.

# %% [markdown]
# ## Build: routing and grouped dispatch
#
# Write `moe_dispatch(x, router_logits, top_k, w_gate, w_up, w_down) -> [tokens, hidden]`, the
# whole MoE layer after its router:
#
# * `x` [tokens, hidden]; `router_logits` [tokens, E], the router's raw output;
# * `w_gate`, `w_up` [E, inter, hidden] and `w_down` [E, hidden, inter]: expert e is the SwiGLU
#   MLP `down(silu(x @ w_gate[e].T) * (x @ w_up[e].T))` with `down(h) = h @ w_down[e].T`;
# * route as Mixtral does (above), then run the experts the grouped way: each expert **once**,
#   on exactly the rows of the tokens that chose it, and each token's output is the weighted
#   sum of its k experts' outputs.
#
# The checker tries it on small layers first (equal experts, then distinct ones, then counts its
# matrix-multiply FLOPs, which must be those of top-k, not of every expert), then registers it
# as a dispatch of the real MoE layers (`llmlab.layers.moe.register_dispatch`) and runs
# tiny-mixtral and the upcycled SmolLM2 with it, against dense dispatch. During the check
# llmlab's own `route`, `group_by_expert` and dispatch functions refuse to run: write it from
# tensor operations.

# %%
import torch.nn.functional as F


def moe_dispatch(x, router_logits, top_k, w_gate, w_up, w_down):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb06.moe_dispatch", moe_dispatch)

# %% [markdown]
# **Compare with llmlab's.** `llmlab.layers.moe` splits your function in two: `route(logits, k)`
# returns the renormalized weights and expert ids (the Mixtral paper writes it as a softmax over
# the two largest logits, which gives the same weights), and `dispatch_grouped` gathers the
# sorted rows once, lets the grouped GEMM multiply every expert's slice, scales each row by its
# weight in the down projection, and brings the rows back with the inverse permutation
# (`inverse[order] = arange(...)`), then sums each token's k rows; every token has exactly k
# rows, so no scatter-add is needed.
#
# ## Check: three strategies, one answer, against HF transformers
#
# `tiny-mixtral` is a 2-layer random Mixtral (4 experts, top-2) saved in HF layout, so
# `MixtralForCausalLM` can load the same weights. `set_dispatch(model, name)` switches every layer.

# %%
# NBVAL_CHECK_OUTPUT
from transformers import AutoModelForCausalLM

from llmlab.layers import moe as M

tiny = llmlab.load_model("tiny-mixtral")
hf = AutoModelForCausalLM.from_pretrained(str(llmlab.models.resolve("tiny-mixtral")),
                                          dtype=torch.float32).eval()
ids = torch.randint(0, tiny.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    ref = hf(ids).logits
    for name in ("dense", "loop", "grouped"):
        M.set_dispatch(tiny, name)
        err = (tiny(ids) - ref).abs().max().item()
        print(f"{name:8s} vs MixtralForCausalLM: max |Δ| = {err:.0e} (< 1e-4: {err < 1e-4})")

# %% [markdown]
# The grouped GEMM as a Triton kernel (on this CPU it runs in Triton's interpreter, which is
# slow by design: this is a correctness check, not a timing), on 37 rows so the groups are ragged
# against the kernel's tiles:

# %%
# NBVAL_CHECK_OUTPUT
if has_triton():
    mlp0 = tiny.layers[0].mlp
    x0 = torch.randn(37, tiny.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        routed = mlp0(x0)
        w, e = mlp0.last_routing
        tri = M.dispatch_grouped(x0, w, e, mlp0.w_gate, mlp0.w_up, mlp0.w_down, impl="triton")
    err = (tri - routed).abs().max().item()
    print(f"grouped with the Triton kernel vs the layer: max |Δ| = {err:.0e} (< 1e-5: {err < 1e-5})")
else:
    print(TRITON_MISSING)

# %% [markdown]
# ## Check on a real model: SmolLM2-135M upcycled into 8 experts
#
# `load_model("smollm2-135m-moe8")` builds a MoE from SmolLM2's own files: every MLP becomes 8
# experts that start as copies of it (sharing its storage), and each layer gets a seeded random
# router, top-2 (*sparse upcycling*, Komatsuzaki et al., ICLR 2023). With identical experts the
# two chosen outputs are the same vector and their weights sum to one, so the MoE **must**
# produce the dense model's tokens, whatever the router does: a check that dispatch is right.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.models.upcycle import upcycle

tok = llmlab.load_tokenizer("smollm2-135m")
dense = llmlab.load_model("smollm2-135m")
moe = upcycle(dense)  # what load_model("smollm2-135m-moe8") builds, sharing `dense`'s tensors
PROMPT = "The capital of France is"
n_new = 3 if QUICK else 4
want = llmlab.generate(dense, tok, PROMPT, max_new_tokens=n_new, chat=False)
M.set_dispatch(moe, "grouped")
got = llmlab.generate(moe, tok, PROMPT, max_new_tokens=n_new, chat=False)
print("dense:", repr(want.text))
print("moe8 :", repr(got.text))
print("same greedy tokens:", got.token_ids == want.token_ids)

# %% [markdown]
# With **perturbed experts** (`expert_noise=σ`: expert e scales each intermediate neuron of the
# dense MLP by a seeded factor 1 + σ·ε) the experts differ, so the routing now changes the output.

# %%
# NBVAL_CHECK_OUTPUT
noisy = upcycle(dense, expert_noise=0.3, noise_seed=0)
M.set_dispatch(noisy, "grouped")
ids = torch.tensor([want.prompt_token_ids + want.token_ids])
with torch.no_grad():
    d_logits, n_logits = dense(ids), noisy(ids)
print(f"perturbed experts change the logits: max |Δ| = {(n_logits - d_logits).abs().max().item():.1f}")
print("same greedy choice at every position:",
      bool((n_logits.argmax(-1) == d_logits.argmax(-1)).all()))

# %% [markdown]
# ## Routing statistics
#
# Each `SparseMoE` keeps the routing of its last forward pass. Two questions:
#
# * **Load**: how many (token, expert) assignments did each expert get, per layer?
# * **Balance**: the Switch Transformer's auxiliary loss α · N · Σᵢ fᵢ · Pᵢ, where N is the
#   number of experts, fᵢ the share of the assignments expert i got and Pᵢ its router
#   probability averaged over the tokens. Perfectly uniform routing gives exactly α (here 0.01);
#   training adds it to the loss to push the router toward balance.

# %%
from llmlab.viz.moe import plot_layer_loads

text = ("Mixture-of-experts models route every token to a few expert networks. The router is a "
        "small linear layer; its choices decide which weights are read and how busy each expert is.")
ids = torch.tensor([tok(text)["input_ids"]])
with torch.no_grad():
    noisy(ids)
loads = S.layer_loads(noisy)
fig = plot_layer_loads(loads, f"smollm2-135m-moe8 (random router), {ids.shape[1]} tokens: share per expert")

# %%
# NBVAL_CHECK_OUTPUT
from IPython.display import Markdown

report = S.routing_report(noisy, alpha=0.01)
layer_probs = torch.stack([torch.softmax(m.last_router_logits.float(), -1).mean(0)
                           for m in M.moe_layers(noisy)])  # Pᵢ per layer
layer_shares = loads.float() / loads.sum(1, keepdim=True)   # fᵢ per layer
worst = max(report, key=lambda r: r.max_over_mean)
losses = torch.tensor([r.balance_loss for r in report])
lopsided = sum(r.max_over_mean >= 2 for r in report)
print("tokens:", ids.shape[1], "| assignments per layer:", int(loads[0].sum()))
print(f"layers whose busiest expert has at least 2x the mean load: {lopsided} of {len(report)}")
print(f"balance loss: mean over layers {losses.mean():.4f}, smallest {losses.min():.4f}, "
      f"largest {losses.max():.4f} (uniform routing: 0.0100)")
f_w, p_w = layer_shares[worst.layer], layer_probs[worst.layer]
print(f"most lopsided layer {worst.layer}: busiest expert at {worst.max_over_mean:.1f}x the mean load, "
      f"balance loss {worst.balance_loss:.4f}")
print("  load share fᵢ:        ", " ".join(f"{v:.3f}" for v in f_w))
print("  mean probability Pᵢ:  ", " ".join(f"{v:.3f}" for v in p_w))
others = [i for i in range(len(report)) if i != worst.layer]
spread_p = (layer_probs[others] - 1 / 8).abs().max()
spread_f = (layer_shares[others] - 1 / 8).abs().max()
print(f"the other {len(others)} layers: Pᵢ within ±{spread_p:.3f} of 1/8 = 0.125, "
      f"fᵢ within ±{spread_f:.3f}")
expect(losses.max() < 0.02, "every layer's balance loss below 2α")
expect(spread_f > 2 * spread_p, "the load shares fᵢ spreading more than twice as far from 1/8 as "
       "the mean probabilities Pᵢ")
expect((f_w - 1 / 8).abs().max() > 2 * (p_w - 1 / 8).abs().max() > 0.01,
       f"layer {worst.layer}'s loads spreading more than twice as far as its probabilities, "
       "which are not flat")

# %%
Markdown(f"An untrained router is far from balanced in its *counts*: in {lopsided} of the "
         f"{len(report)} layers the busiest expert gets at least twice the mean load (up to "
         f"{worst.max_over_mean:.1f}× in layer {worst.layer}). Yet the balance loss averages "
         f"{losses.mean():.4f} over the layers, {100 * (losses.mean() / 0.01 - 1):.0f}% above its "
         f"uniform value, and even layer {worst.layer} reaches only {worst.balance_loss:.4f}. "
         f"The mean probabilities Pᵢ stay within ±{spread_p:.3f} of 1/8 in the other layers, "
         f"while the load shares fᵢ move by up to ±{spread_f:.3f}.")

# %% [markdown]
# **Exercise (explain).** Why does the balance loss stay so close to α while the loads are this
# lopsided? The two printed rows of the most lopsided layer are the place to look.

# %%
exercises.ask("nb06.explain_balance_loss")

# %%
my_choice = ...  # YOUR ANSWER: "a", "b", "c" or "d"
exercises.check("nb06.explain_balance_loss", my_choice)

# %%
# the excess over α, from the deviations of the counts and of the probabilities from 1/N
excess = 0.01 * 8 * ((layer_shares - 1 / 8) * (layer_probs - 1 / 8)).sum(1)
expect(torch.allclose(excess, losses - 0.01, atol=1e-5),
       "the identity loss = α + α·N·Σ(fᵢ − 1/N)(Pᵢ − 1/N) in every layer")
print(f"α·N·Σ(fᵢ − 1/N)(Pᵢ − 1/N) per layer, largest {excess.max():.5f}; loss − α, largest "
      f"{(losses - 0.01).max():.5f}")

# %% [markdown]
# ## Capacity: a training and serving-system concern
#
# **Mixtral's inference drops no tokens**: every token reaches its two experts, however busy
# they are, and the output is exactly the weighted sum of the two. MegaBlocks (Gale et al.,
# MLSys 2023) made such *dropless* MoE efficient for training too. Capacity limits come from
# training systems such as GShard and the Switch Transformer: each expert gets a fixed number
# of slots per batch (the *capacity factor* cf times the assignments it would get if routing
# were perfectly balanced), so that the exchange of tokens between devices and the expert
# matrix multiplies have fixed shapes; an assignment that finds its expert full is *dropped*
# (that token keeps only its residual path for that expert). A serving system meets the same
# question only if it gives experts fixed-size buffers, for instance when experts live on
# different devices.
#
# **Exercise (predict, then measure).** 512 tokens, 8 experts, top-2 (1024 assignments), a
# router with **no bias** toward any expert (random hidden states, a random router), capacity
# factor **1.0**: what percentage of the assignments is dropped? Commit a number first.

# %%
my_drop_prediction = ...  # YOUR ANSWER: a percentage, e.g. 12

# %%
from llmlab.viz.moe import explore_routing

fig, unbiased = explore_routing(num_experts=8, top_k=2, capacity_factor=1.0, tokens=512, skew=0.0)
print(f"loads: {unbiased.load} (capacity {unbiased.capacity}); dropped {100 * unbiased.drop_fraction:.1f}%")
exercises.check("nb06.predict_drops", my_drop_prediction, measured=100 * unbiased.drop_fraction)

# %% [markdown]
# ## Measure: one MoE layer, three strategies, on this CPU
#
# A Mixtral-shaped layer scaled down 8× (hidden 512, intermediate 1792), random weights, on
# one thread (steadier when other work shares the machine). Each point is the median of 7 runs
# after a warm-up; the bars span the fastest to the slowest run. Each pair of strategies is
# compared by the ratio of their medians, with a 95% bootstrap interval over the runs: an
# interval that contains 1 means this run cannot tell the two apart. (`python -m llmlab.bench moe`
# runs a longer sweep.)

# %%
from llmlab.viz.moe import compare_dispatch, measure_dispatch, median_of, pair_sentence, plot_dispatch_times

tokens = [1, 64, 512] if QUICK else [1, 16, 128, 512]
experts_sweep = [2, 8, 32] if QUICK else [2, 4, 8, 16, 32]
token_rows, expert_rows = measure_dispatch(tokens, experts_sweep, fixed_tokens=128, repeats=7)
fig = plot_dispatch_times(token_rows, expert_rows, f"{device_name()}; timed on 1 thread")
vs_dense = compare_dispatch(token_rows, "dense")     # dense's runs against grouped's, per row
vs_loop = compare_dispatch(token_rows, "loop")
for r, cd, cl in zip(token_rows, vs_dense, vs_loop):
    print(f"{r['tokens']:4d} token{'s' if r['tokens'] > 1 else ' '}: dense {cd.baseline_median:6.1f} ms, loop {cl.baseline_median:6.1f} ms, "
          f"grouped {cd.candidate_median:6.1f} ms -> dense/grouped {cd.interval()}, "
          f"loop/grouped {cl.interval()}")
e_axis = [r["experts"] for r in expert_rows]
grow = {s: fit_power(e_axis, [median_of(r, f"{s} µs/token") for r in expert_rows])
        for s in ("dense", "grouped")}
for s, f in grow.items():
    print(f"{s:8s}: µs/token ∝ E^{f.exponent:.2f} over E = {', '.join(map(str, e_axis))} "
          f"(rms residual {f.rms:.0%}), {expert_rows[0]['tokens']} tokens, top-2")
expect(vs_dense[0].verdict == "faster" and vs_dense[0].ratio > 1.5,
       "grouped clearly faster than dense at one token (dense runs all 8 experts, grouped 2)")
expect(all(0.5 < c.ratio < 2.0 for c in vs_loop), "loop and grouped within 2× of each other")
expect(grow["dense"].exponent > grow["grouped"].exponent + 0.2,
       "dense's time per token growing with the experts much faster than grouped's")

# %% [markdown]
# Read the printed ratios against two models. **FLOPs**: dense does E/k = 4 times the
# arithmetic of top-2, so where the matrix multiplies dominate (many tokens) the dense/grouped
# ratio approaches 4. **Bytes**: with a single token, dense still runs (and reads the weights
# of) all 8 experts while grouped touches only the 2 chosen ones, so dense is slower; from
# a few dozen tokens on every expert has work, grouped reads them all too, and its advantage
# shrinks until the FLOPs take over (the GPU model below has the same shape).
#
# **loop** and **grouped** run the same per-expert matrix multiplies on a CPU. Only the
# bookkeeping around them differs: the loop searches for each expert's tokens and scatter-adds
# its results back, while grouped sorts the (token, expert) pairs once and gathers the rows back
# in one step. Grouping pays on a GPU, where it turns E small launches into one kernel.

# %%
Markdown(
    "On this run, each ratio of medians with its 95% interval (the winner's speed-up where there "
    "is one): " + pair_sentence(tokens, vs_loop) + ". "
    + ("Since the arithmetic is the same, a resolved difference comes from that bookkeeping; "
       "the largest resolved gap between the medians is "
       f"{max(abs(c.ratio - 1) for c in vs_loop if c.resolved):.0%}. "
       if any(c.resolved for c in vs_loop) else
       "The bookkeeping costs the same within this run's noise. ")
    + "Against dense: " + pair_sentence(tokens, vs_dense) + "."
    "\n\nHolding top-2 and adding experts keeps the FLOPs per token of two experts while the "
    "parameters grow (Mixtral's bargain). Fitted over all the expert counts, dense time per token "
    f"grows as E^{grow['dense'].exponent:.2f} and grouped as E^{grow['grouped'].exponent:.2f}"
    + (": grouped grows much less, and what it does grow comes from each expert getting fewer "
       "tokens while all of its weights must still be read."
       if grow["dense"].exponent > grow["grouped"].exponent + 0.2 else
       ": on this run the two grow alike, which the FLOP count does not predict; rerun the cell.")
    + " Every expert must also stay resident in memory.")

# %% [markdown]
# ## The GPU case, as a model
#
# A CPU shows the FLOP saving but not what a GPU does, and there is no GPU here, so here is a
# **model**, labelled as one: one Mixtral 8x7B MoE layer (hidden 4096, intermediate 14336) in
# bfloat16 on an H100 SXM (datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3), each strategy
# taking max(FLOPs / peak, bytes / bandwidth), as an ideal kernel would (the roofline of
# notebook 02). On a GPU, *grouped* is one kernel launch: the grouped GEMM gives each thread
# block a tile of one expert's rows and spreads the tiles over the GPU's 132 SMs (*streaming
# multiprocessors*, its cores), instead of E small launches that each wait for the host to
# learn how many tokens `torch.where` found.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.viz.moe import plot_moe_gpu_model

fig, gpu = plot_moe_gpu_model()
for e in gpu:
    if e.tokens in (1, 16, 256, 4096):
        print(f"MODEL {e.tokens:5d} tokens: dense {e.dense_s * 1e3:6.2f} ms, grouped {e.grouped_s * 1e3:6.2f} ms "
              f"({e.dense_over_grouped:.1f}x), experts touched {e.experts_touched:.1f} of 8")

# %% [markdown]
# The model tells a story the CPU cannot. At batch 1 (decoding one sequence) grouped reads only
# the 2 chosen experts' weights, a quarter of the bytes: 4× faster. By about 16 tokens every
# expert has a token, both strategies read all 8 experts' weights, and both are bound by memory
# bandwidth: the same time. Only when the batch is large enough to be compute-bound (about a
# thousand tokens, prefill) does the FLOP ratio of 4 return. A MoE's weights must all be
# resident, and at medium batch sizes they must all be read: sparsity saves compute, not memory.
#
# ## Play: experts, top-k and capacity
#
# A synthetic batch (512 random hidden states) through a seeded random router with a bias toward
# low-numbered experts (`skew`). Watch what falls over capacity, and how `k / E` sets the share of
# expert parameters a token touches.

# %%
fig, stats = explore_routing(num_experts=8, top_k=2, capacity_factor=1.25)
print(f"capacity {stats.capacity}, dropped {stats.drop_fraction:.0%}, "
      f"tokens with no expert left {stats.tokens_fully_dropped}, active share of experts {stats.active_fraction:.0%}")

# %%
def _show(num_experts=8, top_k=2, capacity_factor=1.25, skew=1.0):
    if top_k > num_experts:
        print(f"top_k={top_k} needs at least that many experts")
        return
    fig, st = explore_routing(num_experts, top_k, capacity_factor, skew=skew)
    plt.show()
    print(f"capacity {st.capacity}, dropped {st.drop_fraction:.0%}, balance loss {st.balance_loss:.4f}")


widgets.interactive(_show, num_experts=widgets.IntSlider(8, 2, 64),
                    top_k=widgets.IntSlider(2, 1, 8),
                    capacity_factor=widgets.FloatSlider(1.25, min=0.5, max=4.0, step=0.25),
                    skew=widgets.FloatSlider(1.0, min=0.0, max=3.0, step=0.25))

# %% [markdown]
# ## Play: the grouped GEMM's tile (compiled for H100, not run)
#
# The Triton grouped GEMM (`llmlab.kernels.moe_gemm`) gives each program a tile of BLOCK_M
# sorted rows of one expert × BLOCK_N output features, and walks the input features BLOCK_K
# at a time. Two things set a good tile:
#
# - **Padding.** A tile belongs to one expert, so each expert's rows are rounded up to a whole
#   number of BLOCK_M tiles; the rows past its group are computed and thrown away. With few
#   tokens per expert (decode) a large BLOCK_M mostly computes padding. MegaBlocks (Gale et al.,
#   2023) builds its block-sparse MoE kernels on the same rounding of each expert's tokens to
#   the block size.
# - **Registers.** The float32 accumulator is BLOCK_M × BLOCK_N values spread over the 128
#   threads of 4 warps (how the kernel is launched): 128 × 256 is 256 registers per thread, over
#   the 255 a thread may hold (CUDA C++ Programming Guide, technical specifications per compute
#   capability), so the compiler must put values in local memory, which lives in DRAM.
#
# Triton and NVIDIA's `ptxas` build the kernel for an H100 (`sm_90`) or an A100 (`sm_80`) on this
# CPU machine, and `data/kernel_builds.json` keeps what each widget tile uses (notebook 03
# explains the columns: registers, spills, shared memory, occupancy, tensor-core instructions).
# Nothing here ran on a GPU. The explorer shows that build, the rows the tiles compute for a
# small routed batch (32 tokens, top-2 of 8 experts), and the kernel timed with that tile (in
# the Triton interpreter on a CPU: Python's speed, not a GPU's).

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.kernels import report as R

print("compiled for H100 (sm_90), not run: grouped GEMM, bf16, 4 warps, 3 stages")
print(f"{'BLOCK_M×N×K':>12s} {'regs/thread':>11s} {'spill B/thread':>14s} {'smem KiB':>8s} "
      f"{'occupancy':>9s} {'HMMA':>4s} {'HGMMA':>5s}")
for bm, bn, bk in [(32, 64, 32), (64, 128, 32), (128, 128, 64), (128, 256, 32), (128, 256, 64)]:
    b = R.lookup("moe", "H100", "bf16", block_m=bm, block_n=bn, block_k=bk)
    print(f"{f'{bm}×{bn}×{bk}':>12s} {b.registers:11d} {b.spill_bytes:14d} {b.shared_bytes / 1024:8.0f} "
          f"{b.occupancy:9.0%} {b.tensor_core_ops['HMMA']:4d} {b.tensor_core_ops['HGMMA']:5d}")

# %%
from llmlab.viz.moe import gemm_tile_explorer

gemm_tiles = R.WIDGET_TILES["moe"]          # every choice below has a build in the table
r = gemm_tile_explorer(64, 128, 32, chip="H100")
print(f"BLOCK_M=64: {r.padded_rows} tile rows for {r.rows} routed rows ({r.padded_rows / r.rows:.1f}×)")


def _show_tile(block_m=64, block_n=128, block_k=32, chip="H100"):
    gemm_tile_explorer(block_m, block_n, block_k, chip=chip)
    plt.show()


widgets.interactive(_show_tile,
                    block_m=widgets.SelectionSlider(options=gemm_tiles["block_m"], value=64),
                    block_n=widgets.SelectionSlider(options=gemm_tiles["block_n"], value=128),
                    block_k=widgets.SelectionSlider(options=gemm_tiles["block_k"], value=32),
                    chip=["H100", "A100"])

# %% [markdown]
# ## More exercises
#
# **Active parameters (compute).** Write `active_params(config)`: the parameters one token
# uses. Count the embeddings (one matrix if `config.tie_word_embeddings`, else two), per layer
# the q/k/v/o projections, the router, the experts a token uses and two RMSNorm vectors, and the
# final norm. The fields are `config.hidden_size`, `head_dim`, `num_heads`, `num_kv_heads`,
# `intermediate_size`, `num_experts`, `num_experts_per_tok`, `num_layers`, `vocab_size`.

# %%
def active_params(config):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb06.active_params", active_params)

# %% [markdown]
# **Stretch: capacity-factor dropping.** Write `keep_within_capacity(experts, num_experts,
# capacity_factor)` for routing `experts` [tokens, k]: return `kept` [tokens, k] (bool), True
# where an assignment fits in its expert's slots. Each expert has room for cf times the number of
# assignments it would get under perfect balance, rounded up. Slots are handed out as GShard
# does: every token's first choice, in token order, before any second choice.

# %%
def keep_within_capacity(experts, num_experts, capacity_factor):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb06.capacity_drop", keep_within_capacity)

# %% [markdown]
# ## Takeaways
#
# 1. A MoE layer's parameters grow with E but a token's compute grows with k: Mixtral reaches 47B parameters and uses 13B per token.
# 2. Sparsity pays only if dispatch exploits it: grouping tokens by expert (one sort, one GEMM per expert) saves the E/k FLOPs that dense dispatch wastes; on a GPU the saving is in FLOPs at large batch and in bytes only at very small batch.
# 3. Routing is a load-balancing problem: untrained routers are lopsided, a balance loss near its uniform value can hide that, and capacity limits (a training-system device, not part of Mixtral's inference) drop what overflows.
#
# ## Further reading
#
# - Shazeer, Mirhoseini, Maziarz, Davis, Le, Hinton, Dean. *Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer.* ICLR 2017. [arXiv:1701.06538](https://arxiv.org/abs/1701.06538)
# - Lepikhin et al. *GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding.* 2020 (ICLR 2021). [arXiv:2006.16668](https://arxiv.org/abs/2006.16668) (top-2 gating, expert capacity, first choices first)
# - Fedus, Zoph, Shazeer. *Switch Transformers: Scaling to Trillion Parameter Models with Simple and Efficient Sparsity.* JMLR 23(120), 2022. [jmlr.org](https://jmlr.org/papers/v23/21-0998.html), [arXiv:2101.03961](https://arxiv.org/abs/2101.03961) (the auxiliary load-balancing loss, capacity factors)
# - Jiang et al. *Mixtral of Experts.* 2024. [arXiv:2401.04088](https://arxiv.org/abs/2401.04088) (the routing, 47B total and 13B active parameters)
# - Komatsuzaki et al. *Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints.* ICLR 2023. [arXiv:2212.05055](https://arxiv.org/abs/2212.05055)
# - Gale, Narayanan, Young, Zaharia. *MegaBlocks: Efficient Sparse Training with Mixture-of-Experts.* MLSys 2023. [arXiv:2211.15841](https://arxiv.org/abs/2211.15841) (dropless MoE, grouped and block-sparse GEMMs)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
# - NVIDIA H100 product page (bandwidth, peak FLOP/s): [H100](https://www.nvidia.com/en-us/data-center/h100/)
# - NVIDIA. *CUDA C++ Programming Guide*: [technical specifications per compute capability](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#features-and-technical-specifications) (registers, shared memory) and [local memory](https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#device-memory-accesses) (where spills go)
