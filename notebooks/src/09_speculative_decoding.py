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
# times as much. And where a verify forward of k + 1 tokens costs more than a decode step,
# that extra is paid at every step (this notebook measures it).
#
# In this notebook you **build** one speculative step (draft, verify in one forward, accept,
# roll the cache back) and run SmolLM2 with it, after a warm-up on the accept/reject rule that
# makes sampling exact; then you measure which drafts are accepted, what a step costs here, and
# which number of drafts k pays off.

# %%
import os

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.device import describe
from llmlab.viz import spec as vspec

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
EOS = model.config.eos_token_id
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
# The three drafts of the library (`SpeculativeConfig.method`): `"ngram"` looks the last 1–3
# tokens up earlier in prompt + output and proposes what followed them (no model);
# `"early_exit"` runs the target's own first layers and its lm_head; `"draft"` runs any model
# with the same vocabulary. Here is llmlab's speculative generation on an edit prompt, a row
# per target forward:

# %%
g = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW,
                    speculative={"method": "ngram", "num_tokens": 4})
s = g.speculative
vspec.plot_timeline(s.accepted_per_step, s.drafted_per_step, num_tokens=s.num_generated)
plt.show()
print(f"{s.num_generated} tokens in {s.target_forwards} target forwards "
      f"({s.tokens_per_forward:.2f} per forward); acceptance {s.acceptance_rate:.0%}")
print(g.text)

# %% [markdown]
# Rows with a single blue box are plain decode steps: the n-gram lookup found nothing to
# propose. Long green runs are where the answer copies the prompt; a red box is a draft the
# target disagreed with (a corrected spelling, say), replaced by the target's own token.
#
# ## Warm-up: the accept/reject rule
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
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb09.accept_reject", accept_reject)

# %% [markdown]
# ## Build: one speculative step, inside SmolLM2
#
# Now the technique itself: write `speculative_step(model, cache, seq, draft, k)`, one greedy
# step of the How section, on the real model and its real KV cache.
#
# - `model`: SmolLM2, a `CausalLM`. `model.step(ids, positions, cache)` runs the decoder on
#   new tokens `ids [1, s]` (long) at `positions [1, s]` and returns logits `[1, s, vocab]`,
#   a row per input token: row i is the target's next-token logits after input token i.
# - `cache`: the target's `ContiguousKVCache` (notebook 02), batch 1. On entry it holds the
#   K/V of `seq[:-1]`, every token but the last. Its protocol: `positions = cache.begin(s)`
#   announces s new tokens and returns their positions; the forward writes their K/V;
#   `cache.advance()` commits them; `cache.length` counts the tokens held, and
#   `cache.truncate(length)` keeps the first `length` and forgets the rest.
# - `seq`: the prompt and the tokens emitted so far (a list of ints); `draft(seq, k)` returns
#   up to k guessed next tokens (fewer, or none, when the draft has nothing to propose).
# - Returns the tokens the step emits, as a list: the drafts the target agrees with, then
#   the target's own token. On return the cache must hold the K/V of `seq + emitted[:-1]`,
#   ready for the next step.
#
# The check runs SmolLM2's greedy generation with your step after the prefill
# (`nb09.generate_with_step` calls it until the answer ends), k = 4, with two drafts: one that
# knows the target's answer and spoils one token per step at a changing place (so every
# branch occurs), and prompt lookup. The tokens must equal plain greedy decoding; it also
# counts your target forwards and reads the cache's length after every step. llmlab's own
# speculative functions raise while it runs.

# %%
def speculative_step(model, cache, seq, draft, k):
    """One greedy speculative step: returns the emitted tokens (list of ints)."""
    # YOUR CODE HERE
    raise NotImplementedError


step_verdict = exercises.check("nb09.speculative_step", speculative_step)
step_verdict

# %% [markdown]
# Your step drives SmolLM2 on the edit prompt with prompt-lookup drafts. (Until it passes,
# the cell runs llmlab's speculative generation instead.)

# %%
from llmlab.exercises import nb09

