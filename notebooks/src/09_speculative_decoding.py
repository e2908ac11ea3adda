# %% [markdown]
# # 09 · Speculative decoding: guess cheaply, verify in one forward
#
# **Why.** Notebook 02 showed that decoding at batch 1 is memory-bound: each new token streams
# every weight of the model once and does one multiply-add with it. A forward over k + 1
# tokens reads the same weights once and does k + 1 times the arithmetic, which the idle
# compute units absorb. So if something cheap could *guess* the next k tokens, one forward of
# the real model (the *target*) could check all k guesses at once and keep the ones it agrees
# with. That is speculative decoding:
#
# - **Leviathan, Kalman and Matias** (ICML 2023) draft with a small model, verify with the large
#   one, and give a rejection rule that keeps the target's output distribution exactly; on
#   T5-XXL they report 2–3× faster decoding with identical outputs.
# - **Chen et al.** (DeepMind, 2023) found the same rule ("speculative sampling") independently
#   and report 2–2.5× for the 70B-parameter Chinchilla in a distributed setup.
# - **EAGLE** (Li, Wei, Zhang and Zhang, ICML 2024) drafts at the level of the target's own
#   features (its second-to-top layer) with one small extra decoder layer and reports a 2.7–3.5×
#   latency speedup on LLaMA2-Chat 70B.
# - **Prompt lookup** needs no draft model at all: when the answer copies its input (editing,
#   rewriting, code changes, retrieval answers), the next tokens are often the ones that
#   followed the same few tokens earlier in the prompt. Yang et al. (2023, "LLMA") report
#   over 2× on such copy-heavy tasks, with the greedy output unchanged.
#
# It is also a lesson in when it fails. A draft that is **slow** (its cost c per token is not
# small) or **often wrong** (low acceptance α) loses time: each step pays for k drafts and a
# (k + 1)-token verify, and may keep only one token. **Batching** erodes the gain: a batch
# already fills the compute units, so verifying k + 1 tokens per sequence costs up to k + 1
# times as much. And a target that is **not memory-bound** (a small model on a CPU whose
# matmuls are slow) pays for every verified token.
#
# In this notebook you run all three draft methods on SmolLM2, **build** the accept/reject
# rule that makes sampling exact, check that greedy tokens do not change, and measure which
# number of drafts k pays off here.

# %%
import os

import matplotlib.pyplot as plt
import torch

import llmlab
from llmlab import exercises
from llmlab.device import describe
from llmlab import speculative
from llmlab.speculative import SpeculativeConfig
from llmlab.viz import spec as vspec

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
EDIT = ("Correct the spelling mistakes in this text and return the corrected text only: "
        "Yesterday I went to the libary to borow a book about the histroy of Rome. The "
        "librarian was very helpfull and showed me were the books were.")
CHAT = "Why is the sky blue?"
NEW = 24 if QUICK else 40

# %% [markdown]
# ## How: draft, verify, accept, roll back
#
# One step, for a sequence whose last emitted token is t:
#
# 1. **Draft** k tokens d₁ … d_k cheaply.
# 2. **Verify**: run the target once on [t, d₁, …, d_k]. Causal attention makes the output at
#    each position the target's next-token distribution *given the drafts before it*, so one
#    forward yields p₀ (after t), p₁ (after d₁), …, p_k (after d_k). The K and V of all k + 1
#    tokens are written to the cache on the way.
# 3. **Accept**: greedy keeps d₁ if it is argmax p₀, then d₂ if it is argmax p₁, and so on,
#    until the first mismatch; there the target's own argmax is emitted instead. If all k
#    match, argmax p_k is a free **bonus** token. A step emits between 1 and k + 1 tokens.
# 4. **Roll back**: the cache forgets the K/V of the rejected drafts (a length, not a copy).
#
# The greedy comparison in the library is a few lines:
#
# ```python
# n = 0
# while n < len(drafts) and drafts[n] == target_argmax[n]:
#     n += 1
# return n, target_argmax[n]          # accepted drafts, then the target's token
# ```
#
# The three drafts (`SpeculativeConfig.method`): `"ngram"` looks the last 1–3 tokens up earlier
# in prompt + output and proposes what followed them (no model); `"early_exit"` runs the
# target's own first layers and its lm_head; `"draft"` runs any model with the same
# vocabulary. Here is one generation on an edit prompt, a row per target forward:

# %%
g = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW,
                    speculative={"method": "ngram", "num_tokens": 4})
s = g.speculative
vspec.plot_timeline(s.accepted_per_step, s.drafted_per_step)
plt.show()
print(f"{s.num_generated} tokens in {s.target_forwards} target forwards "
      f"({s.tokens_per_forward:.2f} per forward); acceptance {s.acceptance_rate:.0%}")
print(g.text)

