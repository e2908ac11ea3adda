# %% [markdown]
# # 05 · Continuous batching
#
# **Why.** A server sees requests arrive at random times, with prompts and answers of very
# different lengths. The textbook way to batch them, *static* batching, takes a group of requests,
# pads their prompts into one rectangle and decodes until the *longest* answer is finished: seats
# whose request ended early stay empty, and a newcomer waits for the whole batch. Yu et al. (Orca,
# OSDI 2022) introduced **iteration-level scheduling**: the batch is formed again at every forward
# pass, so a finished request leaves at once and a waiting one takes its seat at the next
# iteration, like a restaurant that seats the next guest as soon as any chair frees instead of
# waiting for the whole table to leave. vLLM (Kwon et al., SOSP 2023) runs the same scheduling over
# the paged KV cache of notebook 04, which lets it admit requests on demand and preempt one when
# memory runs out.
#
# A server is judged two ways: **throughput** (generated tokens per second, what decides how many
# machines you pay for) and the latency each user feels, the time to the first token (**TTFT**)
# and the time per output token after it (**TPOT**); DistServe (Zhong et al., OSDI 2024) states
# serving goals in exactly these terms.

# %%
import os

import torch

import llmlab
from llmlab import exercises
from llmlab.device import device_name
from llmlab.models.registry import model_dir, repo_root
from llmlab.traces import load_trace
from llmlab.viz.serving import dry_run, plot_occupancy

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
if os.environ.get("LLMLAB_THREADS"):      # e.g. 1 on a machine whose cores are busy
    torch.set_num_threads(int(os.environ["LLMLAB_THREADS"]))
torch.manual_seed(0)
tok = llmlab.load_tokenizer("smollm2-135m")
TRACE = repo_root() / "data" / "traces" / "cpu.jsonl"
trace = load_trace(TRACE, tokenizer=tok)
outs = [r.output_tokens for r in trace]
prompt_lens = [len(r.prompt_token_ids) for r in trace]
print(device_name())

# %% [markdown]
# ## Where a static batch loses
#
# `data/traces/cpu.jsonl` holds 80 requests (prompts of 16–256 tokens, answers of 8–128 tokens).
# Serve them with 8 seats. First without the model: `dry_run` drives the engine's own scheduler
# and block manager and lets every step "produce" a token, so it counts the iterations (forward
# passes) and token positions each policy needs in milliseconds.
#
# ### Exercise 1 (predict, then measure)
#
# Before running the next cell: static batching takes the requests 8 at a time and runs each batch
# until its longest answer is done; continuous batching refills a seat the moment it frees. How
# many times more iterations does static batching need on this trace? Commit a number (e.g. 1.2);
# within 25% of the measurement counts.

# %%
my_prediction = ...  # YOUR ANSWER: a ratio, e.g. 1.2

# %%
# NBVAL_CHECK_OUTPUT
SEATS_ALL = 8
runs = {policy: dry_run(prompt_lens, outs, policy, max_num_seqs=SEATS_ALL)
        for policy in ("static", "continuous")}
st, ct = runs["static"], runs["continuous"]
print(f"{len(trace)} requests, {sum(outs):,} output tokens, {sum(prompt_lens):,} prompt tokens, "
      f"{SEATS_ALL} seats")
for name, r in runs.items():
    print(f"{name:10s}: {r.iterations:4d} iterations, {r.stats.computed_tokens:6,d} token positions "
          f"({r.stats.padding_tokens:,} of them pads)")
print(f"every seat always busy would need at least {-(-sum(outs) // SEATS_ALL)} iterations")
print(exercises.check("nb05.predict_speedup", my_prediction,
                      measured=st.iterations / ct.iterations))

# %%
fig = plot_occupancy({k: r.stats for k, r in runs.items()}, SEATS_ALL,
                     title=f"the engine's scheduler on {len(trace)} requests, no model")

