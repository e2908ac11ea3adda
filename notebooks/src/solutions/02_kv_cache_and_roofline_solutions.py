# %% [markdown]
# # 02 · Solutions

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.cache import kv_bytes_per_token
from llmlab.config import ModelConfig
from llmlab.exercises import nb02
from llmlab.models.registry import model_dir
from llmlab.profiling.roofline import decode_cost

# 1. 2 (K and V) · 32 layers · 32 KV heads · 128 dims · 2 bytes
answer = 2 * 32 * 32 * 128 * 2
nb02.check_kv_bytes_7b(answer)

# %%
# NBVAL_CHECK_OUTPUT
# 2. walk up the batch sizes until the decode step's intensity reaches the ridge point
cfg = ModelConfig.from_file(model_dir("smollm2-135m"))
answer = next(b for b in range(1, 4097) if decode_cost(cfg, b, 512).intensity >= 10.0)
print("smallest compute-bound batch:", answer, "(the naive batch/2 guess says 20)")
nb02.check_compute_bound_batch(answer, cfg, context=512, ridge_point=10.0)