prompt_ids = g.prompt_token_ids
if step_verdict.passed:
    yours, st = nb09.generate_with_step(speculative_step, model, prompt_ids, nb09.ngram_draft,
                                        k=4, max_new_tokens=NEW, eos_token_id=EOS)
    who = "your step"
else:
    lib = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW,
                          speculative={"method": "ngram", "num_tokens": 4})
    yours, st, who = lib.token_ids, lib.speculative, "llmlab's step (yours does not pass yet)"
plain = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW, kv_cache="contiguous")
vspec.plot_timeline(st.accepted_per_step, st.drafted_per_step, num_tokens=st.num_generated,
                    title=f"{who}: {st.num_generated} tokens in {st.target_forwards} target "
                          f"forwards (plain decoding: {len(plain.token_ids)})")
plt.show()
print(f"{who}: same tokens as plain greedy: {yours == plain.token_ids}")

# %% [markdown]
# **Compare with llmlab's.** `llmlab.speculative.speculative_token_ids` runs the same step for
# every draft method: it asks a drafter object for the drafts, verifies with one forward,
# decides with `verify` (for greedy, the comparison below; for sampling, the accept/reject
# rule of the warm-up), rolls back with `cache.truncate(cache.length - (n - n_acc))`, and
# tells a model draft to roll its own cache back too (`llmlab/speculative.py`, to read once your
# step passes).

# %% [markdown]
# ## Check (1): greedy speculation gives the same tokens
#
# Prompt lookup and early exit, a short and a long k, on the edit prompt and a chat prompt: the
# tokens equal plain KV-cache greedy decoding, token for token.

# %%
# NBVAL_CHECK_OUTPUT
configs = [("ngram", 2), ("ngram", 8), ("early_exit", 2)]
SHALLOW = 8                      # an early exit after 8 of SmolLM2's 30 layers


def spec_of(method, k, layers=SHALLOW):
    spec = {"method": method, "num_tokens": k}
    if method == "early_exit":
        spec["num_layers"] = layers
    return spec


for prompt in (EDIT, CHAT):
    ref = llmlab.generate(model, tok, prompt, max_new_tokens=24, kv_cache="contiguous")
    same = [llmlab.generate(model, tok, prompt, max_new_tokens=24,
                            speculative=spec_of(m, k)).token_ids == ref.token_ids
            for m, k in configs]
    print(f"{prompt[:30]!r}: identical tokens in all {len(configs)} configurations: {all(same)}")

# %% [markdown]
# ## Which drafts are accepted?
#
# Prompt lookup is accepted where the answer copies the prompt. An early exit is the target's
# own first n layers followed by its final norm and lm_head. How often does its greedy guess
# equal the target's? One forward over the edit prompt and its greedy answer gives every
# layer's hidden states; each depth's guess at each answer position is compared with the
# target's token there (the acceptance of a first draft, α), and at temperature 1 the
# sampling acceptance Σ min(p, q) of the warm-up's rule. A draft token of depth n reads
# about the weights of n layers and the lm_head: c(n) ≈ their bytes over the whole model's
# (a model; the shared lm_head is 49,152 × 576 weights, a fifth of SmolLM2).

# %%
from llmlab.speculative import cost_model_speedup, expected_tokens, probabilities

text = torch.tensor([plain.prompt_token_ids + plain.token_ids])
answer = slice(len(plain.prompt_token_ids) - 1, text.shape[1] - 1)    # rows that predict it
hidden = {}
hooks = [layer.register_forward_hook(lambda mod, a, out, i=i: hidden.__setitem__(i + 1, out))
         for i, layer in enumerate(model.layers)]
with torch.inference_mode():
    target_logits = model(text)[0, answer]
for h in hooks:
    h.remove()
