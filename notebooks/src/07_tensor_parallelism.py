# %% [markdown]
# # 07 · Tensor parallelism: one model, several processes, the same answer
#
# **Why.** Tensor parallelism splits every weight matrix of a model across several devices, so
# each one holds and reads only a slice, and the devices exchange partial results a few times
# per layer. Megatron-LM (Shoeybi et al., 2019) showed how to split a Transformer so that
# each decoder layer needs only **two all-reduces** (an *all-reduce* sums a tensor across all
# processes and leaves the sum on every one). Here the model is SmolLM2-135M, the devices are
# real processes joined by `torch.distributed` (gloo on this CPU, NCCL on GPUs), and you
# **write** a whole decoder layer's tensor-parallel forward pass yourself.
#
# This notebook: **Why** split at all → **How** (Megatron's column/row split) → **Build** (one
# decoder layer sharded by rank, attention heads and MLP features, run on real processes) →
# **Check** (tp = 3 gives tp = 1's logits and tokens, and sends the messages the accounting
# predicts) → **Measure** (a core per rank: SmolLM2's MLPs at tp = 2 against one process,
# taken apart into matmuls, other operators and all-reduces). The appendix, notebook 07b, takes
# the split to GPUs: bytes per token in bfloat16, the degrees a 70B model allows, a scaling
# model for 8 GPUs, and sequence parallelism.

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
# **Warm-up: the two forward passes.** Write them, each `(x, weight, bias) -> y`, for the rank
# they run on:
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
# The checker runs your functions on real processes (`llmlab.parallel.launch`, gloo): on small
# layers with biases at tp = 2, then inside the tiny Llama at tp = 2, against one process's
# logits and greedy tokens. Your functions live in this notebook, which the spawned processes
# cannot import, so they travel as source text (`llmlab.parallel.portable`): keep what they
# need inside them or in imported modules. Starting processes takes a few seconds.

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
# ## Build: one decoder layer, sharded by rank
#
# Now a whole SmolLM2 decoder layer, `x + attn(norm(x))`, then `+ mlp(norm(·))`, as one rank
# of `tp` computes it. Write `tensor_parallel_block(layer, x, positions, rank, tp) -> y`:
#
# * `layer` is the **full** decoder layer (the same on every rank): `layer.input_layernorm`,
#   `layer.self_attn` (`q_proj`, `k_proj`, `v_proj`, `o_proj`, each an `nn.Linear` with a
#   `[out, in]` weight and no bias; `num_heads`, `num_kv_heads`, `head_dim`),
#   `layer.post_attention_layernorm` and `layer.mlp` (`gate_proj`, `up_proj`, `down_proj`).
#   Your function takes this rank's shard out of it, as the diagram above splits it.
# * `x` [batch, seq, hidden] is the layer's input, the same on every rank; `positions`
#   [batch, seq] the tokens' positions. Return the layer's output [batch, seq, hidden], the
#   same on every rank.
# * Two pieces of the layer are yours to call: `layer.self_attn.rotary(q, k, positions)`
#   rotates q [batch, seq, heads, head_dim] and k [batch, seq, kv_heads, head_dim] (RoPE), and
#   `layer.self_attn.backend.forward(q, k, v, causal=True)` is causal grouped-query attention
#   (query head j reads KV head j // (heads / kv_heads)), returning [batch, seq, heads, head_dim].
#
# The checker runs it on real processes: layer 0 of the tiny Llama at tp = 2 (4 query and
# 2 KV heads per rank) on a seeded input, against the unsharded layer, counting each rank's
# matrix-multiply FLOPs (a rank must do only its share) and its collectives; then **every
# layer** of the tiny Llama at tp = 2 and of SmolLM2-135M at tp = 3 runs your block, against
# one process's logits and greedy tokens. During the check llmlab's own parallel layers
# and the unsharded layer's forward passes refuse to run. Each rank here holds the whole layer
# and reads only its slices; llmlab's loader reads only the slices from the file (section 3).
# The check starts processes twice: expect about half a minute.