# %% [markdown]
# Each column is one iteration, each row a seat, each colour a request. In the static run a seat
# whose request is done turns grey and stays empty until its whole batch finishes; the continuous
# run gives it to the next request at the very next iteration. The static scheduler also pads each
# batch's prompts to the longest one, which doubles the prompt positions it computes here.
#
# ## How: the engine
#
# `llmlab.engine` has the parts of a vLLM-shaped server:
#
# * `Sequence` / `Request` (`engine/sequence.py`): tokens, how many of them already have K/V in the
#   cache (`num_computed`), a seat, a random generator, token times;
# * `Scheduler` (`engine/scheduler.py`): the waiting queue, the running list, the block manager of
#   notebook 04, and a policy, `"static"` (the baseline) or `"continuous"`, that decides each step;
# * `ModelRunner` (`engine/runner.py`): one forward pass over the paged KV cache;
# * `LLM` / `SamplingParams` (`engine/llm.py`): the offline API.
#
# Every step the engine asks the scheduler for a `SchedulerOutput` (which sequences, how many new
# tokens each), runs the model once on all of them, samples one token for every sequence that
# has fed all its tokens, and finishes the sequences that are done (freeing their seats and
# blocks).
#
# ### Exercise 2 (build): one step of continuous batching
#
# Write `schedule(sched, now) -> SchedulerOutput`, the continuous policy's decision for one
# step (requests with one completion each, whole prompts):
#
# 1. **Decodes first.** Every running sequence (`sched.running`, oldest first) gets one new token.
#    If the pool has no block for it (`not sched.bm.can_append(seq.seq_id)`), preempt the
#    **newest** running sequence *by recompute*: give its blocks back (`sched.bm.free(seq_id)`),
#    take it out of `sched.running`, `requeue(sched, seq)` it (front of the waiting queue, to be
#    prefilled again from its tokens) and list it in `out.preempted`. Repeat until the block fits,
#    or until the sequence itself was the one preempted.
# 2. **If anything was preempted, admit nobody this step**: memory is tight.
# 3. **Then newcomers**, from the head of `sched.waiting`, while the head has arrived
#    (`seq.request.arrival_time <= now`), a seat is free (`len(sched.running) <
#    sched.config.max_num_seqs`), its tokens (`seq.num_tokens`) fit in what is left of the step's
#    budget `sched.config.max_num_batched_tokens` (a prompt longer than the whole budget may still
#    run in a step that has nothing else) and the pool can hold it
#    (`sched.bm.can_allocate(seq.all_token_ids)`). Stop at the first that does not fit: first come,
#    first served.
#
# Three given helpers do the bookkeeping: `decode_one(sched, seq, out)` reserves the slot and
# schedules one token, `admit(sched, seq, out)` allocates the head of the queue, seats it and
# schedules its whole prompt (it returns the token count), and `requeue(sched, seq)` is the
# second half of a preemption. The checker runs single steps on hand-built queues, then serves the
# whole trace through the engine's scheduler with your step and a pool small enough to preempt
# (no request may be lost or run twice, and it must beat static batching), then serves 10
# requests on **tiny-llama** (the tiny random model, to keep the check to seconds) through the
# real engine, whose greedy tokens must equal generating each request alone.

# %%
from llmlab.engine.scheduler import SchedulerOutput
from llmlab.exercises.nb05 import admit, decode_one, requeue


def schedule(sched, now):
    out = SchedulerOutput(packed=True)
    # YOUR CODE HERE: 1. decodes, preempting the newest when blocks run out;
    # 2. no admission after a preemption; 3. newcomers within seats, budget and blocks
    raise NotImplementedError


exercises.check("nb05.schedule", schedule)

# %% [markdown]
# Compare with llmlab's: `Scheduler._schedule_continuous` in `llmlab/engine/scheduler.py` is this
# step, plus what the exercise left out: a request with `n` completions needs `n` seats (its
# completions fork after the prompt), and with `enable_chunked_prefill` prompts are fed in chunks
# (below). `LLM(model, tok, scheduler=schedule)` runs the engine with your function instead.
#
# ## Packing: no padding
#
# Prompts that join are **packed**: the runner concatenates every sequence's new tokens into one
# row and marks where each starts with `cu_seqlens`, FlashAttention's variable-length convention.
# Here are two steps of the engine on the tiny random model: three prompts arrive, then everyone
# decodes.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.engine import LLM, SamplingParams

tiny = llmlab.load_model("tiny-llama", attention="sdpa")
demo = LLM(tiny, tok, max_num_seqs=4, block_size=4, num_blocks=32)
eng = demo.engine
for ids in ([11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37]):
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
for _ in range(2):
    eng.step()
    s = eng.runner.packed.step
    print("cu_seqlens", s.cu_seqlens.tolist(), "| fresh prompts", s.fresh, "| decodes", s.decode)