# %% [markdown]
# Rows with a single blue box are plain decode steps: the n-gram lookup found nothing to
# propose. Long green runs are where the answer copies the prompt; a red box is a draft the
# target disagreed with (a corrected spelling, say), replaced by the target's own token.
#
# ## Build: the accept/reject step
#
# Sampling needs a rule that keeps the target's distribution *exactly*, whatever the draft
# proposes. Leviathan et al. and Chen et al. give it. For the drafts d₁ … d_k, sampled from the
# draft's distributions q₁ … q_k, with the target's p₀ … p_k from the verify forward:
#
# - accept draft i with probability **min(1, p(d)/q(d))** (p, q at that position), in order;
# - at the first rejection, emit a token drawn from the normalized **(p − q)⁺** = max(p − q, 0)
#   at that position, and stop;
# - if all k are accepted, emit a **bonus** token drawn from p_k.
#
# Write `accept_reject(p, q, drafts, generator=None)` for one sequence: `p [k+1, vocab]`,
# `q [k, vocab]`, `drafts` a list of k token ids. Return the emitted tokens as a list: the
# accepted drafts, then one more. Use `torch.rand((), generator=generator)` and
# `torch.multinomial(probs, 1, generator=generator)` for the randomness.
#
# The check tries your rule on one-hot cases, then on 6,000 steps of a 5-token target/draft
# pair with a known answer (chi-square tests), then plugs it into SmolLM2's speculative
# generation (`SpeculativeConfig(accept_fn=...)`): greedy is the limit where p and q are
# one-hot, so the tokens must equal plain greedy decoding.

# %%
def accept_reject(p, q, drafts, generator=None):
    # YOUR CODE HERE: for each draft, accept with probability min(1, p/q) at its position;
    # at the first rejection append a token from the normalized (p - q)+ and return;
    # after all k, append the bonus token drawn from p[k]
    raise NotImplementedError


exercises.check("nb09.accept_reject", accept_reject)

# %% [markdown]
# ## Check (1): greedy speculation gives the same tokens
#
# Every method, every k: the tokens equal plain KV-cache greedy decoding, token for token.

# %%
# NBVAL_CHECK_OUTPUT
configs = [("ngram", 1), ("ngram", 2), ("ngram", 4), ("ngram", 8),
           ("early_exit", 2), ("early_exit", 4)]


def spec_of(method, k):
    spec = {"method": method, "num_tokens": k}
    if method == "early_exit":
        spec["num_layers"] = 8                       # 8 of SmolLM2's 30 layers
    return spec


for prompt in (EDIT, CHAT):
    ref = llmlab.generate(model, tok, prompt, max_new_tokens=NEW, kv_cache="contiguous")
    same = [llmlab.generate(model, tok, prompt, max_new_tokens=NEW,
                            speculative=spec_of(m, k)).token_ids == ref.token_ids
            for m, k in configs]
    print(f"{prompt[:30]!r}: identical tokens in all {len(configs)} configurations: {all(same)}")

# %% [markdown]
# ## Check (2): sampling keeps the target's distribution
#
# The library's `accept_reject` works on many rows at once. 50,000 one-step draws of a
# 6-token target p and draft q (k = 1): the first emitted token must follow p₀, whatever q
# is. A chi-square test compares the counts with p₀; so does the same test for a rule that
# resamples from p instead of (p − q)⁺.

# %%
# NBVAL_CHECK_OUTPUT
gen = torch.Generator().manual_seed(0)
p = torch.softmax(torch.randn(2, 6, generator=gen) * 1.5, -1)        # p0, p1 (bonus)
q = torch.softmax(torch.randn(1, 6, generator=gen) * 1.5, -1)
n = 50_000
drafts = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()   # [n, 1]
num_acc, nxt = speculative.accept_reject(p.expand(n, 2, 6), q.expand(n, 1, 6), drafts, gen)
first = torch.where(num_acc >= 1, drafts[:, 0], nxt)
from llmlab.exercises.nb09 import chi2_pvalue

wrong_first = torch.where(num_acc >= 1, drafts[:, 0],
                          torch.multinomial(p[0], n, replacement=True, generator=gen))
print("target p0      ", [f"{v:.3f}" for v in p[0].tolist()])
print("emitted (rule) ", [f"{v:.3f}" for v in (torch.bincount(first, minlength=6) / n).tolist()])
print(f"chi-square p-value, the rule: {chi2_pvalue(torch.bincount(first, minlength=6), p[0]):.2f} "
      f"(> 0.001: same distribution)")
print(f"chi-square p-value, resampling from p: "
      f"{chi2_pvalue(torch.bincount(wrong_first, minlength=6), p[0]):.0e}")
print(f"acceptance {(num_acc >= 1).float().mean():.3f}, "
      f"sum(min(p0, q)) = {torch.minimum(p[0], q[0]).sum():.3f}")

