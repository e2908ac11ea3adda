# %% [markdown]
# # 06 · Solutions

# %%
# NBVAL_CHECK_OUTPUT
import math

import torch

from llmlab.exercises.nb06 import check_active_params, check_capacity, check_group_by_expert


def active_params(config):
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o and k, v
    experts = config.num_experts_per_tok * 3 * h * config.intermediate_size
    router = h * config.num_experts
    per_layer = attention + experts + router + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + embeddings + h


check_active_params(active_params)

# %%
# NBVAL_CHECK_OUTPUT
def capacity(tokens, num_experts, top_k, capacity_factor):
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


check_capacity(capacity)

# %%
# NBVAL_CHECK_OUTPUT
def group(experts, num_experts):
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    return order, offsets


check_group_by_expert(group)