layer_w = sum(p.numel() for p in model.layers[0].parameters())
head_w = model.lm_head.weight.numel()
n_layers = model.config.num_layers
depths = [2, 4, 8, 12, 16, 20, 22, 24, 26, 28, 29]
sweep = []
with torch.inference_mode():
    p_t = probabilities(target_logits, 1.0)
    for d in depths:
        exit_logits = model.lm_head(model.norm(hidden[d][0, answer]))
        alpha = (exit_logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
        sampled = torch.minimum(p_t, probabilities(exit_logits, 1.0)).sum(-1).mean().item()
        c = (d * layer_w + head_w) / (n_layers * layer_w + head_w)
        sweep.append({"depth": d, "alpha": alpha, "alpha_T1": sampled, "c": c,
                      "model_k2": cost_model_speedup(expected_tokens(alpha, 2), 2, c)})
for r in sweep:
    print(f"exit after {r['depth']:2d} layers: greedy α {r['alpha']:.2f}, at T=1 "
          f"{r['alpha_T1']:.2f}, c ≈ {r['c']:.2f}, cost model at k=2 (free verify) "
          f"{r['model_k2']:.2f}x")
fig, ax = plt.subplots(figsize=(7, 3.2), dpi=80)
ax.plot(depths, [r["alpha"] for r in sweep], "o-", label="greedy acceptance α")
ax.plot(depths, [r["alpha_T1"] for r in sweep], "s--", label="acceptance at T = 1")
ax.plot(depths, [r["c"] for r in sweep], ":", color="gray", label="c: cost per draft token")
ax.plot(depths, [r["model_k2"] for r in sweep], "^-", label="cost model speedup, k = 2")
ax.axhline(1, color="k", lw=0.5)
ax.set(xlabel="early exit after n layers", ylabel="fraction / speedup",
       title=f"SmolLM2 early exits on the edit answer ({len(plain.token_ids)} positions)")
ax.legend(fontsize=7)
plt.show()

# %%
accepting = [r for r in sweep if r["alpha"] >= 0.25]
shallow = [r for r in sweep if r["depth"] <= SHALLOW]
best_depth = max(sweep, key=lambda r: r["model_k2"])
DEEP = accepting[0]["depth"] if accepting else depths[-1]
display(Markdown(
    f"Cut after {SHALLOW} layers or fewer, the early exit agrees with the target at "
    f"{max(r['alpha'] for r in shallow):.0%} of the positions at most. Agreement first "
    f"reaches a quarter at {DEEP} of {n_layers} layers, where a draft token costs "
    f"c ≈ {next(r['c'] for r in sweep if r['depth'] == DEEP):.2f} of a step. Even with a "
    f"free verify the best depth ({best_depth['depth']}) models "
    f"{best_depth['model_k2']:.2f}x at k = 2. SmolLM2's layers were not trained to be read "
    "early. LayerSkip (Elhoushi et al., ACL 2024) trains for it (layer dropout and an "
    "early-exit loss shared by all layers) and reports 1.34–2.16× with early-exit drafts on "
    "Llama models."))

# %% [markdown]
# ## Sampling at T > 0 on SmolLM2
#
# The warm-up tested the rule on a 5-token toy. Here it runs on SmolLM2 itself. First, one
# position of the edit answer: the target's distribution p at temperature 1 (top 64 tokens,
# the sampler's own filter) and the deep early exit's q; 50,000 one-draft steps of llmlab's
# `accept_reject` must emit tokens distributed as p, however different q is (the position is
# the one where p and q overlap closest to half, so that both branches of the rule run often).
# Then whole sampled generations at temperature 0.5 with prompt-lookup drafts.

# %%
from llmlab import speculative
from llmlab.exercises.nb09 import chi2_pvalue

with torch.inference_mode():
    deep_logits = model.lm_head(model.norm(hidden[DEEP][0, answer]))
p64 = probabilities(target_logits, 1.0, top_k=64)
q64 = probabilities(deep_logits, 1.0, top_k=64)
pos = int((torch.minimum(p64, q64).sum(-1) - 0.5).abs().argmin())
p_full, q_full = p64[pos], q64[pos]
support = torch.nonzero((p_full > 0) | (q_full > 0)).squeeze(-1)   # both are 0 elsewhere
p1, q1 = p_full[support], q_full[support]
n_draws, width = 50_000, len(support)
gen = torch.Generator().manual_seed(0)
drafts = torch.multinomial(q1, n_draws, replacement=True, generator=gen)[:, None]
num_acc, nxt = speculative.accept_reject(p1.expand(n_draws, 2, width),
                                         q1.expand(n_draws, 1, width), drafts, gen)
first = torch.where(num_acc >= 1, drafts[:, 0], nxt)
print(f"answer position {pos}: {width} tokens where p or q is non-zero; acceptance "
      f"{(num_acc >= 1).float().mean():.2f} (Σ min(p, q) = {torch.minimum(p1, q1).sum():.2f})")
print(f"chi-square p-value of the emitted tokens against p: "
      f"{chi2_pvalue(torch.bincount(first, minlength=width), p1):.2g} (> 0.001: same distribution)")
print(f"the same test against the draft's q: "
      f"{chi2_pvalue(torch.bincount(first, minlength=width), q1):.0e}")

# %%
sampled_runs = []
for seed in range(3):
    spec_run = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW, temperature=0.5, seed=seed,
                               speculative={"method": "ngram", "num_tokens": 4})
    sampled_runs.append(spec_run.speculative)
    print(f"T=0.5, seed {seed}: {spec_run.speculative.num_generated} tokens in "
          f"{spec_run.speculative.target_forwards} target forwards, acceptance "
          f"{spec_run.speculative.acceptance_rate:.0%}: {spec_run.text[:70]!r}...")