# %% [markdown]
# ## Predict, then measure: which k is best?
#
# Each draft is accepted with some probability α, but draft i counts only if all before it were
# (α^i), so a step yields E[tokens] = 1 + α + … + α^k. Every draft costs c target steps to make
# (for n-gram lookup, almost nothing), and verifying k + 1 tokens costs about one step *where
# decode is memory-bound*. The cost model (Leviathan et al.): speedup ≈ E[tokens] / (1 + k·c).
#
# Before the next cell runs: for **n-gram drafts on the edit prompt**, which k in {1, 2, 4, 8}
# will be fastest on this machine?

# %%
my_best_k = ...  # YOUR ANSWER: 1, 2, 4 or 8

# %% [markdown]
# ## Measure: acceptance and speedup per k and method
#
# Each configuration runs the edit prompt several times (the median is used, min–max drawn)
# against plain KV-cache greedy, interleaved so that a change in the machine's load hits all
# alike. c is the draft's measured time per drafted token over one plain decode step.

# %%
import statistics
import time

REPEATS = 3


def timed(spec):
    t = time.perf_counter()
    out = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW, kv_cache="contiguous",
                          speculative=spec)
    return time.perf_counter() - t, out


timed(None), timed(spec_of("early_exit", 2))                        # warm-up
times = {c: [] for c in [None] + configs}
last = {}
for _ in range(REPEATS):
    for c in times:
        sec, last[c] = timed(None if c is None else spec_of(*c))
        times[c].append(sec)
base = statistics.median(times[None])
step_s = base / len(last[None].token_ids)                          # a decode step, prefill spread in
grid = {}
for m, k in configs:
    st = last[(m, k)].speculative
    drafted = max(sum(st.drafted_per_step), 1)
    c = st.draft_s / drafted / step_s
    ratios = [base / t for t in times[(m, k)]]
    grid[(m, k)] = {"speedup": base / statistics.median(times[(m, k)]), "lo": min(ratios),
                    "hi": max(ratios), "accept": st.acceptance_rate,
                    "tok/fwd": st.tokens_per_forward, "c": c,
                    "model": speculative.cost_model_speedup(st.tokens_per_forward, k, c),
                    "accepted_per_step": st.accepted_per_step,
                    "drafted_per_step": st.drafted_per_step}
print(f"KV-cache greedy: {len(last[None].token_ids) / base:.1f} tok/s (median of {REPEATS})")
for (m, k), r in grid.items():
    print(f"{m:10s} k={k}: acceptance {r['accept']:.0%}, {r['tok/fwd']:.2f} tok/forward, "
          f"c={r['c']:.3f}, speedup {r['speedup']:.2f}x (min-max {r['lo']:.2f}-{r['hi']:.2f}), "
          f"cost model {r['model']:.2f}x")
vspec.plot_speedup_vs_k([dict(v, method=m, k=k) for (m, k), v in grid.items()])
plt.suptitle(f"edit prompt, {NEW} new tokens, measured on {describe()['device']}", fontsize=9)
plt.show()

# %%
measured_ngram = {k: grid[("ngram", k)]["speedup"] for k in (1, 2, 4, 8)}
exercises.check("nb09.predict_best_k", my_best_k, measured=measured_ngram)

# %% [markdown]
# Read the gap between the measured points and the dashed cost model (the ratio is printed
# below). The model assumes the verify forward of k + 1 tokens costs one decode step; on this
# CPU the matmuls of several tokens are not free, so every verified token adds a little, and
# rejected drafts are paid for too. The early-exit draft costs a sizeable fraction of a step per
# drafted token (its c above), and the first 8 of 30 layers almost never guess the target's token
# (its acceptance above): it loses. Prompt lookup costs almost nothing to draft, and on an
# answer that copies its prompt many of its drafts are accepted (the acceptance above).

# %%
for (m, k), r in grid.items():
    print(f"{m:10s} k={k}: measured / cost model = {r['speedup'] / r['model']:.2f}")

# %% [markdown]
# ## Play: k and method
#
# The widget shows a configuration's measured timeline and its place among the others.

# %%
import ipywidgets as widgets

def show(method="ngram", k=4):
    if (method, k) not in grid:
        return print(f"{method} with k={k} was not measured; measured: {sorted(grid)}")
    return vspec.explore_spec(grid, method, k).figure


widgets.interactive(show,
                    method=widgets.Dropdown(options=["ngram", "early_exit"], value="ngram"),
                    k=widgets.SelectionSlider(options=[1, 2, 4, 8], value=4,
                                              description="k (drafts)"))

# %%
best = max(grid, key=lambda c: grid[c]["speedup"])
choice = vspec.explore_spec(grid, *best, draw=False)
print(f"fastest here: {best[0]} with k={best[1]}: {choice.speedup:.2f}x at "
      f"{choice.tokens_per_forward:.2f} tokens per target forward")

