# %% [markdown]
# # 04 · Solutions
#
# The exercises of notebook 04 with their solutions, each followed by its check.

# %%
import llmlab
from llmlab import exercises
from llmlab.cache.block_manager import NoFreeBlocksError

model = llmlab.load_model("smollm2-135m")
tok = llmlab.load_tokenizer("smollm2-135m")

# %% [markdown]
# ### Exercise 1: where does a token live?
#
# The logical block is `position // block_size`, the offset inside it `position % block_size`;
# the table turns the logical block into a physical one, and the pool is flattened block after
# block.

# %%
# NBVAL_CHECK_OUTPUT
def slot_of(block_table, position, block_size):
    return block_table[position // block_size] * block_size + position % block_size


exercises.check("nb04.slot_of", slot_of)

# %% [markdown]
# ### Exercise 2: the block allocator
#
# A free list (a deque: blocks come back at the end, so a freed block is reused last) and one
# count per block. A block goes back to the free list only when its count reaches 0.

# %%
from collections import deque


class MyBlockAllocator:
    """A pool of `num_blocks` physical KV blocks: a free list and a reference count each."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_list = deque(range(num_blocks))

    @property
    def num_free(self):
        return len(self.free_list)

    def allocate(self):
        if not self.free_list:
            raise NoFreeBlocksError(1, 0)
        block = self.free_list.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; it cannot be shared")
        self.ref_counts[block] += 1

    def decref(self, block):
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} has no reference to drop (a double free)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_list.append(block)
        return self.ref_counts[block]


exercises.check("nb04.block_allocator", MyBlockAllocator, model=model, tokenizer=tok)

# %% [markdown]
# ### Exercise 3: copy-on-write
#
# Blocks 0–1 of the prompt are full and stay shared by all three sequences. Block 2 holds two
# tokens and is shared three ways: the parent's write copies it (now 4 blocks), the first child's
# write copies it again (5), and the second child, by then its only owner, writes in place.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb04.cow_blocks", 5)

# %% [markdown]
# ### Exercise 4: predict the waste of reserving prompt + 1024
#
# A request ends with about 161 + 338 ≈ 500 tokens on average and reserves about 161 + 1024 ≈
# 1,185: it fills about 42% of what it holds by the end, and on average over its life (it grows
# from 161 to 500) about a quarter. So roughly 70% is waste; the simulation measures 72%.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb04.predict_waste", 0.7)

# %% [markdown]
# ### Exercise 5: wasted slots
#
# A sequence of n tokens holds ⌈n / block_size⌉ blocks; what it does not fill is wasted.

# %%
# NBVAL_CHECK_OUTPUT
def wasted_slots(lengths, block_size):
    return sum(-(-n // block_size) * block_size - n for n in lengths)


exercises.check("nb04.wasted_slots", wasted_slots)

# %% [markdown]
# ### Exercise 6: why paging preempts
#
# (a): paging admits a request on its prompt alone and lets it grow; when the pool runs dry the
# newest sequence is preempted and recomputed. Reserving the cap never runs out mid-generation
# because it holds, up front, memory that is mostly never written.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb04.explain_preemptions", "a")

# %% [markdown]
# ### Stretch: the paged kernel's block loop
#
# Per sequence, per block: the scores of the valid keys, then the online-softmax update: the new
# running max, the factor `alpha = exp(m_old − m_new)` that rescales the running sum and the
# accumulator, and the block's contribution.

# %%
# NBVAL_CHECK_OUTPUT
import math

import torch


def paged_decode(q, k_cache, v_cache, cache_seqlens, block_table):
    batch, heads, d = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(batch, heads, d)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qb = q[b].float().view(kv_heads, group, d)            # query heads grouped by KV head
        m = torch.full((kv_heads, group), float("-inf"))
        l = torch.zeros(kv_heads, group)
        acc = torch.zeros(kv_heads, group, d)
        for i in range(-(-n // bs)):
            block = int(block_table[b, i])
            valid = min(bs, n - i * bs)                        # the last block may be partial
            k = k_cache[block, :valid].float().permute(1, 0, 2)   # [kv_heads, valid, d]
            v = v_cache[block, :valid].float().permute(1, 0, 2)
            s = qb @ k.transpose(1, 2) / math.sqrt(d)            # [kv_heads, group, valid]
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v
            m = m_new
        out[b] = (acc / l[..., None]).reshape(heads, d)
    return out.to(q.dtype)


exercises.check("nb04.paged_block_loop", paged_decode)
