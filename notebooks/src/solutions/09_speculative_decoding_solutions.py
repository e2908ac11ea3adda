# %% [markdown]
# # 09 · Solutions
#
# One reference answer per exercise of notebook 09, each followed by its check.

# %%
import torch

from llmlab import exercises

# %% [markdown]
# ## Build: the accept/reject step
#
# Walk the drafts in order. Draft d at position i is accepted when u < p_i(d)/q_i(d) for a
# uniform u (written u·q < p, which needs no division). At the first rejection the token comes
# from (p_i − q_i)⁺ normalized: where the target wants more than the draft offered. That
# residual is never all zero after a rejection, because a rejection is only possible where
# p_i(d) < q_i(d), and then p_i puts more than q_i on some other token. If all k drafts pass,
# the bonus token comes from p_k.

# %%
def accept_reject(p, q, drafts, generator=None):
    out = []
    for i, d in enumerate(drafts):
        if torch.rand((), generator=generator) * q[i, d] < p[i, d]:
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out


exercises.check("nb09.accept_reject", accept_reject)

# %% [markdown]
# ## Build: one speculative step
#
# Draft first, then feed the last emitted token and the drafts to the target in one forward:
# row i of its logits is the target's choice after input i, so draft i + 1 is checked by row i,
# and after n accepted drafts row n is the next token (a correction, or the bonus when n = k).
# The forward wrote the K/V of all k + 1 inputs; the step keeps t and the n accepted drafts
# (the emitted token after them has no K/V yet: the next step feeds it) and truncates the rest.

# %%
def speculative_step(model, cache, seq, draft, k):
    drafts = [int(d) for d in draft(seq, k)][:k]
    ids = torch.tensor([[seq[-1]] + drafts], dtype=torch.long, device=model.device)
    start = cache.length
    positions = cache.begin(ids.shape[1])
    logits = model.step(ids, positions, cache)[0]           # [len(drafts) + 1, vocab]
    cache.advance()
    target = logits.argmax(-1).tolist()                     # the target's token after each
    emitted = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            break
        emitted.append(d)
    n = len(emitted)
    emitted.append(target[n])         # the correction at the first mismatch, or the bonus
    cache.truncate(start + n + 1)     # keep t and the accepted drafts; forget the rest
    return emitted


exercises.check("nb09.speculative_step", speculative_step)

# %% [markdown]
# ## Predict: which k is best?
#
# With the cost model, k grows while the k-th draft's expected tokens α^k outweigh what it
# costs. Prompt lookup drafts for free, but on a CPU the verify forward of k + 1 tokens is not
# free either (the notebook measures v(k + 1)), and on an edit answer the match breaks at every corrected word, so the last
# drafts of a long run are often rejected. The notebook compares your answer with its
# measurement; here, without one, the check uses the cost model at α = 0.8 and c = 0.15.

# %%
exercises.check("nb09.predict_best_k", 4)

# %% [markdown]
# ## Predict: the batch at which speculation stops paying
#
# A verify at batch B feeds 5·B tokens per weight read, about 5·B times the intensity of one
# decode token; it stays near one decode step's time until it crosses the ridge point, and it
# loses once it costs more than E[tokens] = 3.36 decode steps. Past the ridge point R, with a
# decode token's intensity I₁, the ratio verify / decode is about 5·B·I₁ / R, so the smallest
# losing batch is the first power of two above 3.36·R / (5·I₁). The notebook passes its run's
# speedups; here, without a run, the check uses one recorded run of the model.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb09.predict_batching_breakeven", 32)

# %% [markdown]
# ## Stretch: early exit on SmolLM2

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb09.explain_early_exit", "b")