# %%
def tensor_parallel_block(layer, x, positions, rank, tp):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb07.tensor_parallel_block", tensor_parallel_block)

# %% [markdown]
# **Compare with llmlab's.** `llmlab.layers.linear` has the two forward passes of the warm-up,
# `column_parallel_forward` and `row_parallel_forward`, used by `ColumnParallelLinear` and
# `RowParallelLinear`. Its row forward applies g, `reduce_from_tensor_parallel_region`, to the
# product `F.linear(x, weight)` and adds the bias after the sum; its column forward applies f,
# `copy_to_tensor_parallel_region`, to `x`, which matters only in training.
#
# llmlab's TP model is the ordinary `CausalLM`, built on the meta device, with its linear and
# embedding modules swapped for the parallel ones (`llmlab.parallel.parallelize`); each rank
# loads only its shard. Its forward code is unchanged: each rank only sets its attention
# module's head counts to the local ones, so the attention module reshapes into the rank's
# heads, which is what your block did by hand. A degree that does not split the heads evenly
# is refused:

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
# counts the collectives of one token's forward pass.
# The command-line twin is `torchrun --nproc-per-node 3 -m llmlab.parallel.run --prompt "..."`.
#
# **Exercise (predict, then measure).** How many all-reduces does one token's forward pass make
# at tp = 3? Commit a number before the run counts them.

# %%
my_allreduce_prediction = ...  # YOUR ANSWER: a number of all-reduces

# %%
from llmlab.generate import encode_prompts
from llmlab.parallel import launch
from llmlab.parallel.workers import parity_on_ranks

model = llmlab.load_model("smollm2-135m")
tok = llmlab.load_tokenizer("smollm2-135m")
prompt = "What is the capital of France?"
ids = torch.tensor(encode_prompts(tok, [prompt], chat=True))
eos = cfg.eos_token_id
max_new = 8 if QUICK else 10

with torch.no_grad():
    ref_logits = model(ids)
ref = llmlab.generate(model, tok, prompt, max_new_tokens=max_new)
tp3 = launch(parity_on_ranks, 3, "smollm2-135m", ids, max_new, eos)   # one thread per rank
err = (tp3.logits - ref_logits).abs().max().item()
print(f"max |logits(tp=3) - logits(tp=1)| = {err:.1e} (the exact value depends on the CPU's BLAS)")
counted = [op for op, _ in tp3.collectives].count("all_reduce")
exercises.check("nb07.predict_allreduces", my_allreduce_prediction, measured=counted)

# %%
# NBVAL_CHECK_OUTPUT
print("tp=3 logits shape:", tuple(tp3.logits.shape))
print(f"max |logits(tp=3) - logits(tp=1)| < 1e-4: {err < 1e-4}")
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
# ## 4 · Measure: a core per rank
#
# The tp = 3 run above checks the answer and counts the messages; it is not a clock. This
# machine has two cores, and three ranks on two cores would time the operating system's
# scheduler, not tensor parallelism: an all-reduce ends only when the last rank arrives, and one
# of three ranks is always waiting for a core. A timed comparison needs a core per rank and the
# same threads on both sides: one process with one thread against **tp = 2**, two processes with
# one thread each.
#
# SmolLM2's 9 query heads do not split in two, but its MLPs do (1,536 features each), so the
# timed step is the MLP half of all 30 layers for one decode token, with SmolLM2's own weights
# (`llmlab.parallel.workers.mlp_stack_on_ranks`): per layer RMSNorm, `gate` and `up`
# column-parallel, `down` row-parallel, one all-reduce. Attention and the LM head are left out.
# First what each side holds, counted:

