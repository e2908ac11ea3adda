# %% [markdown]
# # 04 · Solutions
#
# The exercises of notebook 04 with their solutions, each followed by its check.

# %%
import math

import torch

import llmlab
from llmlab import exercises
from llmlab.cache.block_manager import NoFreeBlocksError

model = llmlab.load_model("smollm2-135m")
tok = llmlab.load_tokenizer("smollm2-135m")

# %% [markdown]
# ### Exercise 1: where does a token live?
#
# Token 6 is offset 6 % 4 = 2 of logical block 6 // 4 = 1; the table maps logical block 1 to
# physical block 2, and the pool is flattened block after block: 2 · 4 + 2 = 10.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb04.slot_of", 10)

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
# ### Exercise 4: the next token's slot, with copy-on-write
#
# At a block boundary the sequence needs a new block. Inside a block it writes in place, unless
# the block is shared: then a new block replaces it in this table only, the old one loses one
# reference (the sibling keeps it), and `(old, new)` tells the cache to copy the K/V already
# there. The new block is taken before the old one is let go, so a refusal changes nothing.

# %%
def append_slot(block_table, num_tokens, allocator, block_size):
    position = num_tokens
    offset = position % block_size
    cow = None
    if offset == 0:                                   # the last block is full (or none yet)
        if allocator.num_free < 1:
            raise NoFreeBlocksError(1, 0, "append")
        block_table.append(allocator.allocate())
    else:
        last = block_table[-1]
        if allocator.ref_counts[last] > 1:            # shared with another table: copy first
            if allocator.num_free < 1:
                raise NoFreeBlocksError(1, 0, "copy-on-write")
            new = allocator.allocate()
            allocator.decref(last)                    # one table fewer points at the old block
            block_table[-1] = new
            cow = (last, new)
    block = block_table[position // block_size]
    return block * block_size + offset, cow


exercises.check("nb04.append_slot", append_slot, model=model, tokenizer=tok)

# %% [markdown]
# ### Exercise 5: decode attention through the block table
#
# Per sequence, per block of its table: the scores of the filled slots, then the online-softmax
# update: the new running max, the factor `alpha = exp(m_old − m_new)` that rescales the running
# sum and the accumulator, and the block's contribution. Query heads are grouped by the KV head
# they read, so one matmul serves a whole group.

# %%
def paged_attention(q, k_cache, v_cache, cache_seqlens, block_table, *, softmax_scale=None,
                    causal=True):
    batch, _, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads                         # query heads per KV head
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(batch, heads, d, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(cache_seqlens[b])
        qb = q[b, 0].float().view(kv_heads, group, d) * scale
        m = torch.full((kv_heads, group), float("-inf"), device=q.device)   # running max
        l = torch.zeros(kv_heads, group, device=q.device)                   # running sum
        acc = torch.zeros(kv_heads, group, d, device=q.device)              # running Σ p·v
        for i in range(-(-n // block_size)):
            block = int(block_table[b, i])
            filled = min(block_size, n - i * block_size)   # the last block may be partial
            k = k_cache[block, :filled].float().transpose(0, 1)     # [kv_heads, filled, d]
            v = v_cache[block, :filled].float().transpose(0, 1)
            s = qb @ k.transpose(1, 2)                               # [kv_heads, group, filled]
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)              # rescales what was summed before
            p = torch.exp(s - m_new[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v
            m = m_new
        if n:
            out[b] = (acc / l[..., None]).reshape(heads, d)
    return out[:, None].to(q.dtype)


exercises.check("nb04.paged_attention", paged_attention, model=model, tokenizer=tok)

# %% [markdown]
# ### Exercise 6: predict the waste of reserving prompt + 1024
#
# Compare what the mean request ends with (prompt + output) with what it reserves
# (prompt + 1024): their ratio is the share ever written, the rest is waste, and holes between
# reservations add some more.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.exercises.nb04 import measured_max_len_waste, trace_means

prompt, output = trace_means()
print(f"ends with {prompt:.0f} + {output:.0f} tokens, reserves {prompt:.0f} + 1024: "
      f"{1 - (prompt + output) / (prompt + 1024):.0%} of it never written; "
      f"measured waste {measured_max_len_waste():.0%}")
exercises.check("nb04.predict_waste", 0.7)
