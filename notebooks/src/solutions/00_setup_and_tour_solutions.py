# %% [markdown]
# # 00 · Solutions
#
# Each exercise of notebook 00 with a reference answer and its check.

# %%
# NBVAL_CHECK_OUTPUT
import torch

from llmlab import exercises

# Predict: dividing the logits by 0.5 doubles every gap between them, so the top token's
# lead over each rival is squared in probability: it rises. (Without the notebook's
# measurement passed in, the check measures it itself.)
exercises.check("nb00.predict_temperature", "a")

# %%
# NBVAL_CHECK_OUTPUT
# 1. apply_temperature
def apply_temperature(logits, temperature):
    return torch.softmax(logits / temperature, dim=-1)


exercises.check("nb00.apply_temperature", apply_temperature)

# %%
# NBVAL_CHECK_OUTPUT
# 2. Explain: the weights are the dequantized Q4_1 values, so compare with a reference that
# loads the same weights.
exercises.check("nb00.explain_weights", "c")

# %%
# NBVAL_CHECK_OUTPUT
# 3. Stretch: the nucleus cut. Sort descending, keep each token whose probability mass
# *before* it is at most p: the token that crosses p is kept, the most likely always is.
def top_p_filter(logits, top_p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before > top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


exercises.check("nb00.top_p_filter", top_p_filter)