# %%
# NBVAL_CHECK_OUTPUT
mlp_params = cfg.num_layers * 3 * cfg.hidden_size * cfg.intermediate_size
all_params = sum(p.numel() for p in model.parameters())
print(f"MLPs of {cfg.num_layers} layers: {mlp_params / 1e6:.1f} M parameters, "
      f"{100 * mlp_params / all_params:.0f}% of the model's {all_params / 1e6:.1f} M")
for tp in (1, 2):
    print(f"  tp={tp}: each rank reads {mlp_params * 4 / tp / 2**20:5.1f} MiB of MLP weights "
          f"(float32) and makes {cfg.num_layers if tp > 1 else 0} all-reduces of "
          f"{cfg.hidden_size * 4:,} B per step")

# %% [markdown]
# **Exercise (predict, then measure).** Each rank of tp = 2 holds half of every MLP matrix and
# has a core of its own. Against one process, what happens to the time a rank spends inside
# the matrix multiplies, and to the number of operator calls its step makes (the all-reduces
# not counted)? Commit a letter before the run.

# %%
exercises.ask("nb07.predict_what_shrinks")

# %%
my_shrink_prediction = ...  # YOUR ANSWER: "a", "b", "c" or "d"

# %% [markdown]
# Each side runs the step 9 times after a warm-up, each step after a barrier, and clocks the time
# inside the all-reduces in the same runs, with the moment each rank entered each one (one clock
# for the whole machine, so the ranks' arrivals can be compared); 5 more runs, profiled, give
# the time inside the matrix multiplies and the number of operator calls
# (`llmlab.profiling.overhead`, notebook 11). The tp = 1 launch also generates the prompt's
# tokens, for its memory; the tp = 2 launch also times all-reduces alone. Each bar below is the
# median step, with a line from the fastest to the slowest.

# %%
from llmlab.parallel.comm import time_allreduce
from llmlab.parallel.workers import generate_on_ranks, mlp_stack_on_ranks, run_sequence
from llmlab.profiling.compare import compare, expect
from llmlab.viz.tp import plot_time_per_token

sizes = [256, 2304, 65536, 1 << 20] if QUICK else [256, 2304, 16384, 262144, 1 << 20]
tp1, (m1,) = launch(run_sequence, 1, [
    (generate_on_ranks, ("smollm2-135m", ids[0].tolist(), max_new, "naive", "float32", None, eos)),
    (mlp_stack_on_ranks, ("smollm2-135m",)),
])                                                          # one process, one thread
allreduce2, mlp2 = launch(run_sequence, 2, [
    (time_allreduce, (sizes, 10)),
    (mlp_stack_on_ranks, ("smollm2-135m",)),
])                                                          # two processes, one thread each
m2 = mlp2[0]                                                # tp = 2: rank 0's clock
labels = ["tp=1, 1 thread", "tp=2, 1 thread per rank"]
for lab, a in zip(labels, (m1, m2)):
    print(f"{lab:24s} {a.median_s * 1e3:6.1f} ms per step (median of {len(a.step_s)}, "
          f"{min(a.step_s) * 1e3:.1f} to {max(a.step_s) * 1e3:.1f}), threads {a.threads}")
step_cmp = compare(m1.step_s, m2.step_s, "tp=1", "tp=2")
print(step_cmp.sentence())
print(f"process peak RSS: tp=1 {tp1.memory[0].peak_bytes / 2**20:.0f} MiB; tp=3 "
      f"{', '.join(f'{m.peak_bytes / 2**20:.0f}' for m in tp3.memory)} MiB per rank")
print("tp=1 and tp=3 generate the same tokens:", tp1.tokens == tp3.tokens)
expect(m1.threads == m2.threads == 1, "one thread per process on both sides")
fig = plot_time_per_token(labels, [m1.step_s, m2.step_s], device_name(),
                          what="SmolLM2-135M's 30 MLPs, one decode token")

# %% [markdown]
# What does one all-reduce cost alone? The tp = 2 launch timed all-reduces of several sizes
# over its two ranks, each after a barrier so that both start together (each point the median
# of 10, with quartiles; the y axis starts at 0).

