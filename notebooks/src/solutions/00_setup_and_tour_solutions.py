# %% [markdown]
# # 00 · Solutions

# %%
# NBVAL_CHECK_OUTPUT
import torch
from llmlab.exercises.nb01 import check_temperature

def apply_temperature(logits, temperature):
    return torch.softmax(logits / temperature, dim=-1)

check_temperature(apply_temperature)
