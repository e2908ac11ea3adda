# %% [markdown]
# # 07 · Tensor parallelism: solutions to the exercises

# %%
import math

import torch

from llmlab.config import ModelConfig
from llmlab.exercises.nb07 import check_allreduce_bytes, check_column_shard, check_valid_degrees
from llmlab.models.registry import resolve
from llmlab.parallel.comm import LLAMA2_70B

cfg = ModelConfig.from_file(resolve("smollm2-135m"))

# %% [markdown]
# **Exercise 1.** A column-parallel layer splits the output features: the rows of the
# `[out, in]` weight, in `tp` equal contiguous blocks.

# %%
# NBVAL_CHECK_OUTPUT
def column_shard(weight, rank, tp):
    return torch.chunk(weight, tp, dim=0)[rank]


ok = check_column_shard(column_shard)

# %% [markdown]
# **Exercise 2.** Two all-reduces per layer (after `o_proj` and after `down_proj`), one for the
# vocab-parallel embedding, each one hidden vector of 576 bfloat16 values. The count does not
# depend on tp; only what each rank sends in the ring does.

# %%
# NBVAL_CHECK_OUTPUT
allreduce_bytes = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2
print(allreduce_bytes)
ok = check_allreduce_bytes(allreduce_bytes)

# %% [markdown]
# **Exercise 3.** Every common divisor of the head counts, the MLP width and the vocabulary
# size: the divisors of their greatest common divisor.

# %%
# NBVAL_CHECK_OUTPUT
g = math.gcd(math.gcd(LLAMA2_70B.num_heads, LLAMA2_70B.num_kv_heads),
             math.gcd(LLAMA2_70B.intermediate_size, LLAMA2_70B.vocab_size))
llama70b_degrees = [d for d in range(1, g + 1) if g % d == 0]
print(llama70b_degrees)
ok = check_valid_degrees(llama70b_degrees)