# %%
from llmlab.viz.tp import plot_allreduce

by_size = {r["bytes"]: r for r in allreduce2}
hidden = by_size[acct.message_bytes]
big = allreduce2[-1]
per_byte_us = max(big["us"] - hidden["us"], 0.0) / (big["bytes"] - hidden["bytes"])
print(f"one hidden vector ({acct.message_bytes:,} B): median {hidden['us']:.0f} µs "
      f"(quartiles {hidden['us_q1']:.0f} to {hidden['us_q3']:.0f})")
print(f"{big['bytes'] // 1024:,} KiB: median {big['us']:.0f} µs, so a byte costs about "
      f"{per_byte_us * 1e3:.2g} ns; the bytes of one hidden vector account for "
      f"{per_byte_us * acct.message_bytes:.1f} µs of its {hidden['us']:.0f}")
fig = plot_allreduce({2: allreduce2}, acct.message_bytes, device_name())

# %% [markdown]
# Now the step taken apart. Each bar adds up to its median step: the time inside the matrix
# multiplies, the other operators (RMSNorm, SiLU, the product and the residual add, and the
# Python and dispatcher cost of every call), and, for tp = 2, the time inside the 30
# all-reduces, split into the time before the other rank reached the same all-reduce and the
# time after.

# %%
from IPython.display import Markdown

from llmlab.viz.tp import plot_step_account

for a in (m1, *mlp2):
    print(f"tp={a.tp} rank {a.rank}: step {a.median_s * 1e3:5.1f} ms = matmuls {a.matmul_s * 1e3:5.1f} "
          f"({a.matmul_ops} calls) + other operators {a.other_s * 1e3:4.1f} ({a.other_ops} calls) "
          f"+ inside all-reduces {a.inside_collectives_s * 1e3:5.1f} ({a.collectives} calls)")
mm_cmp = compare(m1.matmul_runs, m2.matmul_runs, "one process", "rank 0")
print("in the matmuls:", mm_cmp.sentence())
coll = m2.inside_collectives_s * 1e3
waiting = min(m2.arrival_wait_median_s * 1e3, coll)        # before the other rank arrived
after = coll - waiting                                      # after both were there
for a in mlp2:
    print(f"rank {a.rank}'s all-reduces: {a.inside_collectives_s * 1e3:.1f} ms, of which "
          f"{a.arrival_wait_median_s * 1e3:.1f} ms before the other rank arrived")
print(f"rank 0, after both arrived: {after:.1f} ms for {m2.collectives} calls, "
      f"{after / m2.collectives * 1e3:.0f} µs a call; one alone after a barrier: {hidden['us']:.0f} µs")
# what the text below relies on: counted calls, and a rank's matmuls on half the weights
expect(all(a.matmul_ops == m1.matmul_ops and a.other_ops == m1.other_ops for a in mlp2),
       "as many operator calls on each rank as in one process")
expect(all(a.collectives == cfg.num_layers for a in mlp2), "one all-reduce per MLP")
expect(m2.matmul_s < m1.matmul_s, "a rank's matmuls taking less time than one process's")
fig = plot_step_account(["tp=1", *[f"tp=2, rank {a.rank}" for a in mlp2]], [m1, *mlp2],
                        device=device_name(), what="SmolLM2-135M's 30 MLPs, one decode token")

# %%
exercises.check("nb07.predict_what_shrinks", my_shrink_prediction, matmuls=mm_cmp,
                calls=(m1.matmul_ops + m1.other_ops, m2.matmul_ops + m2.other_ops))

# %%
saved = (m1.matmul_s - m2.matmul_s) * 1e3
slow_inside = after / m2.collectives * 1e3 > 1.5 * hidden["us"] or waiting > 0.25 * coll
why = ("Both parts are this machine's, not tensor parallelism's: a rank waiting for a message in "
       "gloo sleeps, and the operating system takes longer to wake it after the step's computing "
       "than right after a barrier, when both ranks are awake and in step; the rank woken later "
       "reaches the next all-reduce later, and the other waits for it." if slow_inside else
       "Inside the step an all-reduce cost about what it costs alone: its price is its latency.")