print(f"greedy, for comparison: acceptance {s.acceptance_rate:.0%}, "
      f"{s.tokens_per_forward:.2f} tokens per forward")

# %% [markdown]
# ## Predict, then measure: which k is best?
#
# Each draft is accepted with some probability α, but draft i counts only if all before it were
# (α^i), so a step yields E[tokens] = 1 + α + … + α^k. Every draft costs c target steps to make
# (for n-gram lookup, almost nothing), and verifying k + 1 tokens costs some number v(k + 1) of
# decode steps: about one *where decode is memory-bound*. The cost model (Leviathan et al.):
# speedup ≈ E[tokens] / (v(k + 1) + k·c).
#
# Before the next cells run: for **n-gram drafts on the edit prompt**, which k in {1, 2, 4, 8}
# will be fastest on this machine?

# %%
my_best_k = ...  # YOUR ANSWER: 1, 2, 4 or 8

# %% [markdown]
# ## Measure (1): what does a verify forward cost?
#
# v(s) is measured directly: forwards of s = 1 … 9 new tokens on SmolLM2's cache at the edit
# prompt's length, interleaved, the median of several, over the median of s = 1 (a decode
# step); then the same for the model's weight matmuls alone (the lm_head included) with s
# rows, and the prefill of the prompt, which both sides of the comparison below pay once.

# %%
import statistics
import time

import numpy as np

from llmlab.cache import ContiguousKVCache
from llmlab.kernels import cpu_gemv
from llmlab.quant.linear import GEMV_MAX_ROWS

