# %% [markdown]
# # 08 · Solutions
#
# One reference answer per exercise of notebook 08, each followed by its check.

# %%
import torch

from llmlab import exercises

# %% [markdown]
# ## Build: group-wise quantize and dequantize
#
# Reshape each row into groups of consecutive inputs, take each group's minimum and range,
# divide the range into 2^bits − 1 steps (16 codes make 15 steps), round to the nearest code.
# Dequantizing repeats d and m over the group. A constant group has d = 0: its codes are all 0
# and m restores it.

# %%
def group_quantize(w, bits=4, group_size=32):
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    m = g.amin(dim=-1)
    d = (g.amax(dim=-1) - m) / (2 ** bits - 1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp(0, 2 ** bits - 1)
    return q.to(torch.uint8).reshape(out_f, in_f), d, m


def group_dequantize(q, d, m):
    out_f, in_f = q.shape
    g = q.float().reshape(out_f, d.shape[1], -1)
    return (g * d[..., None] + m[..., None]).reshape(out_f, in_f)


exercises.check("nb08.group_quantize", (group_quantize, group_dequantize))

# %% [markdown]
# ## Predict: the int4 speedup
#
# The bound is the ratio of weight bytes, about 5.6× (4-bit codes plus a step and a minimum
# per 32 weights, the Q8_0 lm_head, float32 norms). A measured speedup falls below it: the
# per-layer Python, the bfloat16 conversions, attention and the norms do not shrink. Without a
# measurement the check compares with the bound.

# %%
exercises.check("nb08.predict_int4_speedup", 5.5)

# %% [markdown]
# ## Explain: group size

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb08.explain_group_size", "b")

# %% [markdown]
# ## Stretch: the cost of a Q4_1 block
#
# 16 bytes of codes + 2 bytes of d + 2 bytes of m = 20 bytes per 32 weights.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb08.q4_1_bytes_per_weight", 20 / 32)
