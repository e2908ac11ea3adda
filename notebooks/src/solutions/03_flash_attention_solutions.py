# %% [markdown]
# # 03 · Solutions
#
# One reference answer per exercise of notebook 03, each followed by its check.

# %%
import math

import torch

import llmlab
from llmlab import exercises

# %% [markdown]
# ## Exercise 1: one online-softmax step
#
# The new maximum is the larger of the old one and this block's; the old sum and accumulator
# were exponentiated against the old maximum, so both are multiplied by exp(m − m_new).

# %%
# NBVAL_CHECK_OUTPUT
def online_softmax_step(m, l, acc, scores, v_block):
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)                 # shrink what was summed against the old max
    p = torch.exp(scores - m_new[..., None])
    return m_new, alpha * l + p.sum(dim=-1), alpha[..., None] * acc + p @ v_block


exercises.check("nb03.online_softmax_step", online_softmax_step)

# %% [markdown]
# ## Exercise 2: the tiled forward
#
# The query heads that share a KV head are reshaped side by side, so K and V are broadcast,
# never copied. Each block of query rows visits only the key blocks up to its last row's
# diagonal (bottom-right: offset n_k − n_q); the last blocks of both loops are cut with min().
# The largest temporary is one [block_m, block_n] tile per head.

# %%
def flash_forward(q, k, v, block_m, block_n, causal=True):
    b, h, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    qg = q.reshape(b, kv_heads, h // kv_heads, n_q, d) / math.sqrt(d)
    kg, vg = k[:, :, None], v[:, :, None]        # [b, kv_heads, 1, n_k, d]
    offset = n_k - n_q
    out = torch.empty_like(qg)
    for i0 in range(0, n_q, block_m):
        i1 = min(i0 + block_m, n_q)
        q_blk = qg[..., i0:i1, :]
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_blk)
        last = min(n_k, i1 + offset) if causal else n_k
        for j0 in range(0, last, block_n):
            j1 = min(j0 + block_n, n_k)
            s = q_blk @ kg[..., j0:j1, :].transpose(-1, -2)
            if causal:
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows + offset, float("-inf"))
            m, l, acc = online_softmax_step(m, l, acc, s, vg[..., j0:j1, :])
        out[..., i0:i1, :] = acc / l[..., None]
    return out.reshape(b, h, n_q, d)


model = llmlab.load_model("smollm2-135m", attention="naive")
tok = llmlab.load_tokenizer("smollm2-135m")
exercises.check("nb03.flash_forward", flash_forward, model=model, tokenizer=tok)

# %% [markdown]
# Once it passes, it is an attention backend like any other:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.exercises.nb03 import as_backend

llmlab.attention.register("my_flash", as_backend(flash_forward, block_m=16, block_n=16))
out = llmlab.generate(model.set_attention("my_flash"), tok, "The capital of France is",
                      max_new_tokens=5, chat=False, kv_cache="contiguous")
model.set_attention("naive")
print(out.token_ids, repr(out.text))

# %% [markdown]
# ## Exercise 3: predict the peak-memory ratio
#
# `naive` keeps N×N float32 matrices alive (the scores, then the probabilities): about
# 2·4096²·4 bytes = 128 MiB, more while both exist. `flash` keeps float32 copies of Q, K, V and
# the output (4·N·d·4 bytes = 4 MiB) and one 256×512 tile with its exponentials (about 1.5 MiB).
# So roughly 128 / 5.5 ≈ 25.

# %%
exercises.check("nb03.predict_peak_memory", 25)

# %% [markdown]
# ## Exercise 4: why FlashAttention-2 swapped the loops

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb03.explain_loop_order", "b")

# %% [markdown]
# ## Exercise 5: causal skipping
#
# 8 blocks per side; the tiles strictly above the diagonal are skipped: 8·7/2 = 28.

# %%
# NBVAL_CHECK_OUTPUT
blocks = 1024 // 128
exercises.check("nb03.skipped_tiles", blocks * (blocks - 1) // 2)
