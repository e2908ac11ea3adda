# %% [markdown]
# # 07b · Tensor parallelism at scale (optional)
#
# The appendix of notebook 07. Read 07 first: there you split SmolLM2 over real processes, got one
# process's logits and tokens back, counted the all-reduces of one token, and timed tp = 2 with a
# core per rank. This notebook asks what the same split does where it is used, on GPUs serving a
# model too big for one of them, in four parts that run on a CPU in seconds, without the model's
# weights: what one token all-reduces in bfloat16, which degrees a 70B model's heads allow, a
# scaling model for Llama-2-70B on 8 GPUs (a model, labelled as one), and, as a stretch,
# sequence parallelism, which turns an all-reduce into a reduce-scatter.

# %%
import torch
import torch.distributed as dist

from llmlab import exercises
from llmlab.config import ModelConfig
from llmlab.device import describe
from llmlab.models import resolve
from llmlab.parallel.comm import LLAMA2_70B

for k, v in describe().items():
    print(f"{k:12s} {v}")
cfg = ModelConfig.from_file(resolve("smollm2-135m"))   # the config only: no weights are loaded

# %% [markdown]
# ## 1 · What one token sends, in bfloat16
#
# Notebook 07 ran in float32, as this CPU does. GPUs serve in bfloat16, 2 bytes per value, and
# what crosses between the ranks is only the all-reduces' messages: one hidden vector each, as
# many per token as you predicted and the run counted in 07. Only the row-parallel layers and the
# vocab-parallel embedding end in an all-reduce; the column-parallel ones send nothing.
#
# **Bytes per token (compute).** How many bytes are all-reduced per generated token when
# SmolLM2-135M runs at tp = 3 in **bfloat16**? Count message sizes (not ring traffic).

