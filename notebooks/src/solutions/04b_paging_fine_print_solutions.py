# %% [markdown]
# # 04b · Solutions
#
# The exercises of notebook 04b with their solutions, each followed by its check.

# %%
from llmlab import exercises

# %% [markdown]
# ### Exercise 1: the unfilled tail
#
# 37 tokens hold 3 blocks (48 slots, 11 unfilled), 70 hold 5 (80, 10 unfilled), 16 fill one
# block exactly (0), 5 hold one block (11 unfilled): 32 slots.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb04.wasted_slots", 32)

# %% [markdown]
# ### Exercise 2: why paging preempts
#
# Paging admits a request once its prompt fits and hands out blocks as sequences grow, so the
# sequences in flight can outgrow the pool: then the newest is preempted and prefilled again
# later. Reserving prompt + cap up front never runs out mid-generation.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb04.explain_preemptions", "b")
