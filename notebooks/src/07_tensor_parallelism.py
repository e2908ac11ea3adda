# %% [markdown]
# # 07 · Tensor parallelism: one model, several processes, the same answer
#
# The seed article on inference acceleration explains tensor parallelism with a photocopier
# that can only copy a few pages at a time: split the thick book into parts, copy each part
# on its own machine, and bind the copies back in order. Here the book is SmolLM2-135M, the
# machines are real processes joined by `torch.distributed` (gloo on this CPU, NCCL on GPUs),
# and "binding the copies" is an **all-reduce**: two per decoder layer.
#
# This notebook: **Why** split at all → **How** (Megatron's column/row split) → **Check** (tp = 3
# gives tp = 1's logits and tokens) → **Measure** (time per token, all-reduce cost: what two
# cores can and cannot show) → **Play** (a scaling model for a 70B model on 8 GPUs) → Exercises.

# %%
import os
import inspect

import torch

import llmlab
from llmlab.device import describe, device_name

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
for k, v in describe().items():
    print(f"{k:12s} {v}")

# %% [markdown]
# ## 1 · Why: the model does not fit, and decode reads every weight for every token
#
# The seed article reports that a production cluster serving models up to 70B made inference
# about 50% faster with FlashAttention, PagedAttention, MoE and tensor parallelism together.
# Tensor parallelism is the one that makes a 70B model possible at all: in bfloat16 its
# weights alone are larger than one 80 GB GPU. And because decoding one token reads every
# weight once (notebook 02: decode is memory-bound), splitting the weights over `tp` GPUs also
# divides the bytes each GPU must read per token, so in the ideal case the token comes `tp`
# times sooner.

# %%
from llmlab.parallel.comm import LLAMA2_70B

params = LLAMA2_70B.num_parameters()
print(f"Llama-2-70B shape: {LLAMA2_70B.num_layers} layers, hidden {LLAMA2_70B.hidden_size}, "
      f"{LLAMA2_70B.num_heads} query / {LLAMA2_70B.num_kv_heads} KV heads")
print(f"parameters: {params / 1e9:.1f} B  ->  {params * 2 / 1e9:.0f} GB in bfloat16")
for tp in (1, 2, 4, 8):
    print(f"  tp={tp}: {params * 2 / tp / 1e9:6.1f} GB of weights per GPU "
          f"({'fits' if params * 2 / tp < 80e9 else 'does not fit'} in 80 GB)")

# %% [markdown]
# ## 2 · How: split each matrix so that only two sums are needed per layer
#
# Write a linear layer as `y = x A` with `A = Wᵀ` of shape `[in, out]`.
#
# * **ColumnParallelLinear**: rank r keeps a block of A's *columns* (output features). From the
#   full `x` it computes its own slice of `y`. No communication.
# * **RowParallelLinear**: rank r keeps a block of A's *rows* (input features). Given its slice
#   of `x` it computes a *partial* `y`; an **all-reduce** adds the partials.
#
# Attention's `q/k/v` are column-parallel (whole heads per rank: SmolLM2's 9 query and 3 KV
# heads become 3 + 1 per rank at tp = 3, so grouped-query attention stays grouped), `o_proj`
# is row-parallel. The MLP's `gate/up` are column-parallel, `down` is row-parallel. Everything
# between them (RoPE, the attention backend, SiLU) is per-head or per-feature, so it runs on
# the slices without talking to anyone. The embedding is split by vocabulary rows and the
# LM head by vocabulary columns (its logits are all-gathered).

# %%
from llmlab.config import ModelConfig
from llmlab.models.registry import resolve
from llmlab.viz.tp import plot_tp_split

cfg = ModelConfig.from_file(resolve("smollm2-135m"))
fig = plot_tp_split(cfg, 3)

