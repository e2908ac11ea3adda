# %% [markdown]
# # 07b · Solutions
#
# One reference answer per exercise of notebook 07b, each followed by its check. The stretch
# exercise's check starts two processes, a few seconds.

# %%
import math

import torch
import torch.distributed as dist

from llmlab import exercises
from llmlab.config import ModelConfig
from llmlab.models import resolve
from llmlab.parallel.comm import LLAMA2_70B

cfg = ModelConfig.from_file(resolve("smollm2-135m"))

# %% [markdown]
# ## Bytes per token
#
# 61 all-reduces of one hidden vector of 576 bfloat16 values (2 bytes each): two per layer for
# 30 layers, and one for the vocab-parallel embedding.

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
