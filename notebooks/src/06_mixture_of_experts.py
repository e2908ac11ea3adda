# %% [markdown]
# # 06 · Mixture of experts: routing, dispatch, and what sparsity buys
#
# **Why.** The seed article on inference acceleration (seed 000, its MoE section) presents
# Mixtral 8x7B: every layer holds **8 expert MLPs and a router**; for each token the router picks
# **2 of the 8**, and only those two run. So a token can reach **47B parameters but uses about
# 13B** — capacity grows while compute per token stays that of a much smaller model. The same
# article reports Mixtral matching or beating Llama 2 70B with 5× fewer active parameters and
# running about 6× faster than it.
#
# Sparsity only pays if the code exploits it. This notebook routes tokens like Mixtral, runs
# the experts three ways — `dense` (every expert on every token), `loop` (one gather per expert)
# and `grouped` (sort tokens by expert, one GEMM each) — checks that they agree with HF
# transformers, upcycles the real SmolLM2-135M into an 8-expert MoE, and measures the saving.

# %%
import inspect
import os

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch

import llmlab
from llmlab.device import device_name
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
from llmlab.layers import moe as M
from llmlab.layers import moe_stats as S

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
print(device_name())

# %% [markdown]
# ## Why, in numbers: total against active parameters
#
# `compute_account` counts parameters and FLOPs per token (an analytic model: 2 FLOPs per
# multiply-add, attention at context 0). For Mixtral 8x7B's published config it should land on
# the seed's 47B / 13B.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.viz.moe import plot_compute_accounts

dense_cfg = llmlab.ModelConfig.from_file(llmlab.models.registry.resolve("smollm2-135m"))
moe_cfg = llmlab.ModelConfig(**{**dense_cfg.to_dict(), "num_experts": 8, "num_experts_per_tok": 2,
                                "model_type": "mixtral"})
accounts = [S.compute_account(dense_cfg, "smollm2-135m"),
            S.compute_account(moe_cfg, "smollm2-135m-moe8"),
            S.compute_account(S.MIXTRAL_8X7B, "Mixtral 8x7B")]
for a in accounts:
    print(f"{a.name:18s} total {a.total_params / 1e9:6.2f}B  active {a.active_params / 1e9:6.2f}B "
          f"({a.active_fraction:4.0%})  GFLOP/token {a.flops_per_token / 1e9:6.2f} "
          f"(all experts: {a.flops_per_token_all_experts / 1e9:6.2f})")
print(f"seed figures for Mixtral: {S.SEED_MIXTRAL_TOTAL_PARAMS / 1e9:.0f}B total, "
      f"{S.SEED_MIXTRAL_ACTIVE_PARAMS / 1e9:.0f}B active")

# %%
fig = plot_compute_accounts(accounts)

# %% [markdown]
# Attention, embeddings and norms are shared by all experts, which is why Mixtral is "8x7B" but
# 47B, not 56B. Running every expert on every token would cost 3.7× the FLOPs of top-2.
#
# ## How: routing
#
# The router is one linear layer `gate` [experts, hidden]. Mixtral takes a softmax over its
# logits, keeps the top-k, and renormalizes those k weights to sum to one:

# %%
print(inspect.getsource(M.route))

# %% [markdown]
# ## How: three ways to run the chosen experts
#
# * **dense** runs all E experts on all tokens and multiplies the unchosen ones by zero —
#   correct, and E/k times the work.
# * **loop** asks, for each expert, "which tokens chose you?" (`torch.where`), gathers them,
#   runs the expert, and scatter-adds the weighted result.
# * **grouped** sorts the (token, expert) pairs by expert once. Each expert's rows then form one
#   contiguous slice, so one grouped GEMM (`llmlab.kernels.moe_gemm`: a Triton kernel on GPU,
#   one `torch.mm` per slice on CPU) runs every expert, and one gather puts the rows back.

# %%
# NBVAL_CHECK_OUTPUT
experts = torch.tensor([[3, 0], [0, 1], [3, 1], [2, 0]])  # 4 tokens, top-2 of 5 experts
order, token, offsets = M.group_by_expert(experts, num_experts=5)
print("expert of each sorted pair:", experts.reshape(-1)[order].tolist())
print("token of each sorted pair: ", token.tolist())
print("offsets (expert e owns rows offsets[e]:offsets[e+1]):", offsets.tolist())

# %%
print(inspect.getsource(M.dispatch_grouped))