# %% [markdown]
# The row-parallel layer's forward is the whole trick: a local matmul, then one all-reduce
# (Megatron's "g" operator; in inference a plain `all_reduce`, in training its backward is
# the identity, and the column layer's conjugate "f" all-reduces the gradient instead).

# %%
from llmlab.layers.linear import RowParallelLinear, VocabParallelEmbedding

print(inspect.getsource(RowParallelLinear.forward))
print(inspect.getsource(VocabParallelEmbedding.forward))

# %% [markdown]
# The TP model is the ordinary `CausalLM`, built on the meta device, with its linear and
# embedding modules swapped for the parallel ones (`llmlab.parallel.parallelize`). Its forward
# code is unchanged; each rank only sets its attention module's head counts to the local ones.
# A degree that does not split the heads evenly is refused:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.parallel import build_tp_model, check_tp_degree, valid_tp_degrees

print("valid tp degrees for SmolLM2-135M:", valid_tp_degrees(cfg))
try:
    check_tp_degree(cfg, 2)
except ValueError as exc:
    print("tp=2 refused:", str(exc).split(";")[-1].strip())
rank1 = build_tp_model(cfg, tp_rank=1, tp_size=3)   # on meta: no memory, no weights yet
print(rank1.layers[0].self_attn.q_proj)
print(rank1.layers[0].self_attn.o_proj)
print("heads on rank 1:", rank1.layers[0].self_attn.num_heads, "query,",
      rank1.layers[0].self_attn.num_kv_heads, "KV")

# %% [markdown]
# ## 3 · Check: three processes give one process's answer
#
# `llmlab.parallel.launch(fn, world_size, *args)` spawns `world_size` Python processes, joins
# them in a gloo process group on a free localhost port, runs `fn(*args)` on each and returns
# rank 0's result. `fn` must live in a module (spawned processes import it by name); here it is
# `llmlab.parallel.workers.parity_on_ranks`: each rank reads **only its slices** of the
# safetensors file (`safe_open(...).get_slice`), computes logits for the prompt, then generates
# greedily with a KV cache, in lockstep with the other ranks. `run_sequence` runs two workers
# in the same launch (starting ranks costs seconds; the second measures all-reduce timings).
# The command-line twin is `torchrun --nproc-per-node 3 -m llmlab.parallel.run --prompt "..."`.

# %%
from llmlab.generate import encode_prompts
from llmlab.parallel import launch
from llmlab.parallel.comm import time_allreduce
from llmlab.parallel.workers import parity_on_ranks, run_sequence

model = llmlab.load_model("smollm2-135m")
tok = llmlab.load_tokenizer("smollm2-135m")
prompt = "What is the capital of France?"
ids = torch.tensor(encode_prompts(tok, [prompt], chat=True))
eos = cfg.eos_token_id
max_new = 6 if QUICK else 10
sizes = [256, 2304, 65536, 1 << 20] if QUICK else [256, 2304, 16384, 262144, 1 << 20]

with torch.no_grad():
    ref_logits = model(ids)
ref = llmlab.generate(model, tok, prompt, max_new_tokens=max_new)
tp3, allreduce3 = launch(run_sequence, 3, [(parity_on_ranks, ("smollm2-135m", ids, max_new, eos)),
                                           (time_allreduce, (sizes, 10))])
err = (tp3.logits - ref_logits).abs().max().item()

# %%
# NBVAL_CHECK_OUTPUT
print("tp=3 logits shape:", tuple(tp3.logits.shape))
print("max |logits(tp=3) - logits(tp=1)| < 1e-4:", err < 1e-4)
print("greedy tokens identical:", tp3.tokens == ref.token_ids)
print("text:", tok.decode([t for t in tp3.tokens if t != eos]))

# %% [markdown]
# Only the order of the summation changed (three partial sums added by the all-reduce instead
# of one long dot product), so the difference is float32 rounding:

# %%
print(f"max |Δ| = {err:.2e}")

