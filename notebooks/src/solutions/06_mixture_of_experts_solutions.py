# %% [markdown]
# # 06 · Solutions
#
# One reference answer per exercise of notebook 06, each followed by its check.

# %%
import math

import torch
import torch.nn.functional as F

from llmlab import exercises
from llmlab.viz.moe import explore_routing

# %% [markdown]
# ## Build: routing and grouped dispatch
#
# Softmax in float32, top-k, and the k weights divided by their sum. Then the flattened pairs
# (pair 2t + j is token t's j-th choice) are sorted by expert; a stable sort keeps tokens in
# order inside an expert. `bincount` counts each expert's pairs and a cumulative sum with a
# leading 0 turns the counts into offsets. Each expert runs once on its slice, and the weights,
# sorted with the same `order`, scale its rows before they are added back to their tokens.

# %%
# NBVAL_CHECK_OUTPUT
def moe_dispatch(x, router_logits, top_k, w_gate, w_up, w_down):
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate.shape[0])
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    token = order // top_k                       # the token of each sorted pair
    rows, row_weights = x[token], weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        if a == b:                               # nobody chose this expert
            continue
        h = F.silu(rows[a:b] @ w_gate[e].T) * (rows[a:b] @ w_up[e].T)
        out.index_add_(0, token[a:b], (h @ w_down[e].T) * row_weights[a:b, None].to(x.dtype))
    return out


exercises.check("nb06.moe_dispatch", moe_dispatch)

# %% [markdown]
# ## Explain: the balance loss near its uniform value
#
# Because Σᵢ fᵢ = Σᵢ Pᵢ = 1, α · N · Σᵢ fᵢ · Pᵢ = α + α · N · Σᵢ (fᵢ − 1/N)(Pᵢ − 1/N): the excess
# over α is a product of how far each expert's load share and its mean probability are from
# uniform. Top-k sends each token to its two largest probabilities however small their lead,
# so the counts spread several times more than the mean probabilities do, and the product
# stays small. Its gradient with respect to Pᵢ is α · N · fᵢ, so training still pushes the
# busy experts down.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb06.explain_balance_loss", "c")

# %% [markdown]
# ## Predict, then measure: drops with an unbiased router
#
# Each expert expects 512 · 2 / 8 = 128 assignments; with random routing its load is a binomial
# count with a standard deviation of about √(1024 · 1/8 · 7/8) ≈ 11. Roughly half the experts
# land above 128 by a fraction of that: a few percent of the assignments overflow.

# %%
# NBVAL_CHECK_OUTPUT
_, unbiased = explore_routing(num_experts=8, top_k=2, capacity_factor=1.0, tokens=512, skew=0.0,
                              show=False)
print(f"measured: {100 * unbiased.drop_fraction:.1f}% dropped")
exercises.check("nb06.predict_drops", 5, measured=100 * unbiased.drop_fraction)

# %% [markdown]
# ## Active parameters

# %%
# NBVAL_CHECK_OUTPUT
def active_params(config):
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o and k, v
    experts = config.num_experts_per_tok * 3 * h * config.intermediate_size
    router = h * config.num_experts
    per_layer = attention + experts + router + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * per_layer + embeddings + h


exercises.check("nb06.active_params", active_params)

# %% [markdown]
# ## Stretch: capacity-factor dropping
#
# The capacity is ⌈cf · tokens · k / E⌉. Looping over the k choices outside and the tokens
# inside hands out slots to all first choices before any second choice.

# %%
# NBVAL_CHECK_OUTPUT
def keep_within_capacity(experts, num_experts, capacity_factor):
    tokens, k = experts.shape
    capacity = math.ceil(capacity_factor * tokens * k / num_experts)
    kept = torch.zeros(tokens, k, dtype=torch.bool)
    used = [0] * num_experts
    for slot in range(k):
        for t in range(tokens):
            e = int(experts[t, slot])
            if used[e] < capacity:
                used[e] += 1
                kept[t, slot] = True
    return kept


exercises.check("nb06.capacity_drop", keep_within_capacity)