# %% [markdown]
# Fourteen prompt tokens cost fourteen token positions, not 3 × 7 = 21; the next step is three
# single-token decodes in one row. Attention inside each layer keeps the sequences apart: fresh
# prompts attend causally among their own tokens (one call over the packed rows, bounded by
# `cu_seqlens`), decodes read their K/V from the paged pool through their block tables.
#
# ### Exercise 3 (compute): padding
#
# Five prompts of lengths `[12, 40, 7, 33, 25]` are left-padded into one rectangle. How many pad
# tokens does the rectangle hold?

# %%
answer = ...  # YOUR ANSWER: an integer
exercises.check("nb05.padding", answer)

# %% [markdown]
# ### Exercise 4 (build): cu_seqlens
#
# Write `cu_seqlens(lengths)`, the offsets of packed sequences: sequence i owns rows
# `cu[i] .. cu[i+1] − 1` of the packed row, and the list has one entry more than there are
# sequences.

# %%
def cu_seqlens(lengths):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb05.cu_seqlens", cu_seqlens)

# %% [markdown]
# ## Check: batching changes no token
#
# Three prompts on SmolLM2-135M, greedy, through both schedulers with 2 seats, against generating
# each prompt alone.

# %%
# NBVAL_CHECK_OUTPUT
model = llmlab.load_model("smollm2-135m", attention="sdpa")
check_prompts = ["What is the capital of France?", "Name three primary colors.", "2+2="]
lens = [8, 5, 3]
params = [SamplingParams(temperature=0, max_tokens=n) for n in lens]
for policy in ("continuous", "static"):
    llm = LLM(model, tok, scheduler=policy, max_num_seqs=2, num_blocks=32)
    got = llm.generate(check_prompts, params, use_tqdm=False)
    same = [g.outputs[0].token_ids == llmlab.generate(model, tok, p, max_new_tokens=n, chat=False,
                                                      kv_cache="contiguous").token_ids
            for p, n, g in zip(check_prompts, lens, got)]
    print(f"{policy:10s} same tokens as alone: {same}")

# %% [markdown]
# ## Measure: HF transformers vs llmlab static vs llmlab continuous
#
# A slice of the trace on SmolLM2-135M, all requests arriving at t = 0, greedy, each request
# generating exactly its `output_tokens` (EOS ignored, as serving benchmarks do), four ways:
#
# 1. HF transformers `generate` in padded static batches (left padding, `max_new_tokens` = the
#    batch's longest request: what a padded static batch costs);
# 2. llmlab `scheduler="static"`: the same batches over the paged cache;
# 3. llmlab `scheduler="continuous"`;
# 4. the same with chunked prefill (below).
#
# The first 8 requests with prompts of at most 64 tokens, 4 seats, every output length scaled by
# 1/10 (their spread, which is what static batching pays for, is kept) so that one round takes a
# few seconds; the prefix cache is
# off, so every round computes the same work. Five rounds with the systems interleaved, after a
# warm-up; the bars are medians, the whiskers min–max. `python -m llmlab.bench serve` runs all 80
# requests at full length.

# %%
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from llmlab.bench.serve import run_hf, run_llmlab
from llmlab.profiling.metrics import summarize
from llmlab.viz.serving import plot_rounds

hf_logging.disable_progress_bar()
N, SEATS, ROUNDS = (6, 3, 3) if QUICK else (8, 4, 5)
part = [r for r in load_trace(TRACE, tokenizer=tok, output_scale=0.1)
        if len(r.prompt_token_ids) <= 64][:N]
hf = AutoModelForCausalLM.from_pretrained(str(model_dir("smollm2-135m")), dtype=torch.float32).eval()
engine_args = dict(max_num_seqs=SEATS, num_blocks=128, enable_prefix_caching=False)
engines = {"llmlab static": LLM(model, tok, scheduler="static", **engine_args),
           "llmlab continuous": LLM(model, tok, **engine_args),
           "llmlab continuous, chunked prefill": LLM(model, tok, enable_chunked_prefill=True,
                                                     max_num_batched_tokens=64, **engine_args)}
