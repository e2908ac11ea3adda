# %% [markdown]
# # 11 · Solutions
#
# Each exercise of notebook 11 with a reference answer and its check.

# %%
import math

import torch

import llmlab
from llmlab import exercises

# %% [markdown]
# ## Build: the static cache's write and read
#
# The write is a `scatter_` along the slot axis: `slots` becomes an index tensor of the cache's
# layout, `[batch, kv_heads, s, head_dim]`, and the new keys arrive `[batch, s, kv_heads,
# head_dim]`, hence the transpose. The read covers every slot; the mask compares slot ids with
# each query's slot, `slot ≤ own slot`, and drops the last slot (the bin). Grouped heads: each KV
# head serves `heads // kv_heads` consecutive query heads, so `repeat_interleave` copies it that
# many times. Every shape depends only on the cache's size, never on the position, so one
# compiled graph serves every step.

# %%
def fixed_shape_attend(k_cache, v_cache, slots, q, k, v):
    b, s, h, d = q.shape
    kv_heads, num_slots = k_cache.shape[1], k_cache.shape[2]
    where = slots[:, None, :, None].expand(b, kv_heads, s, d)
    k_cache.scatter_(2, where, k.transpose(1, 2).to(k_cache.dtype))
    v_cache.scatter_(2, where, v.transpose(1, 2).to(v_cache.dtype))
    slot_ids = torch.arange(num_slots, device=q.device)
    visible = (slot_ids <= slots[..., None]) & (slot_ids < num_slots - 1)   # [b, s, slots]
    groups = h // kv_heads
    keys = k_cache.repeat_interleave(groups, dim=1).to(q.dtype)
    values = v_cache.repeat_interleave(groups, dim=1).to(q.dtype)
    scores = q.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(d)      # [b, h, s, slots]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)


print(exercises.check("nb11.fixed_shape_attend", fixed_shape_attend))

# %% [markdown]
# ## Predict: the share outside the matmuls
#
# A guess is judged against the measurement; the reference answer is the measurement's own
# option.

# %%
from llmlab.exercises.nb11 import share_letter
from llmlab.profiling.overhead import make_decode_step, step_breakdown

model = llmlab.load_model("smollm2-135m", attention="sdpa")
int8 = llmlab.quantize(model, "int8", rounding="rtn")
share = step_breakdown(make_decode_step(int8, batch=1, context=32), repeats=7).outside_share
answer = share_letter(share)
print(f"measured share {share:.0%}: option ({answer})")
print(exercises.check("nb11.predict_outside_share", answer, measured=share))

# %% [markdown]
# ## Predict: the gain of a CUDA graph at batch 1
#
# Eager, the step waits for the longer of its kernels and its launches: calls × t_op, about a
# millisecond, against a roof of 270 MB / 3.35 TB/s ≈ 0.08 ms. A replay costs the roof plus one
# launch. The notebook passes its run's calls, t_op and roof; here the check uses one recorded run.

# %%
from llmlab.exercises.nb11 import REFERENCE_GRAPH, REPLAY_S

n, t, roof = (REFERENCE_GRAPH[k] for k in ("calls", "t_op", "roof_s"))
print(exercises.check("nb11.predict_graph_gain", max(roof, n * t) / (roof + REPLAY_S)))

# %% [markdown]
# ## Stretch: RMSNorm with the residual add, in Triton
#
# One program per row. Every load and store is masked to the row's `n_cols` columns (BLOCK is
# the next power of two), masked loads read 0, so the padding adds nothing to the sum of
# squares, and the mean divides by `n_cols`. The arithmetic is float32 whatever the input.

# %%
from llmlab.device import TRITON_MISSING, has_triton

if has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_kernel(X, R, W, OUT, H, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(X + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(R + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
        h = x + r
        tl.store(H + row * n_cols + cols, h, mask=inside)
        mean_square = tl.sum(h * h, axis=0) / n_cols
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(OUT + row * n_cols + cols, h / tl.sqrt(mean_square + eps) * w, mask=inside)

    print(exercises.check("nb11.add_rmsnorm_kernel", add_rmsnorm_kernel))
else:
    print(TRITON_MISSING)
