# %% [markdown]
# # 01 · Solutions

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.exercises.nb01 import check_score_bytes, check_token_passes

P, T = 30, 100
check_token_passes(sum(P + t for t in range(T)), prompt_len=P, new_tokens=T)
check_score_bytes(1 * 9 * 8192 * 8192 * 4, n=8192, heads=9)
