# %% [markdown]
# # 07 · Tensor parallelism: one model, several processes, the same answer
#
# **Why.** Tensor parallelism splits every weight matrix of a model across several devices, so
# each one holds and reads only a slice, and the devices exchange partial results a few times
# per layer. Megatron-LM (Shoeybi et al., 2019) showed how to split a Transformer so that
# each decoder layer needs only **two all-reduces** (an *all-reduce* sums a tensor across all
# processes and leaves the sum on every one). Here the model is SmolLM2-135M, the devices are
# real processes joined by `torch.distributed` (gloo on this CPU, NCCL on GPUs), and you
# **write** the two parallel layers' forward passes yourself.
#
# This notebook: **Why** split at all → **How** (Megatron's column/row split) → **Build** (the
# column- and row-parallel forward passes, run on real processes) → **Check** (tp = 3 gives
# tp = 1's logits and tokens) → **Measure** (time per token and all-reduce cost: what two cores
# can and cannot show) → **Play** (a scaling model for a 70B model on 8 GPUs) → exercises.

# %%
import os

import torch

import llmlab
from llmlab import exercises
from llmlab.device import describe, device_name

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
for k, v in describe().items():
    print(f"{k:12s} {v}")

# %% [markdown]
# ## 1 · Why: the model does not fit, and decode reads every weight for every token
#
# Llama-2-70B in bfloat16 has more bytes of weights than one 80 GB GPU holds. Three techniques
# serve such a model: **quantization** shrinks the bytes per weight (notebook 08),
# **pipeline parallelism** puts different layers on different GPUs, and **tensor parallelism**
# splits every layer's matrices across GPUs. Tensor parallelism also makes each token faster:
# decoding one token reads every weight once (notebook 02: decode is memory-bound), so with the
# weights split over `tp` GPUs each GPU reads 1/tp of the bytes and, in the ideal case, the
# token comes `tp` times sooner. A pipeline, by contrast, still sends each token through the
# stages one after another.

# %%
# NBVAL_CHECK_OUTPUT
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
# Write a linear layer as `y = x A + b` with `A = Wᵀ` of shape `[in, out]` (torch stores `W` as
# `[out, in]`).
#
# * **ColumnParallelLinear**: rank r keeps a block of A's *columns*, the output features. From
#   the full `x` it computes its own slice of `y`, and that slice stays on the rank.
# * **RowParallelLinear**: rank r keeps a block of A's *rows*, the input features. Given its slice
#   of `x` (what a column-parallel layer produced) it can compute only a *partial* `y`: its
#   share of each dot product. The ranks' partial `y`s must be added.
#
# Attention's `q/k/v` are column-parallel (whole heads per rank: SmolLM2's 9 query and 3 KV
# heads become 3 + 1 per rank at tp = 3, so grouped-query attention stays grouped), `o_proj`
# is row-parallel. The MLP's `gate/up` are column-parallel, `down` is row-parallel. Everything
# between them (RoPE, the attention backend, SiLU) is per-head or per-feature, so it runs on
# the slices without talking to anyone. The embedding is split by vocabulary rows and the
# LM head by vocabulary columns (its logits are gathered from all ranks).
#
# Megatron-LM names the communication with two operators. **f** sits before a column-parallel
# block: in the forward pass it is the identity (every rank already has `x`); in training's
# backward pass it all-reduces the gradient of `x`. **g** sits after the row-parallel layer: in
# the forward pass it all-reduces the partial sums; backward it is the identity. They are
# conjugates: each is an all-reduce in the direction where the other is the identity. In
# inference only g does anything.

# %%
from llmlab.config import ModelConfig
from llmlab.models import resolve
from llmlab.viz.tp import plot_tp_split

cfg = ModelConfig.from_file(resolve("smollm2-135m"))
fig = plot_tp_split(cfg, 3)

# %% [markdown]
# **Warm-up (compute).** Write `column_shard(weight, rank, tp)`: given a full `nn.Linear` weight
# in torch's `[out, in]` layout, return the block a `ColumnParallelLinear` on `rank` of `tp`
# holds (`torch.chunk` or slicing).

# %%
def column_shard(weight, rank, tp):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb07.column_shard", column_shard)