# %% [markdown]
# **What each rank holds.** Parameters and the bytes each rank read from the checkpoint are a
# third of the whole (the norms, a few KiB, are copied to every rank). The process peak also
# counts the Python/PyTorch runtime, which every process pays in full: on a laptop that
# overhead is a large share (section 4 prints it); on GPUs holding a 70B model it is noise.

# %%
# NBVAL_CHECK_OUTPUT
one_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print(f"tp=1: {one_mib:.1f} MiB of parameters")
print("rank  q heads  kv heads  params MiB  read MiB")
for m in tp3.memory:
    print(f"{m.rank:4d}  {m.heads:7d}  {m.kv_heads:8d}  {m.param_bytes / 2**20:10.1f}  "
          f"{m.bytes_read / 2**20:8.1f}")

# %% [markdown]
# **What crosses between ranks.** The run counted the collectives of one token's forward pass;
# they match the accounting: two all-reduces of one hidden vector per layer, one for the
# embedding, and one all-gather of the logits.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.parallel.comm import allreduce_per_token

acct = allreduce_per_token(cfg, 3)
ops = [op for op, _ in tp3.collectives]
print(f"counted: {ops.count('all_reduce')} all-reduces of "
      f"{sorted({b for op, b in tp3.collectives if op == 'all_reduce'})} bytes, "
      f"{ops.count('all_gather')} all-gather")
print(f"accounting: {acct.allreduces_per_layer} per layer x {cfg.num_layers} layers + 1 = "
      f"{acct.allreduces_per_token} all-reduces of {acct.message_bytes} B = "
      f"{acct.per_token_bytes / 1024:.1f} KiB per token; a ring all-reduce makes each rank send "
      f"{acct.ring_sent_bytes_per_rank / 1024:.1f} KiB")

# %% [markdown]
# ## 4 · Measure: time per token on two CPU cores
#
# The same tokens decoded by one process with one thread (launched the same way, so the code
# path is identical) and by tp = 3 (three processes of one thread each, the run above).
# tp = 2 is not possible for SmolLM2 (9 heads). `python -m llmlab.bench tp` also times one
# process with two threads.

# %%
from llmlab.parallel.workers import generate_on_ranks
from llmlab.viz.tp import plot_allreduce, plot_time_per_token

tp1 = launch(generate_on_ranks, 1, "smollm2-135m", ids[0].tolist(), max_new, "naive", "float32",
             None, eos)                                 # one process, one thread
labels = ["tp=1, 1 thread", "tp=3, 1 thread each"]
ms = [tp1.s_per_token * 1e3, tp3.s_per_token * 1e3]
for lab, v in zip(labels, ms):
    print(f"{lab:22s} {v:7.1f} ms/token")
print(f"process peak RSS: tp=1 {tp1.memory[0].peak_bytes / 2**20:.0f} MiB; tp=3 "
      f"{', '.join(f'{m.peak_bytes / 2**20:.0f}' for m in tp3.memory)} MiB per rank")
print("same tokens:", tp1.tokens == tp3.tokens)
fig = plot_time_per_token(labels, ms, device_name())

# %%
hidden_us = [r["us"] for r in allreduce3 if r["bytes"] == acct.message_bytes][0]
print(f"measured all-reduce of one hidden vector ({acct.message_bytes} B) over 3 ranks: {hidden_us:.0f} µs")
print(f"x {acct.allreduces_per_token} per token = {acct.allreduces_per_token * hidden_us / 1e3:.1f} ms "
      f"of the {tp3.s_per_token * 1e3:.1f} ms per token at tp=3")
fig = plot_allreduce({3: allreduce3}, acct.message_bytes, device_name())