systems = {"HF transformers (padded static)": lambda: run_hf(hf, tok, part, SEATS)}
systems.update({name: (lambda e=e: run_llmlab(e, part)) for name, e in engines.items()})
for run in systems.values():          # warm-up
    run()
rounds = {name: [] for name in systems}
for _ in range(ROUNDS):
    for name, run in systems.items():
        rounds[name].append(run())
summaries = {k: [summarize(r["metrics"], r["wall_s"]) for r in v] for k, v in rounds.items()}
tps = {k: [s["tokens_per_s"] for s in v] for k, v in summaries.items()}
med = {k: sorted(v)[len(v) // 2] for k, v in tps.items()}
HF, STATIC, CONT, CHUNK = systems
fig = plot_rounds({k: tps[k] for k in (HF, STATIC, CONT)}, "generated tokens/s",
                  title=f"SmolLM2-135M, {N} requests, {SEATS} seats ({device_name()})")
for k in (HF, STATIC, CONT):
    print(f"{k:32s} {med[k]:6.1f} tok/s (min {min(tps[k]):.1f}, max {max(tps[k]):.1f})")
print(f"medians: continuous / HF {med[CONT] / med[HF]:.2f}×, static / HF {med[STATIC] / med[HF]:.2f}× "
      f"({device_name()})")

# %% [markdown]
# ### The padding that packing saves, counted in tokens

# %%
# NBVAL_CHECK_OUTPUT
last = {name: v[-1] for name, v in rounds.items()}
for name in (STATIC, CONT):
    s = last[name]["stats"]
    print(f"{name:18s}: {s.computed_tokens} token positions computed for {s.real_tokens} real "
          f"tokens -> {s.padding_tokens} pads, {len(s.steps)} iterations")
print(f"HF padded static  : {last[HF]['positions']} token positions "
      "(padded prompts, and rows whose request is already done keep decoding)")

# %% [markdown]
# ### Where the speedup comes from: work saved × time per position
#
# A speedup has two factors: how many token positions each system computes (a pad, or a row whose
# request is already done, costs a forward row like a real token), and how long one position
# takes. Divide the measured speedup by the work ratio and what is left is the second factor.

# %%
for name in (HF, STATIC):
    work = last[name]["positions"] / last[CONT]["positions"]
    speed = med[CONT] / med[name]
    print(f"{name:32s} {last[name]['positions']:5d} positions = {work:.2f}× continuous's "
          f"{last[CONT]['positions']}; measured {speed:.2f}× faster -> continuous spends "
          f"{work / speed:.2f}× the time per position")

# %% [markdown]
# On this CPU the work ratio explains most of the speedup: the matrix multiplies are most of the
# cost, and they charge a pad as much as a real token. The time per position (the last number)
# differs by tens of percent between systems and between runs: HF's `generate` is another
# implementation with its own overheads, and near the end of a trace a continuous step has only
# a few rows, notebook 02's memory-bound corner, where each row costs more. So expect about the
# work ratio from scheduling alone, and the number of seats sets it: the more requests share a
# static batch, the longer the longest of them and the more seats sit idle. The README's results
# table has `python -m llmlab.bench serve` on the whole trace with 32 and 64 seats. Past the work
# ratio, a speedup has to come from a cheaper position: the subject of the kernel notebooks
# (03 and 04).
#
# ### Chunked prefill: no step is long
#
# A step that prefills a newcomer's prompt is long, and every sequence that is decoding waits for
# it: that wait is part of their TPOT. With `enable_chunked_prefill=True` the token budget
# `max_num_batched_tokens` becomes a hard cap per step: decodes go first, and a prompt is fed in
# chunks of whatever budget is left, over several steps (Agrawal et al.: Sarathi, 2023, and
# Sarathi-Serve, OSDI 2024; vLLM's V1 engine enables it by default). System 4 above is the same
# requests with a budget of 64 tokens per step:

# %%
from llmlab.viz.serving import plot_step_times

for name in (CONT, CHUNK):
    tpot = sorted(s["tpot_p90_s"] for s in summaries[name])[ROUNDS // 2]
    ttft = sorted(s["ttft_mean_s"] for s in summaries[name])[ROUNDS // 2]
    biggest = max(r.prefill_tokens + r.decode_tokens for r in last[name]["stats"].steps)
    print(f"{name:36s} {med[name]:6.1f} tok/s   TPOT p90 {tpot * 1e3:4.0f} ms   TTFT mean "
          f"{ttft:5.2f} s   largest step {biggest} tokens   (medians of {ROUNDS} rounds)")
print("same tokens as without chunks:", last[CHUNK]["tokens"] == last[CONT]["tokens"])
fig = plot_step_times({"continuous": last[CONT]["stats"],
                       "chunked prefill, 64 tokens/step": last[CHUNK]["stats"]},
                      title=f"SmolLM2-135M, {N} requests, {SEATS} seats, last round ({device_name()})")

# %% [markdown]
# With chunks no step feeds more than 64 tokens (the printed largest step): no decoding request
# waits for a whole long prompt any more. Now compare the throughput and the TPOT of the two.
#
# ### Exercise 5 (explain): chunks on a CPU
#
# On this CPU chunked prefill does not lower TPOT and costs throughput. Why? Answer with a letter.
#
# - (a) Chunking does not make prompt tokens cheaper, it only moves them into more steps. It pays
#   where a decode step has spare compute (a memory-bound step far below the ridge point, as on a
#   GPU), so prompt tokens ride along almost free; here every prompt token costs its full compute.
# - (b) Each chunk recomputes the chunks before it.
# - (c) Chunking changes the tokens, so the runs are not comparable.
# - (d) Chunks need a smaller block size, which makes attention slower.

# %%
my_choice = ...  # YOUR ANSWER: "a", "b", "c" or "d"
exercises.check("nb05.explain_chunking", my_choice)

# %% [markdown]
# Notebook 02's roofline says why. A decode step is memory-bound only while the batch is a handful
# of rows: reading the weights costs the same for 1 row or 4. Sixty prompt tokens added to that
# step are not free on this CPU; they cost their full compute, so every chunk step is slower than
# a pure decode step, and the prompt's cost is spread over more of everyone's tokens instead of
# being paid once. On a GPU the ridge point is hundreds of FLOPs per byte: a decode step of 32 rows
# is far below it, and a few hundred prompt tokens ride along almost for free. That is the regime
# chunked prefill was made for, and why a CPU engine may leave it off.
#
# ### Throughput against latency as the load grows
#
# Now requests arrive over time: the trace's arrival times, rescaled to an average rate. For this
# sweep we use the **tiny random model (tiny-llama)** so that the runs fit in seconds; its numbers
# show the shape, not SmolLM2's speed. Each point is the median of 5 runs (whiskers: min–max).

# %%
from llmlab.viz.serving import arrival_sweep, plot_throughput_latency

sweep_n = 8 if QUICK else 12
sweep = trace[:sweep_n]
rates = [40, 2560] if QUICK else [40, 320, 2560]
llms = {p: LLM(tiny, tok, scheduler=p, max_num_seqs=4, num_blocks=256) for p in ("static", "continuous")}
rows = arrival_sweep(llms, [r.prompt_token_ids for r in sweep],
                     [min(r.output_tokens, 24) for r in sweep],
                     [r.arrival_s for r in sweep], rates, repeats=5)
fig = plot_throughput_latency(rows, title=f"tiny-llama, {sweep_n} requests, 4 seats ({device_name()})")
for r in rows:
    print(f"{r['policy']:10s} {r['rate']:5g} req/s: {r['tokens_per_s']:7.0f} tok/s, "
          f"mean e2e {r['e2e_mean_s']:.2f} s")
lat = {p: [r["e2e_mean_s"] for r in rows if r["policy"] == p] for p in llms}
ratios = [s / c for s, c in zip(lat["static"], lat["continuous"])]
print(f"mean latency, static / continuous, per rate: {', '.join(f'{x:.2f}×' for x in ratios)}; "
      f"static is slower at {sum(x > 1 for x in ratios)} of {len(ratios)} rates")

# %% [markdown]
# A request that arrives while a static batch runs waits for the whole batch, and a seat whose
# request is done stays empty until the batch's longest one finishes, so the queue behind moves
# more slowly; continuous batching avoids both, which the printed ratios measure at each rate. At the highest rate every request is already
# waiting when the first batch starts: the closed-batch case of the occupancy picture above.
# The tiny model's steps take milliseconds, so on a busy machine the whiskers are wide.
#
# ## Play: seats and the block budget
#
# 24 requests on tiny-llama with `block_size=4`. Fewer KV blocks than the running sequences need
# forces **preemption by recompute**: the newest running sequence gives its blocks back and returns
# to the front of the queue, to be prefilled again (prompt + what it had generated) when blocks free
# up. Every request still finishes: watch the red markers and the iteration count.

# %%
import ipywidgets as widgets

from llmlab.viz.serving import explore_batching

widgets.interactive(explore_batching, max_num_seqs=widgets.IntSlider(8, 1, 16),
                    num_blocks=widgets.IntSlider(40, 20, 160, 4), block_size=widgets.fixed(4),
                    scheduler=["continuous", "static"])

# %%
fig = explore_batching(max_num_seqs=8, num_blocks=24)

# %% [markdown]
# ### Exercise 6 (compute): static iterations
#
# Output lengths `[5, 60, 8, 12, 90, 7, 3, 40]` arrive in this order and a static scheduler takes
# them 4 at a time. How many decode iterations does it run?

# %%
answer = ...  # YOUR ANSWER: an integer
exercises.check("nb05.static_steps", answer)

# %% [markdown]
# ## Stretch (build): a prefix-cache-aware admission policy
#
# First come, first served ignores what the prefix cache holds. When requests over a few system
# prompts arrive interleaved and the pool can keep only about one prompt's blocks, each request
# finds its prefix evicted by the others. Write `prefix_aware(sched, now)`: the same step as
# exercise 2, except that among the requests that have arrived, those whose prompt starts with
# cached blocks join first (most cached blocks first, then arrival order). The helper
# `cached_blocks(sched, seq)` tells how many leading blocks of `seq`'s tokens are cached now. The
# checker serves 16 requests over 4 system prompts, interleaved, with 2 seats and a 12-block pool,
# and counts the prompt tokens computed; yours must compute fewer than first come, first served.

# %%
from llmlab.exercises.nb05 import cached_blocks


def prefix_aware(sched, now):
    # YOUR CODE HERE (reorder sched.waiting, then take the step of exercise 2)
    raise NotImplementedError


exercises.check("nb05.prefix_aware", prefix_aware)

# %% [markdown]
# Reordering trades fairness for reuse: a request whose prefix nobody shares can be passed over
# again and again, so a real policy bounds the wait.
#
# ## Takeaways
#
# * A static batch runs as long as its longest request; iteration-level scheduling (Orca) gives a
#   finished seat to the next request at the very next forward pass.
# * Packing prompts by `cu_seqlens` spends compute only on real tokens; padding is pure waste.
# * With a paged cache, running out of blocks is not an error: preempt, free, recompute later.
#
# ## Further reading
#
# - Yu, Jeong, Kim, Kim, Chun. *Orca: A Distributed Serving System for Transformer-Based Generative Models* (iteration-level scheduling). OSDI 2022. [USENIX](https://www.usenix.org/conference/osdi22/presentation/yu)
# - Kwon, Li, Zhuang, Sheng, Zheng, Yu, Gonzalez, Zhang, Stoica. *Efficient Memory Management for Large Language Model Serving with PagedAttention.* SOSP 2023. [arXiv:2309.06180](https://arxiv.org/abs/2309.06180)
# - Agrawal, Panwar, Mohan, Kwatra, Gulavani, Ramjee. *SARATHI: Efficient LLM Inference by Piggybacking Decodes with Chunked Prefills.* 2023. [arXiv:2308.16369](https://arxiv.org/abs/2308.16369)
# - Agrawal, Kedia, Panwar, Mohan, Kwatra, Gulavani, Tumanov, Ramjee. *Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve.* OSDI 2024. [arXiv:2403.02310](https://arxiv.org/abs/2403.02310)
# - Zhong et al. *DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving* (TTFT and TPOT as service objectives). OSDI 2024. [arXiv:2401.09670](https://arxiv.org/abs/2401.09670)
# - Dao. *FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning* (the variable-length interface, `cu_seqlens`). 2023. [arXiv:2307.08691](https://arxiv.org/abs/2307.08691)
# - vLLM documentation: [docs.vllm.ai](https://docs.vllm.ai/)
