# %% [markdown]
# # 07 · Solutions
#
# One reference answer per exercise of notebook 07, each followed by its check. The checks of
# the build and stretch exercises start real processes, a few seconds each.

# %%
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmlab import exercises
from llmlab.config import ModelConfig
from llmlab.models import resolve
from llmlab.parallel.comm import LLAMA2_70B

cfg = ModelConfig.from_file(resolve("smollm2-135m"))

# %% [markdown]
# ## Warm-up: a column-parallel rank's rows
#
# A column-parallel layer splits the output features: the rows of the `[out, in]` weight, in
# `tp` equal contiguous blocks.

# %%
# NBVAL_CHECK_OUTPUT
def column_shard(weight, rank, tp):
    return torch.chunk(weight, tp, dim=0)[rank]


exercises.check("nb07.column_shard", column_shard)

# %% [markdown]
# ## Build: the column- and row-parallel forward passes
#
# The column layer needs nothing from the other ranks: its rows of W (and its part of the bias)
# give its slice of y. The row layer's product is a partial sum over this rank's input
# features; one all-reduce adds the partial sums, and the bias, which every rank holds whole,
# is added once, after the sum (added before it, it would be counted tp times).

# %%
# NBVAL_CHECK_OUTPUT
def column_parallel_forward(x, weight, bias):
    return F.linear(x, weight, bias)


def row_parallel_forward(x, weight, bias):
    y = F.linear(x, weight)
    dist.all_reduce(y)
    return y if bias is None else y + bias


exercises.check("nb07.tensor_parallel_linear", (column_parallel_forward, row_parallel_forward))

# %% [markdown]
# ## Predict: all-reduces per token
#
# Two per layer (after `o_proj` and after `down_proj`) for 30 layers, plus one for the
# vocab-parallel embedding: 61, whatever tp is (the notebook passes the count its run measured).

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb07.predict_allreduces", 2 * cfg.num_layers + 1)

# %% [markdown]
# ## Explain: why tp = 3 is slower here
#
# Each message is one hidden vector; the time goes to the fixed latency of 61 all-reduces per
# token, each waiting for three single-threaded ranks that share two cores.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb07.explain_cpu_slowdown", "b")

# %% [markdown]
# ## Bytes per token
#
# 61 all-reduces of one hidden vector of 576 bfloat16 values (2 bytes each).

# %%
# NBVAL_CHECK_OUTPUT
allreduce_bytes = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2
print(allreduce_bytes)
exercises.check("nb07.allreduce_bytes", allreduce_bytes)

# %% [markdown]
# ## Valid degrees
#
# Every common divisor of the head counts, the MLP width and the vocabulary size: the divisors
# of their greatest common divisor.

# %%
# NBVAL_CHECK_OUTPUT
g = math.gcd(math.gcd(LLAMA2_70B.num_heads, LLAMA2_70B.num_kv_heads),
             math.gcd(LLAMA2_70B.intermediate_size, LLAMA2_70B.vocab_size))
llama70b_degrees = [d for d in range(1, g + 1) if g % d == 0]
print(llama70b_degrees)
exercises.check("nb07.valid_degrees", llama70b_degrees)

# %% [markdown]
# ## Stretch: sequence-parallel RMSNorm
#
# Split the partial sum into tp blocks of tokens; the reduce-scatter sums block r over all
# ranks into rank r's output. RMSNorm is per token, so it then runs on this rank's tokens alone.

# %%
# NBVAL_CHECK_OUTPUT
def sequence_parallel_norm(partial, weight, eps):
    tp = dist.get_world_size()
    chunks = list(partial.contiguous().chunk(tp, dim=0))
    mine = torch.empty_like(chunks[0])
    dist.reduce_scatter(mine, chunks)
    return mine * torch.rsqrt(mine.pow(2).mean(-1, keepdim=True) + eps) * weight


exercises.check("nb07.sequence_parallel_norm", sequence_parallel_norm)