# %% [markdown]
# ## Build: the column- and row-parallel forward passes
#
# Write the two forward passes, each `(x, weight, bias) -> y`, for the rank they run on:
#
# * `column_parallel_forward(x, weight, bias)`: `x` [..., in] is the full input (the same on
#   every rank), `weight` [out/tp, in] and `bias` [out/tp] are this rank's rows. Return this
#   rank's slice of `y`, [..., out/tp].
# * `row_parallel_forward(x, weight, bias)`: `x` [..., in/tp] is this rank's slice of the input,
#   `weight` [out, in/tp] this rank's columns, `bias` [out] the full bias, the same on every rank
#   (or None). Return the full `y` [..., out], identical on every rank.
#
# Inside, `torch.distributed` is the process group of the ranks: `dist.all_reduce(t)` sums `t`
# over all ranks **in place** (it returns None), `dist.get_world_size()` is tp. Think about where
# the sum is needed, and about the bias: how many times must it be added?
#
# The checker runs your functions on real processes (`llmlab.parallel.launch`, gloo): first on
# small layers with biases at tp = 2, then inside the tiny Llama at tp = 2 and SmolLM2-135M at
# tp = 3 (its 9 heads do not split in two), against one process's logits and greedy tokens.
# Your functions live in this notebook, which the spawned processes cannot import, so they
# travel as source text (`llmlab.parallel.portable`): keep what they need inside them or in
# imported modules. Expect each run to take a few seconds: starting processes costs that.

# %%
import torch.distributed as dist
import torch.nn.functional as F


def column_parallel_forward(x, weight, bias):
    # YOUR CODE HERE
    raise NotImplementedError


def row_parallel_forward(x, weight, bias):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb07.tensor_parallel_linear", (column_parallel_forward, row_parallel_forward))

# %% [markdown]
# **Compare with llmlab's.** `llmlab.layers.linear` has the same two functions,
# `column_parallel_forward` and `row_parallel_forward`, used by `ColumnParallelLinear` and
# `RowParallelLinear` (and `use_parallel_forwards(column=..., row=...)`, which is how the checker
# swapped yours in). Its row forward applies g, `reduce_from_tensor_parallel_region`, to the
# product `F.linear(x, weight)` and adds the bias after the sum; its column forward applies f,
# `copy_to_tensor_parallel_region`, to `x`, which matters only in training.
#
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
# rank 0's result. Here `fn` is `llmlab.parallel.workers.parity_on_ranks`: each rank reads
# **only its slices** of the safetensors file (`safe_open(...).get_slice`), computes logits for
# the prompt, then generates greedily with a KV cache, in lockstep with the other ranks, and
# counts the collectives of one token's forward pass. `run_sequence` runs two workers in the
# same launch (starting ranks costs seconds; the second times all-reduces).
# The command-line twin is `torchrun --nproc-per-node 3 -m llmlab.parallel.run --prompt "..."`.
#
# **Exercise (predict, then measure).** How many all-reduces does one token's forward pass make
# at tp = 3? Commit a number before the run counts them.

# %%
my_allreduce_prediction = ...  # YOUR ANSWER: a number of all-reduces

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
max_new = 8 if QUICK else 10
sizes = [256, 2304, 65536, 1 << 20] if QUICK else [256, 2304, 16384, 262144, 1 << 20]

with torch.no_grad():
    ref_logits = model(ids)
ref = llmlab.generate(model, tok, prompt, max_new_tokens=max_new)
tp3, allreduce3 = launch(run_sequence, 3, [(parity_on_ranks, ("smollm2-135m", ids, max_new, eos)),
                                           (time_allreduce, (sizes, 10))])
err = (tp3.logits - ref_logits).abs().max().item()
counted = [op for op, _ in tp3.collectives].count("all_reduce")
exercises.check("nb07.predict_allreduces", my_allreduce_prediction, measured=counted)

# %%
# NBVAL_CHECK_OUTPUT
print("tp=3 logits shape:", tuple(tp3.logits.shape))
print(f"max |logits(tp=3) - logits(tp=1)| = {err:.1e} (< 1e-4: {err < 1e-4})")
print("greedy tokens identical:", tp3.tokens == ref.token_ids)
print("text:", tok.decode([t for t in tp3.tokens if t != eos]))

