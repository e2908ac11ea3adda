# %% [markdown]
# # 05 · Solutions

# %%
# NBVAL_CHECK_OUTPUT
import itertools

from llmlab.exercises.nb05 import check_cu_seqlens, check_padding, check_static_steps

# 1. every row is as long as the longest prompt (40): 5 · 40 positions, 117 of them real
lengths = [12, 40, 7, 33, 25]
check_padding(len(lengths) * max(lengths) - sum(lengths), lengths)


# 2. a running sum that starts at 0
def cu_seqlens(lengths):
    return [0] + list(itertools.accumulate(lengths))


check_cu_seqlens(cu_seqlens)

# 3. batches [5, 60, 8, 12] and [90, 7, 3, 40] last 60 and 90 iterations
out_lengths = [5, 60, 8, 12, 90, 7, 3, 40]
check_static_steps(max(out_lengths[:4]) + max(out_lengths[4:]), out_lengths, 4)
