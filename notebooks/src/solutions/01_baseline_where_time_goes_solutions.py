# %% [markdown]
# # 01 · Solutions
#
# Each exercise of notebook 01 with a reference answer and its check.

# %%
import math

import torch

from llmlab import exercises

# %% [markdown]
# ## Predict: naive attention's peak memory when N doubles
#
# The largest tensors of the call are the `[1, 9, N, N]` scores and their softmax; everything else
# is `[1, N, heads, 64]`. Doubling N multiplies them by 4. (Without the notebook's measurement
# passed in, the check measures it itself.)

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb01.predict_memory_growth", 4.0)

# %% [markdown]
# ## Predict: a no-cache step's intensity from L = 8 to L = 96
#
# A forward over L tokens reads each 4-byte weight once and uses it for a multiply and an add with
# every one of the L rows of its input: 2·L FLOPs per 4 bytes, about L/2 FLOP per byte. The
# intensity grows like L, so 96 tokens against 8 give about 96 / 8 = 12. The model's own factor is
# a little lower (the activations' bytes grow with L too, and the embedding table is used for the
# last token only); without the notebook's value passed in, the check computes it.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb01.predict_intensity_growth", 96 / 8)

# %% [markdown]
# ## Build: naive attention
#
# `repeat_interleave` along the head axis gives query head h the KV head h // group. The mask is
# aligned bottom-right: query i is position i + (n_k − n_q) of the keys. The softmax subtracts each
# row's maximum before `exp` (it does not change the result, and every exp is then at most 1, so a
# score of 100 does not overflow); a row always keeps at least one key, so its maximum is finite.

# %%
# NBVAL_CHECK_OUTPUT
def naive_attention(q, k, v, causal=True):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                     # [b, heads, n_k, d]
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [b, heads, n_q, n_k]
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_k)[None, :]
        scores = scores.masked_fill(j > i + (n_k - n_q), float("-inf"))
    scores = scores - scores.amax(dim=-1, keepdim=True)       # shift: every exp is <= 1
    weights = torch.exp(scores)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v


exercises.check("nb01.naive_attention", naive_attention)

# %% [markdown]
# ## Compute: one score matrix; exercise 1

# %%
# NBVAL_CHECK_OUTPUT
print(exercises.check("nb01.score_bytes", 1 * 9 * 8192 * 8192 * 4))   # [batch, heads, N, N] · 4 bytes
P, T = 30, 100
print(exercises.check("nb01.token_passes", sum(P + t for t in range(T))))

# %% [markdown]
# ## Stretch: attention with a key-padding mask
#
# The padding mask `[b, n_k]` broadcasts to `[b, 1, 1, n_k]` and is combined with the causal mask.
# Masked scores get the most negative finite float: a padding query whose keys are all masked then
# gets uniform weights instead of NaN.

# %%
# NBVAL_CHECK_OUTPUT
def padded_attention(q, k, v, key_padding_mask, causal=True):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = key_padding_mask[:, None, None, :]
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        allowed = allowed & (torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q))
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


exercises.check("nb01.padded_attention", padded_attention)
