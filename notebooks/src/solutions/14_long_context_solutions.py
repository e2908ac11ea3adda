# %% [markdown]
# # 14 · Solutions
#
# Each exercise of notebook 14 (long context) with a reference answer and its check.

# %%
import torch

from llmlab import exercises

# %% [markdown]
# ## Compute: Llama-3-8B's KV cache at 128k tokens
#
# Per token: 2 (K and V) × 32 layers × 8 KV heads × 128 × 2 bytes = 131,072 bytes = 128 KiB;
# times 131,072 tokens = 2^34 bytes = 16 GiB, as much as the model's weights.

# %%
gib_128k = 2 * 32 * 8 * 128 * 2 * 131072 / 2**30
print(gib_128k, exercises.check("nb14.kv_gib_128k", gib_128k))

# %% [markdown]
# ## Build: merge the partials
#
# Split s holds $e^{\mathrm{lse}_s}$ of the softmax's total mass $\sum_t e^{\mathrm{lse}_t}$, and
# $o_s$ is its keys' average weighted within the split; the whole average is the splits'
# averages weighted by their mass: $w_s = e^{\mathrm{lse}_s} / \sum_t e^{\mathrm{lse}_t}$. Subtract
# the largest lse before `exp` (the ratio does not change, nothing overflows); an empty split's
# $e^{-\infty - \max} = 0$.

# %%
def merge_splits(o, lse):
    top = lse.max(dim=0).values
    w = torch.exp(lse - top)
    return (w[..., None] * o).sum(dim=0) / w.sum(dim=0)[..., None]


print(exercises.check("nb14.lse_merge", merge_splits))

# %% [markdown]
# ## Explain: attention sinks
#
# (c): heads park surplus attention on the first tokens; evicting them moves that mass onto
# tokens never meant to carry it. The window-plus-sinks cache keeps the same window and
# recovers, which rules out (a) and (d); positions inside the cache rule out (b).

# %%
print(exercises.check("nb14.explain_sinks", "c"))

# %% [markdown]
# ## Stretch: one decode query of the sinks cache
#
# Kept: indices `0 .. sinks-1` and `n-window .. n-1` (without repeating a sink when the text
# is still short). Their cache positions are `0 .. c-1`; the query is the last kept token, at
# `c-1`.

# %%
def sinks_attention(q, k, v, sinks, window, rope):
    n = k.shape[1]
    start = min(n, max(sinks, n - window))          # the window, past the sinks
    kept = torch.cat([torch.arange(min(sinks, n)), torch.arange(start, n)])
    positions = torch.arange(kept.numel())
    keys = rope(k[:, kept], positions)
    query = rope(q, positions[-1:])
    group = q.shape[2] // k.shape[2]
    keys, values = keys.repeat_interleave(group, 2), v[:, kept].repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", query, keys) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values)


print(exercises.check("nb14.sinks_attention", sinks_attention))
