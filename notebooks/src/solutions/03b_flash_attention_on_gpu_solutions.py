# %% [markdown]
# # 03b · Solutions
#
# The reference answers to the exercises of notebook 03b (the break-even Br and the Triton
# stretch), each followed by its check.

# %%
from llmlab import exercises
from llmlab.device import TRITON_MISSING, has_triton

# %% [markdown]
# ## The break-even Br
#
# FlashAttention-2's order re-reads K and V once per query block: 2·N²·d/Br elements. Standard
# attention writes and reads S and P: 4·N². They tie at Br = d/2, 64 for d = 128. The full model,
# N·d terms included, around that point:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.profiling.hbm import standard_attention_hbm, tiled_attention_hbm

d = 128
for br in (32, 64, 128):
    ratio = tiled_attention_hbm(4096, d, br, 64).total / standard_attention_hbm(4096, d).total
    print(f"Br = {br:3d}: tiled ÷ standard = {ratio:.2f}")
exercises.check("nb03.break_even_block_q", d // 2)

# %% [markdown]
# ## Stretch: the Triton inner loop
#
# The same update as notebook 03's exercise 1, on tiles: `tl.dot` for the scores, `tl.where` for the two
# masks (the ragged tail past `n_k`, and the causal diagonal), then the rescale.

# %%
if has_triton():
    import triton
    import triton.language as tl
    from llmlab.exercises.flash_triton_skeleton import load_k_block, load_v_block

    @triton.jit
    def inner_loop(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, offs_m, offs_d, n_k, hi,
                   causal_offset, qk_scale, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_k_block(K, stride_kn, offs_n, offs_d, n_k)
            v = load_v_block(V, stride_vn, offs_n, offs_d, n_k)
            s = tl.dot(q, k) * qk_scale
            ok = offs_n[None, :] < n_k
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        return acc, l_i, m_i

    print(exercises.check("nb03.flash_triton_inner_loop", inner_loop))
else:
    print(TRITON_MISSING)