# %% [markdown]
# Only the order of the summation changed (three partial sums added by the all-reduce instead
# of one long dot product), so the difference is float32 rounding.
#
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
# path is identical) and by tp = 3 (three processes of one thread each, the run above). Each
# bar is the median decode step, with a line from the fastest to the slowest step.
# tp = 2 is not possible for SmolLM2 (9 heads). `python -m llmlab.bench tp` also times one
# process with two threads.

# %%
from llmlab.parallel.workers import generate_on_ranks
from llmlab.viz.tp import plot_allreduce, plot_time_per_token

tp1 = launch(generate_on_ranks, 1, "smollm2-135m", ids[0].tolist(), max_new, "naive", "float32",
             None, eos)                                 # one process, one thread
labels = ["tp=1, 1 thread", "tp=3, 1 thread each"]
steps = [tp1.decode_s, tp3.decode_s]
for lab, run in zip(labels, (tp1, tp3)):
    print(f"{lab:22s} {run.s_per_token * 1e3:7.1f} ms/token (median of {len(run.decode_s)} steps, "
          f"{min(run.decode_s) * 1e3:.1f} to {max(run.decode_s) * 1e3:.1f})")
print(f"tp=3 / tp=1: {tp3.s_per_token / tp1.s_per_token:.2f}x the time per token")
print(f"process peak RSS: tp=1 {tp1.memory[0].peak_bytes / 2**20:.0f} MiB; tp=3 "
      f"{', '.join(f'{m.peak_bytes / 2**20:.0f}' for m in tp3.memory)} MiB per rank")
print("same tokens:", tp1.tokens == tp3.tokens)
fig = plot_time_per_token(labels, steps, device_name())

# %% [markdown]
# Where does tp = 3's time go? The run above also timed all-reduces of several sizes over the
# three ranks (each point the median of 10, with quartiles; the y axis starts at 0). A fit of
# time = latency + bytes / bandwidth separates the fixed cost per all-reduce from the cost per
# byte.

# %%
import math

from llmlab.parallel.comm import fit_latency_bandwidth

latency_us, gbps = fit_latency_bandwidth(allreduce3)
hidden_us = [r["us"] for r in allreduce3 if r["bytes"] == acct.message_bytes][0]
per_token_ms = acct.allreduces_per_token * hidden_us / 1e3
if math.isinf(gbps):
    print(f"fit over {len(allreduce3)} sizes: about {latency_us:.0f} µs per all-reduce; the time "
          f"does not grow with the message up to {allreduce3[-1]['bytes'] // 1024} KiB")
else:
    print(f"fit over {len(allreduce3)} sizes: {latency_us:.0f} µs per all-reduce + bytes / {gbps:.2g} GB/s; "
          f"for one hidden vector ({acct.message_bytes} B) the bytes term is "
          f"{acct.message_bytes / (gbps * 1e3):.1f} µs")
print(f"one hidden vector: measured median {hidden_us:.0f} µs; x {acct.allreduces_per_token} per "
      f"token = {per_token_ms:.0f} ms, against {tp3.s_per_token * 1e3:.0f} ms per decode step at "
      f"tp=3 (timed in a separate phase of the same run, so an estimate of the share)")
fig = plot_allreduce({3: allreduce3}, acct.message_bytes, device_name(),
                     fit={3: (latency_us, gbps)})

# %% [markdown]
# **Exercise (explain).** Why is tp = 3 slower than one process on this machine? Pick one:
#
# * (a) each rank does more arithmetic than the single process;
# * (b) every all-reduce waits for all three ranks, which share two cores, and that latency is
#   paid 61 times per token, while one process already uses both cores;
# * (c) the all-reduces move too many bytes for the machine's memory bandwidth;
# * (d) split weights no longer fit the CPU's caches.

# %%
my_choice = ...  # YOUR ANSWER: "a", "b", "c" or "d"
exercises.check("nb07.explain_cpu_slowdown", my_choice)