FEW_ROWS = cpu_gemv.available()          # llmlab's C kernel for a few rows (needs a C compiler)
WIDTHS = [1, 2, 3, 5, 9]
REPEATS = 5
ctx = torch.tensor([plain.prompt_token_ids])
cache = ContiguousKVCache.for_model(model, 1, ctx.shape[1] + max(WIDTHS))
weights = [mod.weight for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
fwd_s = {w: [] for w in WIDTHS}
mm_s = {w: [] for w in WIDTHS}
gemv_s = {w: [] for w in WIDTHS}
prefill_s = []
with torch.inference_mode():
    for rep in range(REPEATS + 1):                                 # the first is a warm-up
        cache.reset()
        t = time.perf_counter()
        model(ctx, positions=cache.begin(ctx.shape[1]), cache=cache, last_only=True)
        cache.advance()
        prefill_s.append(time.perf_counter() - t)
        for w in WIDTHS:
            ids = ctx[:, -w:]
            t = time.perf_counter()
            model(ids, positions=cache.begin(w), cache=cache)       # all rows, as a verify
            cache.advance()
            dt = time.perf_counter() - t
            cache.truncate(ctx.shape[1])
            xs = {m.shape[1]: torch.randn(w, m.shape[1]) for m in weights}
            t = time.perf_counter()
            for m in weights:
                torch.nn.functional.linear(xs[m.shape[1]], m)
            t_mm = time.perf_counter() - t
            if FEW_ROWS and w <= GEMV_MAX_ROWS:
                t = time.perf_counter()
                for m in weights:
                    cpu_gemv.f32_gemv(xs[m.shape[1]], m)
                if rep:
                    gemv_s[w].append(time.perf_counter() - t)
            if rep:
                fwd_s[w].append(dt)
                mm_s[w].append(t_mm)
t1 = statistics.median(fwd_s[1])
verify_cost = {w: statistics.median(fwd_s[w]) / t1 for w in WIDTHS}
prefill_steps = statistics.median(prefill_s[1:]) / t1
fwd_ms = {w: statistics.median(fwd_s[w]) * 1e3 for w in WIDTHS}
mm_ms = {w: statistics.median(mm_s[w]) * 1e3 for w in WIDTHS}
gemv_ms = {w: statistics.median(v) * 1e3 for w, v in gemv_s.items() if v}
for w in WIDTHS:
    few = f", through llmlab's f32_gemv {gemv_ms[w]:5.1f} ms" if w in gemv_ms else ""
    print(f"{w} token(s): forward {fwd_ms[w]:6.1f} ms (min-max {min(fwd_s[w]) * 1e3:.1f}-"
          f"{max(fwd_s[w]) * 1e3:.1f}) = {verify_cost[w]:.2f} decode steps; the "
          f"{len(weights)} weight matmuls alone {mm_ms[w]:6.1f} ms{few}")
print(f"prefill of the {ctx.shape[1]}-token prompt: {prefill_steps:.1f} decode steps")
extra = {w: fwd_ms[w] - fwd_ms[1] for w in WIDTHS if w > 1}
mm_share = {w: (mm_ms[w] - mm_ms[1]) / extra[w] if extra[w] > 0 else float("nan") for w in extra}
jump = next((w for w in WIDTHS if mm_ms[w] > 1.3 * mm_ms[1]), None)
text = (f"On this machine a verify forward of 2 tokens costs **{verify_cost[2]:.2f}** decode "
        f"steps and one of 9 tokens {verify_cost[9]:.2f}. The batch-1 model of speculative "
        "decoding says a verify of a few tokens reads the weights once and so costs about one "
        f"decode step. From one token to two the forward grows by {extra[2]:.0f} ms, and the "
        f"weight matmuls carry {mm_share[2]:.0%} of that; ")
if jump is not None:
    text += (f"the matmuls stay within 30% of their one-row time up to {WIDTHS[WIDTHS.index(jump) - 1]} "
             f"rows, then take {mm_ms[jump]:.0f} ms at {jump} rows against {mm_ms[1]:.0f} ms at "
             f"one, for the same bytes: the matrix library changing its method with the row "
             f"count (notebook 02's batch sweep measured such a switch on the LM head alone). "
             f"That switch carries {mm_share[jump]:.0%} of the extra time at {jump} tokens. It is "
             "a property of this CPU's BLAS, not of speculative decoding, and a verify step pays "
             "it at every step: the cost model below prices it in as v(k + 1).")
else:
    text += ("the matmuls stay within 30% of their one-row time at every width measured, so "
             "here the verify's extra time is the rest of the forward (attention over the "
             "cache, norms, rotary, the operators' own overhead).")
if 1 in gemv_ms and 5 in gemv_ms:
    text += (f" A kernel that reads the weights once for a few rows, llmlab's `f32_gemv` "
             f"(notebook 11's compiled step uses it), takes {gemv_ms[1]:.0f} ms for one row and "
             f"{gemv_ms[5]:.0f} ms for five: {gemv_ms[5] / gemv_ms[1]:.2f}×, against the "
             f"library's {mm_ms[5] / mm_ms[1]:.2f}×.")
display(Markdown(text))

# %% [markdown]
# ## Measure (2): acceptance and speedup per k and method
#
# Each configuration runs the edit prompt several times (the median is used, min–max drawn)
# against plain KV-cache greedy, interleaved so that a change in the machine's load hits all
# alike (the deep early exit runs once: it is slow, and its loss is far larger than the
# noise). c is the draft's measured time per drafted token over one decode step. The dashed
# cost model prices each step of the run as it happened, with the measured v of the cell
# above: v(d + 1) + d·c decode steps for a step that verified d drafts (d is below k where the
# lookup found fewer), against one decode step per token, the prefill paid by both.

# %%
timed_configs = [("ngram", 1), ("ngram", 2), ("ngram", 4), ("ngram", 8), ("early_exit", 2)]


def spec_for(c):
    return None if c is None else spec_of(*c, layers=DEEP)


def timed(spec):
    t = time.perf_counter()
    out = llmlab.generate(model, tok, EDIT, max_new_tokens=NEW, kv_cache="contiguous",
                          speculative=spec)
    return time.perf_counter() - t, out


RUNS = 3                         # whole generations per configuration
timed(None), timed(spec_of("ngram", 4))                               # warm-up
times = {c: [] for c in [None] + timed_configs}
last = {}
for rep in range(RUNS):
    for c in times:
        if c is not None and c[0] == "early_exit" and rep >= 1:
            continue                            # one run: its loss is far above the noise
        sec, last[c] = timed(spec_for(c))
        times[c].append(sec)
base = statistics.median(times[None])


def verify_steps(width):
    """v(width) in decode steps, interpolated between the measured widths."""
    return float(np.interp(width, WIDTHS, [verify_cost[w] for w in WIDTHS]))


def modelled(stats, c, free_verify=False):
    """The run's own steps, each at v(drafted + 1) + drafted·c decode steps, against one
    step per token; the prefill is paid by both."""
    steps = sum((1.0 if free_verify else verify_steps(d + 1)) + d * c
                for d in stats.drafted_per_step)
    plain_steps = stats.num_generated - 1                  # the prefill gives the first
    return (prefill_steps + plain_steps) / (prefill_steps + steps)


grid = {}
for m, k in timed_configs:
    st = last[(m, k)].speculative
    c = st.draft_s / max(sum(st.drafted_per_step), 1) / t1
    ratios = [base / t for t in times[(m, k)]]
    grid[(m, k)] = {"speedup": base / statistics.median(times[(m, k)]), "lo": min(ratios),
                    "hi": max(ratios), "accept": st.acceptance_rate,
                    "tok/fwd": st.tokens_per_forward, "c": c, "v": verify_steps(k + 1),
                    "model": modelled(st, c), "model_free": modelled(st, c, free_verify=True),
                    "accepted_per_step": st.accepted_per_step,
                    "drafted_per_step": st.drafted_per_step}
print(f"KV-cache greedy: {len(last[None].token_ids) / base:.1f} tok/s (median of {RUNS})")
for (m, k), r in grid.items():
    print(f"{m:10s} k={k}: acceptance {r['accept']:.0%}, {r['tok/fwd']:.2f} tok/forward, "
          f"c={r['c']:.3f}, v={r['v']:.2f}, speedup {r['speedup']:.2f}x (min-max "
          f"{r['lo']:.2f}-{r['hi']:.2f}, {len(times[(m, k)])} runs), cost model {r['model']:.2f}x "
          f"(with a free verify: {r['model_free']:.2f}x)")
vspec.plot_speedup_vs_k([dict(v, method=m, k=k) for (m, k), v in grid.items()])
plt.suptitle(f"edit prompt, {len(last[None].token_ids)} new tokens, early exit after {DEEP} "
             f"layers, measured on {describe()['device']}", fontsize=9)
plt.show()

# %%
from llmlab.profiling import compare

measured_ngram = {k: grid[("ngram", k)]["speedup"] for k in (1, 2, 4, 8)}
ngram_times = {k: times[("ngram", k)] for k in (1, 2, 4, 8)}
fastest = max(measured_ngram, key=measured_ngram.get)
for k in (1, 2, 4, 8):
    if k != fastest:
        print(f"k={k} against k={fastest}:", compare(ngram_times[fastest], ngram_times[k],
                                                     f"k={fastest}", f"k={k}").sentence())
exercises.check("nb09.predict_best_k", my_best_k, measured=measured_ngram, times=ngram_times)

# %% [markdown]
# The gap between the measurement and the cost model, with the measured verify cost and with
# a free one, and the loop's own time per step outside the target's forwards and the drafting
# (comparing, rolling back, Python), from the last run of each configuration:

# %%
loop_steps = {}
for (m, k), r in grid.items():
    st = last[(m, k)].speculative
    wall = times[(m, k)][-1]
    loop_steps[(m, k)] = max(wall - st.target_s - st.draft_s, 0.0) / st.num_steps / t1
    print(f"{m:10s} k={k}: measured / cost model = {r['speedup'] / r['model']:.2f} "
          f"(with a free verify: {r['speedup'] / r['model_free']:.2f}); loop outside the "
          f"forwards: {loop_steps[(m, k)]:.3f} decode steps per step")
ng = [grid[("ngram", k)] for k in (1, 2, 4, 8)]
free_gap = [r["speedup"] / r["model_free"] for r in ng]
full_gap = [r["speedup"] / r["model"] for r in ng]
ee = grid[("early_exit", 2)]
flat = max(free_gap) / min(free_gap) < 1.3
display(Markdown(
    f"With a free verify the cost model is off by a factor {min(free_gap):.2f}–"
    f"{max(free_gap):.2f} for prompt lookup"
    + (", about the same at every k: a cost paid once per step, whatever the number of "
       "drafts, which is the verify's fixed cost measured above. " if flat else
       ", a factor that changes with k. ")
    + f"Priced with the measured v, the ratio is {min(full_gap):.2f}–{max(full_gap):.2f}; the "
    f"loop's own work outside the forwards is {max(loop_steps.values()):.3f} of a decode step "
    f"per step at most. The deep early exit is accepted {ee['accept']:.0%} of the time but "
    f"costs c = {ee['c']:.2f} of a step per draft token: {ee['speedup']:.2f}x. Prompt lookup "
    f"drafts for almost nothing (c ≤ {max(r['c'] for r in ng):.3f}) and is accepted "
    f"{min(r['accept'] for r in ng):.0%}–{max(r['accept'] for r in ng):.0%} of the time on "
    "this copy-heavy answer."))

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
# ## Batching and speculation, on notebook 02's roofline
#
# A decode step at batch B feeds B tokens; a verify step feeds B·(k + 1). The curves below are
# the **roofline model** (time = max(FLOPs / peak, bytes / bandwidth)) with this machine's
# measured roofs, acceptance 0.8 and k = 4, a free draft: each verify yields E[tokens] per
# sequence, a decode step one.

# %%
from llmlab.profiling.roofline import Ceilings, forward_cost, measure_bandwidth, measure_matmul_flops

ceilings = Ceilings(measure_bandwidth(), measure_matmul_flops(), describe()["device"])
one_token = forward_cost(model.config, 1, 1, 256)
print(f"{ceilings.device}: {ceilings.bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
      f"{ceilings.peak_flops_per_s / 1e9:.0f} GFLOP/s, ridge point {ceilings.ridge_point:.1f} "
      f"FLOP/byte; a decode step at batch 1 (256 tokens of context): "
      f"{one_token.intensity:.2f} FLOP/byte; E[tokens] at α = 0.8, k = 4: "
      f"{expected_tokens(0.8, 4):.2f}")

# %% [markdown]
# **Predict, then measure.** At batch 1 speculation pays in this model. Of the batches 1, 2, 4,
# 8, 16, 32, 64 and 128, which is the smallest at which the model's speculation is *slower* than
# plain decoding (speedup below 1×)? Work it out from the three numbers printed above, then run
# the model.

# %%
my_batch = ...  # YOUR PREDICTION: one of 1, 2, 4, 8, 16, 32, 64, 128

# %%
rows = vspec.batching_model(model.config, ceilings, [1, 2, 4, 8, 16, 32, 64, 128], k=4,
                            alpha=0.8)
vspec.plot_batching(rows, ceilings, k=4, alpha=0.8)
plt.show()
for r in rows:
    print(f"batch {r['batch']:3d}: verify / decode time {r['verify_over_decode']:.2f}, "
          f"modelled speedup {r['speedup']:.2f}x")
exercises.check("nb09.predict_batching_breakeven", my_batch,
                speedups={r["batch"]: r["speedup"] for r in rows})

# %%
below = nb09.breakeven_batch({r["batch"]: r["speedup"] for r in rows})
display(Markdown(
    "At batch 1 both forwards sit far left of the ridge, on the memory roof, where the weight "
    "bytes set the time and the verify's extra tokens are nearly free. As the batch grows the "
    "points move right; past the ridge the verify's time grows with its FLOPs, up to k + 1 = 5 "
    f"decode steps, while it still yields {expected_tokens(0.8, 4):.2f} tokens per sequence. "
    + (f"In this run the modelled speedup first falls below 1× at batch {below}. " if below else
       "In this run the modelled speedup stays above 1× up to batch 128. ")
    + f"At batch 1 the model gives a verify of 5 tokens {rows[0]['verify_over_decode']:.2f} "
    f"decode steps; this machine measured {verify_steps(5):.2f} above, {mm_share[5]:.0%} of "
    "the difference in the weight matmuls alone, for the same bytes. The model knows only "
    "bytes and FLOPs, so it cannot see a library that reads the same weights more slowly "
    "for more rows. Its lesson is the shape: as the batch grows the verify's extra tokens "
    "stop being free, whatever the kernel."))

# %% [markdown]
# ## Stretch: early exit on SmolLM2
#
# The sweep above cut SmolLM2 at every depth, and the measurement ran its deep cut.

# %%
exercises.ask("nb09.explain_early_exit")

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb09.explain_early_exit", answer)

# %% [markdown]
# ## Takeaways
#
# - One step drafts k tokens, verifies them in one target forward, keeps the agreed prefix plus one token of the target's, and rolls the cache back; rejection sampling keeps the target's exact distribution (greedy: the same tokens).
# - The gain is E[tokens] / (v(k + 1) + k·c): cheap, often-right drafts (prompt lookup on copy-heavy tasks) win; slow or inaccurate drafts lose, and a verify that costs more than a decode step is paid at every step.
# - Batching and compute-bound verifiers erase the free FLOPs speculation spends.
#
# ## Further reading
#
# - Leviathan, Kalman, Matias. *Fast Inference from Transformers via Speculative Decoding.* ICML 2023. [arXiv:2211.17192](https://arxiv.org/abs/2211.17192)
# - Chen, Borgeaud, Irving, Lespiau, Sifre, Jumper. *Accelerating Large Language Model Decoding with Speculative Sampling.* 2023. [arXiv:2302.01318](https://arxiv.org/abs/2302.01318)
# - Li, Wei, Zhang, Zhang. *EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty.* ICML 2024. [arXiv:2401.15077](https://arxiv.org/abs/2401.15077)
# - Elhoushi, Shrivastava, Liskovich, et al. *LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding.* ACL 2024. [arXiv:2404.16710](https://arxiv.org/abs/2404.16710)
# - Yang, Ge, Wang, Jiao, Jiang, Yang, Majumder, Wei. *Inference with Reference: Lossless Acceleration of Large Language Models* (LLMA). 2023. [arXiv:2304.04487](https://arxiv.org/abs/2304.04487)
# - Saxena. *Prompt Lookup Decoding.* 2023. [github.com/apoorvumang/prompt-lookup-decoding](https://github.com/apoorvumang/prompt-lookup-decoding)
# - Williams, Waterman, Patterson. *Roofline: An Insightful Visual Performance Model for Multicore Architectures.* CACM 52(4), 2009. [doi:10.1145/1498765.1498785](https://doi.org/10.1145/1498765.1498785)
