# %% [markdown]
# # 08 · Solutions
#
# One reference answer per exercise of notebook 08, each followed by its check.

# %%
import torch

from llmlab import exercises

# %% [markdown]
# ## Build: group-wise quantization and the matmul that reads it
#
# Reshape each row into groups of consecutive inputs, take each group's minimum and range,
# divide the range into 2^bits − 1 steps (16 codes make 15 steps), round to the nearest code.
# A constant group has d = 0: its codes are all 0 and m restores it.
#
# The matmul never builds Ŵ. With Ŵ = q·d + m per group, one output is
# y = Σ_groups (d · Σ_k x_k q_k + m · Σ_k x_k): per group, the partial dot product of x with the
# codes, times the group's step, plus the group's minimum times the sum of the group's inputs.
# (A kernel adds the codes' products in integers or registers and touches d and m once per
# group; llama.cpp's Q4_1 dot product has exactly this shape.)

# %%
def group_quantize(w, bits=4, group_size=32):
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    m = g.amin(dim=-1)
    d = (g.amax(dim=-1) - m) / (2 ** bits - 1)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp(0, 2 ** bits - 1)
    return q.to(torch.uint8).reshape(out_f, in_f), d, m


def group_matmul(x, q, d, m):
    out_f, in_f = q.shape
    groups = d.shape[1]
    xg = x.float().reshape(*x.shape[:-1], groups, in_f // groups)      # [..., G, g]
    qg = q.float().reshape(out_f, groups, in_f // groups)              # [out, G, g]
    partial = torch.einsum("...gk,ogk->...og", xg, qg)                 # [..., out, G]
    return (partial * d).sum(-1) + xg.sum(-1) @ m.T


exercises.check("nb08.group_quantize", (group_quantize, group_matmul))

# %% [markdown]
# ## Predict: the int4 speedup
#
# Amdahl's law on the float32 step's split: the time outside the matmuls stays, the matmuls'
# time shrinks with the bytes. With the notebook's measured split (passed to the check as
# `fp32_step_ms`, `outside_ms` and `bytes_ratio`) the same formula gives that run's answer;
# here, without a measurement, the check uses one recorded run's split.

# %%
from llmlab.exercises.nb08 import REFERENCE_STEP

step, rest, ratio = (REFERENCE_STEP[k] for k in ("fp32_step_ms", "outside_ms", "bytes_ratio"))
exercises.check("nb08.predict_int4_speedup", step / (rest + (step - rest) / ratio))

# %% [markdown]
# ## Predict: four formats ordered by KLD
#
# (b) first: groups of 32 along the input are the file's own Q4_1 blocks, so 4 bits there give
# the weights back exactly. Then (a): 8 bits make each step 17 times finer than 4 bits, more than
# any grouping gains. Then (c) before (d): a group's step follows its own range, so one large
# weight coarsens only its group of 64, not its whole row. The notebook passes its sweep; here
# the check uses one recorded sweep.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb08.predict_kld_order", "bacd")

# %% [markdown]
# ## Stretch: the cost of a Q4_1 block
#
# 16 bytes of codes + 2 bytes of d + 2 bytes of m = 20 bytes per 32 weights.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb08.q4_1_bytes_per_weight", 20 / 32)