# %% [markdown]
# ## Check: three strategies, one answer — against HF transformers
#
# `tiny-mixtral` is a 2-layer random Mixtral (4 experts, top-2) saved in HF layout, so
# `MixtralForCausalLM` can load the same weights. `set_dispatch(model, name)` switches every layer.

# %%
# NBVAL_CHECK_OUTPUT
from transformers import AutoModelForCausalLM

tiny = llmlab.load_model("tiny-mixtral")
hf = AutoModelForCausalLM.from_pretrained(str(llmlab.models.registry.resolve("tiny-mixtral")),
                                          dtype=torch.float32).eval()
ids = torch.randint(0, tiny.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    ref = hf(ids).logits
    for name in ("dense", "loop", "grouped"):
        M.set_dispatch(tiny, name)
        err = (tiny(ids) - ref).abs().max().item()
        print(f"{name:8s} vs MixtralForCausalLM: max |Δ| < 1e-4: {err < 1e-4}")
    mlp0 = tiny.layers[0].mlp
    x0 = torch.randn(37, tiny.config.hidden_size)  # 37 rows: ragged groups for the kernel's tiles
    routed = mlp0(x0)
    w, e = mlp0.last_routing
    tri = M.dispatch_grouped(x0, w, e, mlp0.w_gate, mlp0.w_up, mlp0.w_down, impl="triton")
print("grouped with the Triton kernel (interpreted on CPU) vs loop: max |Δ| < 1e-5:",
      (tri - routed).abs().max().item() < 1e-5)

# %% [markdown]
# ## Check on a real model: SmolLM2-135M upcycled into 8 experts
#
# `load_model("smollm2-135m-moe8")` builds a MoE from SmolLM2's own files: every MLP becomes 8
# experts that start as copies of it (sharing its storage), and each layer gets a seeded random
# router, top-2 (*sparse upcycling*, Komatsuzaki et al. 2022). With identical experts the two
# chosen outputs are the same vector and their weights sum to one, so the MoE **must** produce
# the dense model's tokens, whatever the router does — a check that dispatch is right.

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
print("perturbed experts change the logits (max |Δ| > 0.1):", (n_logits - d_logits).abs().max().item() > 0.1)
print("perturbed moe8 greedy:", repr(llmlab.generate(noisy, tok, PROMPT, max_new_tokens=n_new, chat=False).text))

# %% [markdown]
# ## Routing statistics
#
# Each `SparseMoE` keeps the routing of its last forward pass. Three questions:
#
# * **Load**: how many (token, expert) assignments did each expert get, per layer?
# * **Balance**: the Switch Transformer auxiliary loss α · N · Σᵢ fᵢ · Pᵢ (fᵢ: share of the
#   assignments expert i got; Pᵢ: its mean router probability). Uniform routing gives exactly α
#   (here 0.01); training adds it to the loss to push the router toward balance.
# * **Capacity**: with a fixed budget of ⌈cf · tokens · k / E⌉ slots per expert (what lets a
#   batch run as fixed-size GEMMs, or fit one expert per device), overflow is *dropped*.

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
report = S.routing_report(noisy, alpha=0.01, capacity_factor=1.25)
print("tokens:", ids.shape[1], "| assignments per layer:", int(loads[0].sum()))
print("mean balance loss over layers: %.3f (uniform: 0.010)" % (sum(r.balance_loss for r in report) / len(report)))
worst = max(report, key=lambda r: r.max_over_mean)
print(f"most lopsided layer: {worst.layer}, busiest expert at {worst.max_over_mean:.1f}× the mean load")
print("dropped at capacity factor 1.25: %.0f%% of assignments (mean over layers)"
      % (100 * sum(r.drop_fraction for r in report) / len(report)))

# %% [markdown]
# An untrained router is far from balanced: in some layers one expert gets several times its
# share and overflows a capacity of 1.25× the mean. During training the balance loss pushes the
# router back toward uniform.
#
# ## Measure: one MoE layer, three strategies
#
# A Mixtral-shaped layer scaled down 8× (hidden 512, intermediate 1792, 8 experts, top-2),
# timed with `llmlab.bench.moe` (best of a few runs; `python -m llmlab.bench moe` runs the full
# sweep from 1 to 4096 tokens).

# %%
from llmlab.bench.moe import CPU_SHAPE, sweep_experts, sweep_tokens
from llmlab.viz.moe import plot_dispatch_times

tokens = [1, 64, 512] if QUICK else [1, 16, 128, 512]
token_rows = sweep_tokens(tokens, CPU_SHAPE, "cpu", torch.float32, repeats=2, check=False)
expert_rows = sweep_experts([2, 8, 32] if QUICK else [2, 4, 8, 16, 32], 128, CPU_SHAPE, "cpu",
                            torch.float32, repeats=2)
fig = plot_dispatch_times(token_rows, expert_rows, device_name()[:60])
for r in token_rows:
    print(f"{r['tokens']:5d} tokens: dense {r['dense ms']:7.1f} ms, loop {r['loop ms']:7.1f} ms, "
          f"grouped {r['grouped ms']:7.1f} ms -> dense/grouped {r['dense/grouped']:.1f}x")
for r in expert_rows:
    print(f"{r['experts']:3d} experts ({r['params (M)']:5.0f}M params, {r['active (M)']:.0f}M active): "
          f"dense {r['dense µs/token']:7.0f} µs/token, grouped {r['grouped µs/token']:6.0f} µs/token")

# %% [markdown]
# With many tokens the matrix multiplies dominate and **dense** pays for all E experts, heading
# for E/k = 4× the grouped time (`python -m llmlab.bench moe` goes to 4096 tokens). On a CPU,
# **loop** and **grouped** run the same per-expert GEMMs, so they time about the same; grouping
# pays off on a GPU, where one kernel launch covers every expert instead of E small launches, each
# waiting for the host to learn how many tokens `torch.where` found.
#
# Holding top-2 and adding experts, the FLOPs per token stay those of two experts while the
# parameters grow — Mixtral's bargain. Dense time grows with E; grouped time grows far more
# slowly, and only because each expert now gets fewer tokens while all of their weights must
# still be read: small per-expert batches become bound by memory, not arithmetic. Memory grows
# with E too: every expert must be resident.
#
# ## Play: experts, top-k and capacity
#
# A synthetic batch (512 random hidden states) through a seeded random router with a bias toward
# low-numbered experts (`skew`). Watch what falls over capacity, and how `k / E` sets the share of
# expert parameters a token touches.

# %%
from llmlab.viz.moe import explore_routing

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
# ## Exercises
#
# **1. Active parameters.** Write `active_params(config)`: the parameters one token uses —
# embeddings (one matrix if `tie_word_embeddings`, else two), per layer q/k/v/o projections, the
# router (`hidden × num_experts`), `num_experts_per_tok` experts of `3 · hidden · intermediate`
# each, two RMSNorm vectors, and the final norm. *Hint:* the fields are `config.hidden_size`,
# `head_dim`, `num_heads`, `num_kv_heads`, `intermediate_size`, `num_experts`, `num_experts_per_tok`,
# `num_layers`, `vocab_size`.

# %%
from llmlab.exercises.nb06 import check_active_params, check_capacity, check_group_by_expert


def active_params(config):
    # YOUR CODE HERE
    return None


check_active_params(active_params);

# %% [markdown]
# **2. Capacity.** Write `capacity(tokens, num_experts, top_k, capacity_factor)`: the number of
# slots per expert. *Hint:* a perfectly balanced expert receives `tokens · top_k / num_experts`
# assignments; round up with `math.ceil`.

# %%
def capacity(tokens, num_experts, top_k, capacity_factor):
    # YOUR CODE HERE
    return 0


check_capacity(capacity);

# %% [markdown]
# **3. Grouping.** Write `group(experts, num_experts)` for `experts` [tokens, k]: return
# `(order, offsets)` where `experts.reshape(-1)[order]` is sorted and expert e's rows are
# `offsets[e]:offsets[e+1]`. *Hint:* `torch.argsort(..., stable=True)`, `torch.bincount(...,
# minlength=num_experts)`, `torch.cumsum`.

# %%
def group(experts, num_experts):
    # YOUR CODE HERE
    return None


check_group_by_expert(group);

# %% [markdown]
# ## Takeaways
#
# 1. A MoE layer's parameters grow with E but a token's compute grows with k: Mixtral reaches 47B and uses 13B.
# 2. Sparsity pays only if dispatch exploits it: grouping tokens by expert (one sort, one GEMM per expert) recovers the E/k saving that dense dispatch throws away.
# 3. Routing is a load-balancing problem: untrained routers are lopsided, capacity limits drop tokens, and the balance loss pushes toward uniform.
