# %% [markdown]
# # 13 · KV beyond one request
#
# **Why.** Notebook 04 kept one request's K/V in blocks and shared full blocks between prompts
# that start alike. Real traffic repeats itself far more than that: every turn of a chat resends
# the whole conversation, agents call the model again and again on a growing transcript, and
# few-shot prompts share a long preamble. Long contexts bring the opposite problem: one
# sequence's K/V becomes too long to read quickly, or to keep at all.
#
# (The numbers and sources of this section are filled in below.)

# %%
import llmlab
from llmlab import exercises
from llmlab.device import describe

for key, value in describe().items():
    print(f"{key:12s} {value}")

# %% [markdown]
# ## How: a radix tree over the block pool

# %% [markdown]
# ## Build: the radix tree's match and insert

# %% [markdown]
# ## Check: the same tokens with and without the cache

# %% [markdown]
# ## Measure: a multi-turn trace with no cache, the hash cache and the radix cache

# %% [markdown]
# ## Play: cache size × policy

# %% [markdown]
# ## Long contexts: split-KV decode and attention sinks
#
# Splitting one sequence's K/V across the chip (flash-decoding) and keeping a few sink tokens
# beside a sliding window (StreamingLLM).

# %% [markdown]
# ## Predict, explain, stretch

# %% [markdown]
# ## Takeaways
#
# ## Further reading
