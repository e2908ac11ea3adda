# %% [markdown]
# # 01 · The baseline, and where the time goes
#
# **Why.** A language model writes one token at a time: each new token needs a forward pass whose
# input is everything written so far. The textbook loop simply runs the model again over the whole
# sequence at every step. The seed article on LLM inference (seed 001) walks through exactly this:
# at step 2 the input "the dog sat" recomputes "the dog", already processed at step 1 — the
# redundancy the KV cache (notebook 02) removes. It also names the two latencies users feel:
# **TTFT** (time to first token, dominated by processing the prompt, *prefill*) and **TPOT** (time
# per output token, the *decode* steps); total latency = TTFT + TPOT · (tokens − 1).
#
# This notebook measures the baseline honestly: the no-cache loop, a profile by operator and by part
# of the model, and the N² cost of textbook attention.

# %%
import inspect
import os
import matplotlib.pyplot as plt
import numpy as np
import torch
import llmlab
from llmlab.device import device_name

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
model = llmlab.load_model("smollm2-135m", attention="naive")
tok = llmlab.load_tokenizer("smollm2-135m")
print(device_name())

# %% [markdown]
# ## How: the decode loop, token by token
#
# `llmlab.generate` is the baseline: every step calls `model(ids)` on the *full* sequence and keeps
# only the last position's logits. Here is its heart:

# %%
src = inspect.getsource(llmlab.generate)
loop = src[src.index("    for _ in range(steps):"):src.index("    results = []")]
print(loop)

# %%
# NBVAL_CHECK_OUTPUT
out = llmlab.generate(model, tok, "Explain in two sentences why the sky is blue.",
                      max_new_tokens=24 if QUICK else 48)
print(out.text[:80], "...")
print("prompt tokens:", len(out.prompt_token_ids), "| generated:", len(out.token_ids))

# %%
t = np.array(out.token_times_s)
step = np.diff(np.concatenate([[0.0], t])) * 1e3
ctx = len(out.prompt_token_ids) + np.arange(len(step))
fig, ax = plt.subplots(figsize=(7, 3), dpi=80)
ax.plot(ctx, step, "o-", ms=3)
ax.set(xlabel="tokens the model re-reads at this step", ylabel="ms per step",
       title="no-cache decode: every step re-runs the whole sequence")
ax.grid(alpha=0.3)
fig.tight_layout()
print(f"TTFT {out.metrics.ttft_s * 1e3:.0f} ms, TPOT {out.metrics.tpot_s * 1e3:.0f} ms")

# %% [markdown]
# At these lengths each step is dominated by reading the 135M weights once, so the step time grows
# slowly; what grows with the sequence is the work: generating T tokens after a P-token prompt costs
# P + (P+1) + … + (P+T−1) token-passes instead of P + T − 1 (exercise 1).
#
# ## Measure: a profile by operator
#
# `torch.profiler` records every ATen operator. One forward pass over a 256-token prompt:

# %%
from llmlab.profiling.breakdown import profile_by_operator, time_by_part

ids = torch.randint(0, model.config.vocab_size, (1, 256))
with torch.inference_mode():
    rows = profile_by_operator(lambda: model(ids), row_limit=8)
for r in rows:
    print(f"{r.name:28s} {r.self_ms:8.1f} ms  x{r.calls}")

# %% [markdown]
# Matrix multiplies (`aten::mm`, `aten::addmm`, `aten::bmm`/`matmul` inside attention) dominate;
# the rest is elementwise work (softmax, SiLU, RMSNorm, rotary) that later notebooks fuse away.
#
# ## Measure: by part of the model, as the prompt grows
#
# Hooks on the attention, MLP, norm and lm_head modules add up where one forward pass spends its time.

# %%
from llmlab.viz.baseline import plot_parts

lengths = [64, 256, 1024]
parts = {}
time_by_part(model, ids)  # warm-up
for n in lengths:
    x = torch.randint(0, model.config.vocab_size, (1, n))
    parts[n] = time_by_part(model, x)
fig = plot_parts(parts)
for n, p in parts.items():
    total = sum(p.values())
    print(f"N={n:5d}: {total * 1e3:7.0f} ms, attention {p['attention'] / total:4.0%}, "
          f"mlp {p['mlp'] / total:4.0%}, lm_head {p['lm_head'] / total:4.0%}")

# %% [markdown]
# The MLP and lm_head cost grows linearly with N; attention's share grows because its score matrix
# grows as N².
#
# ## Measure: the N² of textbook attention
#
# `naive` attention builds the full `[batch, heads, N, N]` score matrix; `sdpa` is PyTorch's fused
# kernel. SmolLM2's shape: 9 query heads, 3 KV heads, head_dim 64, batch 1, causal.

# %%
from llmlab.viz.baseline import attention_cost, plot_attention_cost

ns = [128, 256, 512, 1024] if QUICK else [128, 256, 512, 1024, 2048]
cost = [attention_cost(n, backend=b, repeats=2) for b in ("naive", "sdpa") for n in ns]
fig = plot_attention_cost(cost, title=f"one causal attention call, 9 heads, d=64 ({device_name()})")
for r in cost:
    if r["n"] == ns[-1]:
        print(f"{r['backend']:6s} N={r['n']}: {r['seconds'] * 1e3:6.1f} ms, "
              f"peak {r['peak_bytes'] / 2**20:6.1f} MiB (one score matrix: {r['score_bytes'] / 2**20:.0f} MiB)")

# %% [markdown]
# Naive attention's peak memory follows the N² guide: doubling N quadruples it. That matrix is what
# FlashAttention (notebook 03) never writes out.
#
# ## Check: naive and sdpa give the same answer

# %%
# NBVAL_CHECK_OUTPUT
prompt = tok("The three laws of thermodynamics are", return_tensors="pt")["input_ids"]
with torch.inference_mode():
    ref = model(prompt)
    model.set_attention("sdpa")
    new = model(prompt)
    fast = llmlab.generate(model, tok, "Name a planet.", max_new_tokens=12)
    model.set_attention("naive")
    base = llmlab.generate(model, tok, "Name a planet.", max_new_tokens=12)
print("max |Δ logits| < 1e-4:", (new - ref).abs().max().item() < 1e-4)
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
# 1. With no KV cache, how many token-passes does generating `T = 100` tokens after a `P = 30`
#    token prompt cost? (Step t runs the model over P + t tokens.)

# %%
from llmlab.exercises.nb01 import check_score_bytes, check_token_passes

answer = ...  # YOUR CODE HERE
check_token_passes(answer, prompt_len=30, new_tokens=100)

# %% [markdown]
# 2. How many bytes does one float32 score matrix take for SmolLM2 (9 heads) at N = 8192, batch 1?

# %%
answer = ...  # YOUR CODE HERE
check_score_bytes(answer, n=8192, heads=9)

# %% [markdown]
# ## Takeaways
#
# - The baseline recomputes the whole sequence each step: quadratic work for linear output.
# - Matrix multiplies dominate; attention's share grows with N because its scores grow as N².
# - Swapping `naive` for `sdpa` changes speed and memory, not the answer.
