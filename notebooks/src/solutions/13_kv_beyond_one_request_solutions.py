# %% [markdown]
# # 13 · Solutions
#
# Each exercise of notebook 13 with a reference answer and its check.

# %%
import llmlab
from llmlab import exercises