Markdown(
    f"With a core per rank, the matmuls of half the weights took {m2.matmul_s * 1e3:.1f} ms on "
    f"rank 0 against one process's {m1.matmul_s * 1e3:.1f} ms: in the matmuls, "
    f"{mm_cmp.sentence()}. Each rank made {m2.other_ops:,} other operator calls, as many as one "
    f"process: splitting shrinks each operator, not their number, and they took "
    f"{m2.other_s * 1e3:.1f} ms against {m1.other_s * 1e3:.1f} ms. The {m2.collectives} "
    f"all-reduces took {coll:.1f} ms of the {m2.median_s * 1e3:.1f} ms step: {waiting:.1f} ms "
    f"before the other rank reached the same all-reduce, and {after:.1f} ms after both were "
    f"there, {after / m2.collectives * 1e3:.0f} µs a call, where one alone after a barrier took "
    f"{hidden['us']:.0f} µs. {why} The parts add up to the step: the split saved {saved:.1f} ms "
    f"of matmuls and paid {coll:.1f} ms of all-reduces, so {step_cmp.sentence()}.")

# %% [markdown]
# **What two cores can and cannot show.** They show the mechanism for real: three processes,
# a real process group, each holding a third of the weights, the same logits and tokens, and
# the exact number and size of the messages; with a core per rank, they show what the split
# saves and what each all-reduce costs, on this run's numbers. Tensor parallelism pays off when
# each rank has its *own* compute and memory bandwidth (a GPU each), when the per-operator cost
# is small against each operator's work (large matrices, or a compiled step, notebook 11), and
# when an all-reduce costs little against the work it splits (a fast link, and no waiting).

# %% [markdown]
# **On GPUs.** Notebook 07b, the appendix, runs without the model and in seconds: the bytes a token
# all-reduces in bfloat16, the degrees Llama-2-70B's heads allow, a scaling model for 70B on 8
# GPUs (tp degree, link bandwidth and batch on sliders), and sequence parallelism's
# reduce-scatter as a stretch.

# %% [markdown]
# ## 5 · Takeaways
#
# * Split column-then-row and a decoder layer needs exactly two all-reduces of one hidden vector per token; the answer is unchanged up to summation order (here < 1e-4 in float32).
# * Each rank holds and reads 1/tp of the weights, which is what makes a 70B model fit without quantization and, because decode is memory-bound, what makes it faster: on GPUs with a fast link.
# * Neither the all-reduces nor the number of operator calls shrink with tp, and at small batch an all-reduce is all latency: section 4 weighs what the split saves against what the all-reduces cost, with a core per rank; on GPUs the interconnect decides how far tp scales.
#
# ## Further reading
#
# - Shoeybi, Patwary, Puri, LeGresley, Casper, Catanzaro. *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism.* 2019. [arXiv:1909.08053](https://arxiv.org/abs/1909.08053) (the column/row split, the f and g operators)
# - Narayanan et al. *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM.* SC 2021. [arXiv:2104.04473](https://arxiv.org/abs/2104.04473) (tensor, pipeline and data parallelism together)
# - Patarasuk, Yuan. *Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations* (ring all-reduce). JPDC 69(2), 2009. [doi:10.1016/j.jpdc.2008.09.002](https://doi.org/10.1016/j.jpdc.2008.09.002)
# - Pope et al. *Efficiently Scaling Transformer Inference.* MLSys 2023. [arXiv:2211.05102](https://arxiv.org/abs/2211.05102) (partitioning for inference, communication costs)
# - PyTorch distributed: [torch.distributed](https://pytorch.org/docs/stable/distributed.html)