# %% [markdown]
# **What two cores can and cannot show.** They show the mechanism for real: three processes,
# a real process group, each holding a third of the weights, the same logits and tokens, and
# the exact number and size of the messages. They cannot show a speed-up. Tensor parallelism
# pays off when each rank has its *own* compute and memory bandwidth (a GPU each) and the
# all-reduce travels over a fast link. Here three single-threaded ranks share two cores (one
# rank always waits for a core), one process with two threads already uses both cores for
# every matmul (when the machine is not busy with other work), and each gloo all-reduce of a
# 2 KiB vector costs far more than moving 2 KiB should: the curve above is nearly flat, so
# the cost is latency (sockets, and waiting until all three ranks are scheduled), not
# bandwidth, and it is paid 61 times per token. So on this CPU tp = 3 is
# *slower* than one process; the next section models the hardware where it is not.

# %% [markdown]
# ## 5 · Play: a scaling model for a 70B model on 8 GPUs
#
# This is a **model**, not a measurement (`llmlab.parallel.comm.tp_decode_model`). One decode
# step at batch 1 reads each rank's share of the weights and KV cache at HBM bandwidth (A100
# 80GB: 2039 GB/s; compute at 312 TFLOP/s is far from the limit) and then waits for
# 2 × 80 + 1 ring all-reduces of one hidden vector (16 KiB in bf16) plus the logits all-gather
# over the interconnect (NVLink 3: 300 GB/s each way; PCIe 4.0: about 25 GB/s), with an
# assumed 2 µs per ring hop. Splitting divides the memory time by tp; the all-reduces do not
# shrink, and at batch 1 they are mostly latency. Move the sliders: tp degree and link bandwidth.

# %%
import ipywidgets as widgets

from llmlab.parallel.comm import A100_NVLINK
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
# ## 6 · Exercises
#
# **Exercise 1.** Write `column_shard(weight, rank, tp)`: given a full `nn.Linear` weight in
# torch's `[out, in]` layout, return the block a `ColumnParallelLinear` on `rank` of `tp` holds.
# *Hint:* output features are the rows of `weight`; `torch.chunk` or slicing with
# `ColumnParallelLinear.shard_range` logic.

# %%
from llmlab.exercises.nb07 import check_allreduce_bytes, check_column_shard, check_valid_degrees


def column_shard(weight, rank, tp):
    # YOUR CODE HERE
    return None  # replace: the rows rank `rank` of `tp` holds


ok = check_column_shard(column_shard)

# %% [markdown]
# **Exercise 2.** How many bytes are all-reduced per generated token when SmolLM2-135M runs at
# tp = 3 in **bfloat16**? Count message sizes (not ring traffic).
# *Hint:* `cfg.num_layers`, `cfg.hidden_size`; which modules end in an all-reduce? (Afterwards,
# compare with `llmlab.parallel.comm.allreduce_per_token`.)

# %%
# YOUR CODE HERE
allreduce_bytes = None  # replace with a number of bytes

ok = check_allreduce_bytes(allreduce_bytes)

# %% [markdown]
# **Exercise 3.** Which tensor-parallel degrees does this workbook accept for Llama-2-70B
# (64 query heads, 8 KV heads, MLP 28672, vocabulary 32000)?
# *Hint:* every rank needs whole query heads, whole KV heads, and equal MLP and vocabulary
# slices; `math.gcd`, or `llmlab.parallel.valid_tp_degrees(LLAMA2_70B)` to check yourself.

# %%
# YOUR CODE HERE
llama70b_degrees = None  # replace with a list of ints

ok = check_valid_degrees(llama70b_degrees)

# %% [markdown]
# ## 7 · Takeaways
#
# * Split column-then-row and a decoder layer needs exactly two all-reduces of one hidden vector per token; the answer is unchanged up to summation order (here < 1e-4 in float32).
# * Each rank holds and reads 1/tp of the weights, which is what makes a 70B model fit and, because decode is memory-bound, what makes it faster: on GPUs with a fast link.
# * The all-reduces do not shrink with tp and are latency-bound at small batch: on two shared CPU cores they make tp slower; the interconnect decides how far tp scales.