# %%
# NBVAL_CHECK_OUTPUT
print(f"SmolLM2-135M: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
      f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads")

# %%
allreduce_bytes = ...  # YOUR ANSWER: a number of bytes
exercises.check("nb07.allreduce_bytes", allreduce_bytes)

# %% [markdown]
# The message size does not depend on tp: each rank sends and receives its share of it around
# the ring. What grows with the model is the hidden vector (8,192 values for Llama-2-70B) and the
# number of layers (80), so a 70B token all-reduces about 2.6 MB in bfloat16, still small
# against the 138 GB of weights its decode step reads. At batch 1 an all-reduce costs its latency,
# not its bytes.

# %% [markdown]
# ## 2 · Which degrees a model allows
#
# Every rank needs whole query heads, whole KV heads (so that grouped-query attention stays
# inside the rank), and equal slices of the MLP features and of the vocabulary. Notebook 07
# showed that SmolLM2's 9 query and 3 KV heads allow only tp = 1 and tp = 3.
#
# **Valid degrees (compute).** Which tensor-parallel degrees does this workbook accept for
# Llama-2-70B (64 query heads, 8 KV heads, MLP 28672, vocabulary 32000)?

# %%
llama70b_degrees = ...  # YOUR ANSWER: a list of ints
exercises.check("nb07.valid_degrees", llama70b_degrees)

# %% [markdown]
# **Compare with llmlab's.** `llmlab.parallel.valid_tp_degrees` gives the list, and
# `check_tp_degree` refuses any other degree with a message naming the allowed ones:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.parallel import check_tp_degree, valid_tp_degrees

print("Llama-2-70B:", valid_tp_degrees(LLAMA2_70B))
try:
    check_tp_degree(LLAMA2_70B, 16)
except ValueError as exc:
    print("tp=16 refused:", str(exc).split(";")[-1].strip())

# %% [markdown]
# ## 3 · A scaling model for Llama-2-70B on 8 GPUs
#
# This is a **model**, not a measurement (`llmlab.parallel.comm.tp_decode_model`). One decode
# step at batch 1 reads each rank's share of the weights and KV cache at HBM bandwidth (A100
# 80GB: 2039 GB/s; compute at 312 TFLOP/s is far from the limit) and then waits for
# 2 × 80 + 1 ring all-reduces of one hidden vector (16 KiB in bf16) plus the logits all-gather
# over the interconnect (NVLink 3: 300 GB/s each way; PCIe 4.0: about 25 GB/s), with an
# assumed 2 µs per ring hop on NVLink and 5 µs on PCIe. Splitting divides the memory time by tp;
# the all-reduces do not shrink, and at batch 1 they are mostly latency. First the model's
# numbers at each degree, for both links:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.parallel.comm import A100_NVLINK, A100_PCIE, tp_decode_model

model = {(tp, link): tp_decode_model(tp, hw) for tp in (1, 2, 4, 8)
         for hw, link in ((A100_NVLINK, "NVLink"), (A100_PCIE, "PCIe 4.0"))}
print("MODEL, Llama-2-70B, bfloat16, batch 1, 1,024 cached tokens (ms per step)")
print("tp  link        weights+KV  all-reduces  total  all-reduce share  fits in 80 GB")
for (tp, link), e in model.items():
    print(f"{tp:2d}  {link:10s}  {e.memory_s * 1e3:10.2f}  {e.comm_s * 1e3:11.2f}  "
          f"{e.total_s * 1e3:5.2f}  {e.comm_s / e.total_s:16.0%}  {'yes' if e.fits else 'no'}")

# %%
from IPython.display import Markdown

nv2, nv8, pc8 = model[2, "NVLink"], model[8, "NVLink"], model[8, "PCIe 4.0"]
one = model[1, "NVLink"]
Markdown(
    f"Read the columns. From tp = 2 to tp = 8 the weights' time falls "
    f"{nv2.memory_s / nv8.memory_s:.0f}× ({nv2.memory_s * 1e3:.1f} to {nv8.memory_s * 1e3:.1f} ms), "
    f"while the all-reduces' time on NVLink grows {nv8.comm_s / nv2.comm_s:.1f}× "
    f"({nv2.comm_s * 1e3:.2f} to {nv8.comm_s * 1e3:.2f} ms): a ring of 8 makes more hops, each "
    f"paying its latency. So 8 GPUs make the step {one.total_s / nv8.total_s:.1f}× as fast as "
    f"one GPU would be if the weights fitted on it, not 8×; the all-reduces are "
    f"{nv8.comm_s / nv8.total_s:.0%} of the step on NVLink and {pc8.comm_s / pc8.total_s:.0%} "
    f"over PCIe. Move the sliders: tp degree, link bandwidth and batch.")

# %%
import ipywidgets as widgets

from llmlab.viz.tp import plot_tp_scaling

fig = plot_tp_scaling(tp=8, link_GBps=300.0)

# %%
widgets.interactive(plot_tp_scaling, tp=widgets.SelectionSlider(options=[1, 2, 4, 8], value=8),
                    link_GBps=widgets.FloatLogSlider(value=300, base=10, min=0.5, max=3, step=0.1,
                                                     description="link GB/s"),
                    batch=widgets.IntSlider(value=1, min=1, max=256, description="batch"),
                    context=widgets.fixed(1024), hw=widgets.fixed(A100_NVLINK),
                    config=widgets.fixed(LLAMA2_70B))

# %% [markdown]
# ## 4 · Stretch: sequence-parallel RMSNorm
#
# Between a row-parallel layer and the next column-parallel one sit the residual add and RMSNorm,
# and with plain tensor parallelism every rank repeats them on the whole sequence. *Sequence
# parallelism* (Korthikanti et al., 2023) splits that region along the sequence instead: the
# all-reduce after the row layer becomes a **reduce-scatter** (sum over the ranks, and rank r keeps
# only the r-th block of tokens), the norm runs on seq/tp tokens per rank, and an all-gather
# before the next column layer restores the full sequence. An all-reduce *is* a reduce-scatter
# followed by an all-gather, so the bytes on the wire are the same; the norm's work and
# activations shrink tp times.
#
# Write `sequence_parallel_norm(partial, weight, eps)`: `partial` [seq, hidden] is this rank's
# partial sum out of a row-parallel layer; return this rank's seq/tp tokens of
# RMSNorm(sum of all ranks' partials), [seq/tp, hidden]. RMSNorm(x) = x / √(mean(x²) + eps) ·
# weight, over the hidden dimension. `dist.reduce_scatter(output, list_of_tp_chunks)` is the
# collective. The check runs it on two processes (`llmlab.parallel.launch`, gloo), so, as in
# notebook 07, keep what it needs inside it.

# %%
def sequence_parallel_norm(partial, weight, eps):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb07.sequence_parallel_norm", sequence_parallel_norm)

# %% [markdown]
# ## Takeaways
#
# * What crosses between ranks per token is a count of hidden vectors fixed by the model (two per layer, one for the embedding), whatever tp is; in bfloat16 it is small against the weights a step reads.
# * A degree must split the query heads, the KV heads, the MLP and the vocabulary evenly: the KV heads are usually the limit.
# * In the model, tp divides the time spent reading weights and leaves the all-reduces' latency: the link and the batch decide how far tp pays.
#
# ## Further reading
#
# - Shoeybi et al. *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism.* 2019. [arXiv:1909.08053](https://arxiv.org/abs/1909.08053)
# - Korthikanti et al. *Reducing Activation Recomputation in Large Transformer Models* (sequence parallelism). MLSys 2023. [arXiv:2205.05198](https://arxiv.org/abs/2205.05198)
# - Pope et al. *Efficiently Scaling Transformer Inference.* MLSys 2023. [arXiv:2211.05102](https://arxiv.org/abs/2211.05102) (partitioning for inference, communication costs)
# - Patarasuk, Yuan. *Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations* (ring all-reduce). JPDC 69(2), 2009. [doi:10.1016/j.jpdc.2008.09.002](https://doi.org/10.1016/j.jpdc.2008.09.002)
# - NVIDIA A100 product page (bandwidth, memory, peak FLOP/s): [A100](https://www.nvidia.com/en-us/data-center/a100/)