# %% [markdown]
# ## Why batching erodes the gain, on notebook 02's roofline
#
# A decode step at batch B feeds B tokens; a verify step feeds B·(k + 1). At batch 1 both sit
# far left of the ridge, on the memory roof, where time is set by the weight bytes: the extra
# tokens are nearly free. As B grows the points move right; once the verify step crosses the
# ridge it is compute-bound and costs about k + 1 times a decode step, while it still yields
# only E[tokens] per sequence. The curves below are the **roofline model** (time =
# max(FLOPs / peak, bytes / bandwidth)) with this machine's measured roofs, acceptance 0.8 and
# k = 4, a free draft.

# %%
from llmlab.profiling.roofline import Ceilings, measure_bandwidth, measure_matmul_flops

ceilings = Ceilings(measure_bandwidth(), measure_matmul_flops(), describe()["device"])
rows = vspec.batching_model(model.config, ceilings, [1, 2, 4, 8, 16, 32, 64, 128], k=4,
                            alpha=0.8)
vspec.plot_batching(rows, ceilings, k=4, alpha=0.8)
plt.show()
for r in rows:
    print(f"batch {r['batch']:3d}: verify / decode time {r['verify_over_decode']:.2f}, "
          f"modelled speedup {r['speedup']:.2f}x")

# %% [markdown]
# ## Explain
#
# Why does batching erode the speedup of speculative decoding?
#
# - (a) the drafts are accepted less often at a large batch
# - (b) at a large batch a step is compute-bound, so k + 1 tokens per sequence cost about k + 1 times one
# - (c) rejected drafts of one sequence corrupt the KV cache of the others
# - (d) batching changes the greedy tokens, so fewer drafts match

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb09.explain_batching", answer)

# %% [markdown]
# ## Stretch: an int4 draft of a Q4_1 model
#
# SmolLM2's weights were shipped as Q4_1 and llmlab loads them dequantized to float32
# (notebook 08). `llmlab.quantize(model, "int4")` stores the same 4-bit grid again, so as a
# draft it is nearly the target itself. What do acceptance and speed look like?

# %%
q4 = llmlab.quantize(model, "int4", group_size=32)
draft_spec = SpeculativeConfig("draft", num_tokens=4, draft_model=q4)
sec_draft, g4 = timed(draft_spec)
st = g4.speculative
print(f"int4 draft, k=4: acceptance {st.acceptance_rate:.0%}, {st.tokens_per_forward:.2f} "
      f"tokens per target forward, c = {st.draft_s / max(sum(st.drafted_per_step), 1) / step_s:.2f}, "
      f"speedup {base / sec_draft:.2f}x (one run), same tokens: "
      f"{g4.token_ids == last[None].token_ids}")

# %% [markdown]
# What does an int4 draft buy when the target's weights are themselves dequantized Q4_1?
#
# - (a) acceptance near 100%, but each draft token costs a whole int4 decode step, so c is far from 0 and the speedup stays well below k + 1
# - (b) low acceptance: 4-bit weights make very different predictions
# - (c) the output changes, because the draft's distribution is not the target's
# - (d) drafting is free, because a quantized model reads no weights

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb09.explain_int4_draft", answer)

# %% [markdown]
# ## Takeaways
#
# - One forward verifies k drafts for about the price of one decode step while decode is memory-bound; rejection sampling keeps the target's exact distribution (greedy: the same tokens).
# - The gain is E[tokens] / (verify cost + k·c): cheap, often-right drafts (prompt lookup on copy-heavy tasks) win; slow or inaccurate drafts lose.
# - Batching and compute-bound verifiers erase the free FLOPs speculation spends.
#
# ## Further reading
#
# - Leviathan, Kalman, Matias. *Fast Inference from Transformers via Speculative Decoding.* ICML 2023. [arXiv:2211.17192](https://arxiv.org/abs/2211.17192)
# - Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper. *Accelerating Large Language Model Decoding with Speculative Sampling.* 2023. [arXiv:2302.01318](https://arxiv.org/abs/2302.01318)
# - Li, Wei, Zhang, Zhang. *EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty.* ICML 2024. [arXiv:2401.15077](https://arxiv.org/abs/2401.15077)
# - Yang, Ge, Wang, Jiao, Jiang, Yang, Majumder, Wei. *Inference with Reference: Lossless Acceleration of Large Language Models* (LLMA). 2023. [arXiv:2304.04487](https://arxiv.org/abs/2304.04487)
# - Saxena. *Prompt Lookup Decoding.* 2023. [github.com/apoorvumang/prompt-lookup-decoding](https://github.com/apoorvumang/prompt-lookup-decoding)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
