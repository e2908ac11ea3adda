# %% [markdown]
# # 04 · Solutions

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.exercises.nb04 import check_cow_blocks, check_slot, check_wasted_slots


def slot_of(block_table, position, block_size):
    return block_table[position // block_size] * block_size + position % block_size


_ = check_slot(slot_of)

# %%
# NBVAL_CHECK_OUTPUT
def wasted_slots(lengths, block_size):
    return sum(-(-n // block_size) * block_size - n for n in lengths)


_ = check_wasted_slots(wasted_slots)

# %% [markdown]
# Blocks 0–1 of the prompt are full and stay shared by all three sequences. Block 2 holds two
# tokens and is shared three ways: the parent's write copies it (now 4 blocks), the first child's
# write copies it again (5), and the second child, now its only owner, writes in place.

# %%
# NBVAL_CHECK_OUTPUT
_ = check_cow_blocks(5)