# %% [markdown]
# **What two cores can and cannot show.** They show the mechanism for real: three processes,
# a real process group, each holding a third of the weights, the same logits and tokens, and
# the exact number and size of the messages. They cannot show a speed-up: the printed ratio
# above is tp = 3's time over one process's. Tensor parallelism pays off when each rank has
# its *own* compute and memory bandwidth (a GPU each) and the all-reduce travels over a fast
# link. The printed fit says what an all-reduce costs here: for a message of one hidden vector
# almost all of it is the fixed cost per call (sockets, and waiting until all three ranks are
# scheduled), not the bytes, and it is paid 61 times per token.

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
# ## 6 · More exercises
#
# **Bytes per token (compute).** How many bytes are all-reduced per generated token when
# SmolLM2-135M runs at tp = 3 in **bfloat16**? Count message sizes (not ring traffic).

# %%
allreduce_bytes = ...  # YOUR ANSWER: a number of bytes
exercises.check("nb07.allreduce_bytes", allreduce_bytes)

# %% [markdown]
# **Valid degrees (compute).** Which tensor-parallel degrees does this workbook accept for
# Llama-2-70B (64 query heads, 8 KV heads, MLP 28672, vocabulary 32000)? Every rank needs whole
# query heads, whole KV heads, and equal MLP and vocabulary slices.

# %%
llama70b_degrees = ...  # YOUR ANSWER: a list of ints
exercises.check("nb07.valid_degrees", llama70b_degrees)

# %% [markdown]
# **Stretch: sequence-parallel RMSNorm.** Between a row-parallel layer and the next
# column-parallel one sit the residual add and RMSNorm, and with plain tensor parallelism every
# rank repeats them on the whole sequence. *Sequence parallelism* (Korthikanti et al., 2023)
# splits that region along the sequence instead: the all-reduce after the row layer becomes a
# **reduce-scatter** (sum over the ranks, and rank r keeps only the r-th block of tokens), the
# norm runs on seq/tp tokens per rank, and an all-gather before the next column layer restores
# the full sequence. An all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes
# on the wire are the same; the norm's work and activations shrink tp times.
#
# Write `sequence_parallel_norm(partial, weight, eps)`: `partial` [seq, hidden] is this rank's
# partial sum out of a row-parallel layer; return this rank's seq/tp tokens of
# RMSNorm(sum of all ranks' partials), [seq/tp, hidden]. RMSNorm(x) = x / √(mean(x²) + eps) ·
# weight, over the hidden dimension. `dist.reduce_scatter(output, list_of_tp_chunks)` is the
# collective. The check runs it on two processes.

# %%
def sequence_parallel_norm(partial, weight, eps):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb07.sequence_parallel_norm", sequence_parallel_norm)

# %% [markdown]
# ## 7 · Takeaways
#
# * Split column-then-row and a decoder layer needs exactly two all-reduces of one hidden vector per token; the answer is unchanged up to summation order (here < 1e-4 in float32).
# * Each rank holds and reads 1/tp of the weights, which is what makes a 70B model fit without quantization and, because decode is memory-bound, what makes it faster: on GPUs with a fast link.
# * The all-reduces do not shrink with tp and are latency-bound at small batch: on two shared CPU cores they make tp slower; the interconnect decides how far tp scales.
#
# ## Further reading
#
# - Shoeybi, Patwary, Puri, LeGresley, Casper, Catanzaro. *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism.* 2019. [arXiv:1909.08053](https://arxiv.org/abs/1909.08053) (the column/row split, the f and g operators)
# - Narayanan et al. *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM.* SC 2021. [arXiv:2104.04473](https://arxiv.org/abs/2104.04473) (tensor, pipeline and data parallelism together)
# - Korthikanti et al. *Reducing Activation Recomputation in Large Transformer Models* (sequence parallelism). MLSys 2023. [arXiv:2205.05198](https://arxiv.org/abs/2205.05198)
# - Patarasuk, Yuan. *Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations* (ring all-reduce). JPDC 69(2), 2009. [doi:10.1016/j.jpdc.2008.09.002](https://doi.org/10.1016/j.jpdc.2008.09.002)
# - Pope et al. *Efficiently Scaling Transformer Inference.* MLSys 2023. [arXiv:2211.05102](https://arxiv.org/abs/2211.05102) (partitioning for inference, communication costs)
# - PyTorch distributed: [torch.distributed](https://pytorch.org/docs/stable/distributed.html)
# - NVIDIA A100 product page (bandwidth, memory, peak FLOP/s): [A100](https://www.nvidia.com/en-us/data-center/a100/)
