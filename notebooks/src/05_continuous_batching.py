# %% [markdown]
# # 05 · Continuous batching
#
# **Why.** A server sees requests arrive at random times, with prompts and answers of very
# different lengths. The textbook way to batch them, *static* batching, takes a group of requests,
# pads their prompts into one rectangle and decodes until the *longest* answer is finished: seats
# whose request ended early stay empty, and a newcomer waits for the whole batch. Yu et al. (Orca,
# OSDI 2022) introduced **iteration-level scheduling**: the batch is formed again at every forward
# pass, so a finished request leaves at once and a waiting one takes its seat at the next
# iteration. vLLM (Kwon et al., SOSP 2023) runs the same scheduling over
# the paged KV cache of notebook 04, which lets it admit requests on demand and preempt one when
# memory runs out.
#
# A server is judged two ways: **throughput** (generated tokens per second) and the latency each user feels, the time to the first token (**TTFT**)
# and the time per output token after it (**TPOT**); DistServe (Zhong et al., OSDI 2024) states
# serving goals in exactly these terms.

# %%
import os

import torch

from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.device import device_name
from llmlab.models.registry import model_dir, repo_root
from llmlab.traces import load_trace
from llmlab.engine.simulate import dry_run
from llmlab.profiling import expect
from llmlab.viz.serving import plot_occupancy

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
# Serve them with 8 seats. First without the model: `llmlab.engine.simulate.dry_run` runs the
# engine's own scheduler and block manager over a simulated runner that lets every step "produce"
# a token, so it counts the iterations (forward passes) and token positions each policy needs in
# milliseconds.
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
# Write `schedule(sched, now) -> SchedulerOutput`: the continuous policy's decision for one step,
# for requests with one completion each and whole prompts (no chunks). The rules are Orca's and
# vLLM's:
#
# * every running sequence gets its next token in this step;
# * when the KV pool has no room for a running sequence's next token, the **newest** running
#   sequence is preempted *by recompute*: it gives its blocks back and waits again at the front of
#   the queue, to be prefilled from its tokens later (nothing is lost); this repeats as often as
#   needed, and a step that preempted admits nobody (memory is tight);
# * waiting requests that have arrived by `now` join first come, first served, while there is a
#   free seat (`max_num_seqs`), room in the step's token budget (`max_num_batched_tokens`; a
#   prompt longer than the whole budget may still run in a step that has nothing else) and room in
#   the pool; the first request that does not fit ends the admissions.
#
# What the scheduler offers: `sched.running` (a list, admission order), `sched.waiting` (a deque,
# arrival order; `seq.request.arrival_time`), `sched.config`, and the block manager `sched.bm`
# (`can_append(seq_id)`, `can_allocate(token_ids)`, `free(seq_id)`); a sequence has `seq_id`,
# `num_tokens` and `all_token_ids`. Three helpers do the bookkeeping, each documented in
# `llmlab/exercises/nb05.py`: `decode_one(sched, seq, out)` (a slot and one decode token),
# `admit(sched, seq, out)` (the head of the queue joins with its whole prompt; returns its token
# count) and `requeue(sched, seq)` (the second half of a preemption). A preempted sequence is listed
# in `out.preempted`.
#
# The checker runs single steps on hand-built queues, serves the whole trace with your step and a
# pool small enough to preempt (nothing lost or run twice; it must beat static batching), then 10
# requests on **tiny-llama** (the tiny random model) through the real engine, whose greedy tokens
# must equal generating each request alone.

# %%
from llmlab.engine.scheduler import SchedulerOutput
from llmlab.exercises.nb05 import admit, decode_one, requeue


def schedule(sched, now):
    out = SchedulerOutput(packed=True)
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb05.schedule", schedule)

# %% [markdown]
# Compare with llmlab's: the continuous policy in `llmlab/engine/scheduler.py` is this step, plus
# what the exercise left out: a request with `n` completions needs `n` seats (its completions fork
# after the prompt), and with `enable_chunked_prefill` prompts are fed in chunks (below).
# `LLM(model, tok, scheduler=schedule)` runs the engine with your function instead.
#
# ## Packing: no padding
#
# Prompts that join are **packed**: the runner concatenates every sequence's new tokens into one
# row, and FlashAttention's variable-length convention marks where each sequence starts with one
# list of offsets, `cu_seqlens`. A padded rectangle would instead make every prompt as long as
# the longest one.
#
# ### Exercise 3 (build): cu_seqlens
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
# Compare with the engine's own: two steps of it on the tiny random model, three prompts
# arriving, then everyone decoding.

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
# Fourteen prompt tokens cost fourteen token positions, where a padded rectangle would hold
# 3 × 7 = 21; the next step is three single-token decodes in one row. Attention inside each layer
# keeps the sequences apart: fresh prompts attend causally among their own tokens (one call over
# the packed rows, bounded by `cu_seqlens`), decodes read their K/V from the paged pool through
# their block tables.
#
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
# Continuous batching refills decode seats, so it is measured where decoding is the work: requests
# with short prompts and long answers, as in a chat. From the trace, the first requests with prompts
# of at most 40 tokens, each generating 40% of its trace length (the spread of the lengths, which
# is what static batching pays for, is kept), all arriving at t = 0, greedy, EOS ignored as serving
# benchmarks do, on SmolLM2-135M, three ways:
#
# 1. HF transformers `generate` in padded static batches (left padding, `max_new_tokens` = the
#    batch's longest request: what a padded static batch costs);
# 2. llmlab `scheduler="static"`: the same batches over the paged cache;
# 3. llmlab `scheduler="continuous"`.
#
# The prefix cache is off, so every round computes the same work. Three rounds with the systems
# interleaved, after a short warm-up; the bars are medians, the whiskers min–max.
# `python -m llmlab.bench serve` runs all 80 requests.

# %%
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from llmlab.bench.serve import run_hf, run_llmlab
from llmlab.profiling.metrics import summarize
from llmlab.profiling.steps import fit_step_cost, prompt_token_cost, step_arrays
from llmlab.viz.serving import plot_rounds

hf_logging.disable_progress_bar()
N, SEATS, ROUNDS = (6, 3, 3) if QUICK else (8, 4, 3)
short = [r for r in load_trace(TRACE, tokenizer=tok, output_scale=0.4)
         if len(r.prompt_token_ids) <= 40]
part, warm = short[:N], [r for r in load_trace(TRACE, tokenizer=tok, max_output=4)][:SEATS]
hf = AutoModelForCausalLM.from_pretrained(str(model_dir("smollm2-135m")), dtype=torch.float32).eval()
engine_args = dict(max_num_seqs=SEATS, num_blocks=128, enable_prefix_caching=False)
engines = {"llmlab static": LLM(model, tok, scheduler="static", **engine_args),
           "llmlab continuous": LLM(model, tok, **engine_args)}
systems = {"HF transformers (padded static)": lambda reqs: run_hf(hf, tok, reqs, SEATS)}
systems.update({name: (lambda reqs, e=e: run_llmlab(e, reqs)) for name, e in engines.items()})
for run in systems.values():          # warm-up
    run(warm)
rounds = {name: [] for name in systems}
for _ in range(ROUNDS):
    for name, run in systems.items():
        rounds[name].append(run(part))
HF, STATIC, CONT = systems
ms, rows, prompt = step_arrays(r["stats"] for r in rounds[CONT])
decode_share = ms[prompt == 0].sum() / ms.sum()
print(f"the work: {sum(len(r.prompt_token_ids) for r in part)} prompt tokens, "
      f"{sum(r.output_tokens for r in part)} generated; in the continuous runs, steps that only "
      f"decode take {decode_share:.0%} of the step time")
expect(decode_share > 0.5, "a decode-dominated run (decode-only steps over half the time)")

# %% [markdown]
# First the count, which no noise can change: iterations (forward passes) and token positions.

# %%
# NBVAL_CHECK_OUTPUT
last = {name: v[-1] for name, v in rounds.items()}
for name in (STATIC, CONT):
    s = last[name]["stats"]
    print(f"{name:18s}: {len(s.steps)} iterations, {s.computed_tokens} token positions for "
          f"{s.real_tokens} real tokens ({s.padding_tokens} pads)")
hf_iterations = sum(max(r.output_tokens for r in part[i:i + SEATS])
                    for i in range(0, len(part), SEATS))
print(f"HF padded static  : {hf_iterations} iterations, {last[HF]['positions']} token positions "
      "(padded prompts, and rows whose request is done keep decoding)")

# %% [markdown]
# Both static systems run the same number of iterations: every batch lasts as long as its longest
# answer. llmlab's static batch stops computing a row whose request is done (its seat stays empty),
# HF's keeps decoding it. Continuous batching computes no more positions than llmlab static minus
# its pads, but in fewer iterations: the freed seats are filled instead of left empty.
#
# Then the time. Each system did the same work in every round, so its wall times compare
# directly; `llmlab.profiling.compare` gives the ratio of the medians with a bootstrap interval
# over the rounds, and says "no difference at this noise" when the interval straddles 1.

# %%
from llmlab.profiling import compare

walls = {k: [r["wall_s"] for r in v] for k, v in rounds.items()}
tps = {k: [summarize(r["metrics"], r["wall_s"])["tokens_per_s"] for r in v]
       for k, v in rounds.items()}
fig = plot_rounds(tps, "generated tokens/s",
                  title=f"SmolLM2-135M, {N} requests, {SEATS} seats ({device_name()})")
vs_static = compare(walls[STATIC], walls[CONT], "llmlab static", "llmlab continuous")
vs_hf = compare(walls[HF], walls[CONT], "HF padded static", "llmlab continuous")
static_hf = compare(walls[HF], walls[STATIC], "HF padded static", "llmlab static")
for c in (vs_static, vs_hf, static_hf):
    print(c.sentence())
iter_ratio = len(last[STATIC]["stats"].steps) / len(last[CONT]["stats"].steps)
display(Markdown(
    f"Static needs {iter_ratio:.2f}× the iterations of continuous here; in time, "
    f"{vs_static.sentence()}. The time gain is smaller than the iteration count's because "
    "a step is not free of its rows: the next cell measures by how much."))
expect(vs_static.verdict == "faster", "continuous batching faster than llmlab's static batches")

# %% [markdown]
# ### Where the speedup comes from: a step's fixed cost
#
# Which count sets the time, iterations or positions? The engine logs every step's duration, how
# many sequences it decoded (rows) and how many prompt tokens it fed. A least-squares fit over every
# step of both llmlab systems and all rounds splits a step into a part every step pays and parts
# that grow with its work (`llmlab.profiling.steps.fit_step_cost`):

# %%
cost = fit_step_cost(r["stats"] for name in (STATIC, CONT) for r in rounds[name])
medwall = {k: sorted(v)[ROUNDS // 2] for k, v in walls.items()}
print(f"step time ≈ {cost.fixed_ms:.1f} ms + {cost.per_row_ms:.2f} ms per decoding row + "
      f"{cost.per_prompt_token_ms:.2f} ms per prompt token (fit over {cost.num_steps} steps, "
      f"rms residual {cost.rms_ms:.1f} ms)")
print(f"a decode step of {SEATS} rows: {cost.predict_ms(SEATS):.1f} ms = "
      f"{cost.predict_ms(SEATS) / cost.predict_ms(1):.2f}× a step of 1 row; the fixed part is "
      f"{cost.fixed_share(SEATS):.0%} of it")
steps = {k: len(last[k]["stats"].steps) for k in (STATIC, CONT)}
fixed_s = (steps[STATIC] - steps[CONT]) * cost.fixed_ms / 1e3
print(f"static runs {steps[STATIC] - steps[CONT]} more steps than continuous; at "
      f"{cost.fixed_ms:.1f} ms of fixed cost each that is {fixed_s:.2f} s, of a measured "
      f"difference of {medwall[STATIC] - medwall[CONT]:.2f} s (median walls)")
hf_extra = last[HF]["positions"] - last[CONT]["positions"]
print(f"HF computes {hf_extra} positions more than continuous: at llmlab's {cost.per_row_ms:.2f} "
      f"ms per row that would be {hf_extra * cost.per_row_ms / 1e3:.2f} s; its time per "
      f"iteration is {medwall[HF] / hf_iterations * 1e3:.1f} ms against llmlab static's "
      f"{medwall[STATIC] / steps[STATIC] * 1e3:.1f} ms")
row_vs_step = cost.per_row_ms / cost.predict_ms(1)
display(Markdown(
    f"On this machine a decoding row adds {cost.per_row_ms:.2f} ms to a step whose fixed part is "
    f"{cost.fixed_ms:.1f} ms: one more row costs {row_vs_step:.0%} of a one-row step. "
    + ("So in a decode-dominated run the number of iterations, not the number of token positions, "
       "sets the time: a pad, or a finished row that keeps decoding, costs little, while every "
       "extra iteration costs a whole weight read. Continuous batching wins by putting a waiting "
       "request into a seat of a step that is paid for anyway. Notebook 02 measured the same "
       "thing on the roofline: a decode step is memory-bound, and a larger batch costs far less "
       "than proportionally more."
       if row_vs_step < 0.5 else
       "Here a row is not cheap next to a step, so positions matter as much as iterations: "
       "this machine's decode steps are not dominated by reading the weights.")))
expect(row_vs_step < 0.5, "a decoding row costing less than half a one-row step")

# %% [markdown]
# The seats set the size of the gain: the more requests share a static batch, the longer the
# longest of them and the more seats sit idle. The README's results table has
# `python -m llmlab.bench serve` on the whole trace with 32 and 64 seats.
#
# ### Latency as the load grows
#
# So far every request was waiting at t = 0. A server's requests arrive over time, and what its
# users feel is the latency at a given load. Here the trace's 80 requests keep their full answer
# lengths (9–113 tokens) and arrive as a **Poisson process** (independent exponential gaps, the
# open-loop load of serving benchmarks), 8 seats. For this sweep we use the **tiny random model
# (tiny-llama)**, whose steps take a millisecond or two, so that 80 requests at each of four
# rates fit in seconds; its numbers show the shape, not SmolLM2's speed. Its step is mostly the
# engine's fixed cost, as SmolLM2's is mostly its weight read: iterations set the time in both.
#
# First each policy's **capacity**: requests per second with every request waiting at t = 0.
# Beyond it the queue can only grow. Then the rates: 40%, 70%, 100% and 130% of the continuous
# engine's capacity. Left, the time to the first token; right, the time per output token; p50
# solid, p99 dashed with its bootstrap interval over the requests (with 80 requests a p99 rests
# on the worst one or two, and the interval says so). Dotted lines: the measured capacities.

# %%
from llmlab.viz.serving import capacity, load_sweep, plot_load_sweep

LOAD_SEATS = 8
sweep_n = 40 if QUICK else len(trace)
sweep_prompts = [r.prompt_token_ids for r in trace[:sweep_n]]
sweep_outs = outs[:sweep_n]
llms = {p: LLM(tiny, tok, scheduler=p, max_num_seqs=LOAD_SEATS, num_blocks=1024)
        for p in ("static", "continuous")}
for e in llms.values():                                   # warm-up
    capacity(e, sweep_prompts[:LOAD_SEATS], sweep_outs[:LOAD_SEATS])
caps, cap_steps, cap_ms = {}, {}, {}
for p, e in llms.items():
    caps[p] = capacity(e, sweep_prompts, sweep_outs)
    cap_steps[p] = len(e.stats.steps)
    cap_ms[p] = e.stats.wall_s / cap_steps[p] * 1e3
fractions = [0.4, 0.7, 1.0, 1.3]
rates = [f * caps["continuous"] for f in fractions]
load_rows = load_sweep(llms, sweep_prompts, sweep_outs, rates)
fig = plot_load_sweep(load_rows, capacities=caps,
                      title=f"tiny-llama, {sweep_n} requests, {LOAD_SEATS} seats, Poisson "
                            f"arrivals ({device_name()})")
print(f"capacity: static {caps['static']:.0f} req/s, continuous {caps['continuous']:.0f} req/s "
      f"({caps['continuous'] / caps['static']:.2f}×); with all waiting, static ran "
      f"{cap_steps['static']} iterations of {cap_ms['static']:.2f} ms, continuous "
      f"{cap_steps['continuous']} of {cap_ms['continuous']:.2f} ms")
for r in load_rows:
    print(f"{r['policy']:10s} {r['rate']:5.1f} req/s: TTFT p50 {r['ttft_p50_s'] * 1e3:6.0f} ms, "
          f"p99 {r['ttft_p99_s'] * 1e3:6.0f} ms | TPOT p50 {r['tpot_p50_s'] * 1e3:4.1f} ms, "
          f"p99 {r['tpot_p99_s'] * 1e3:4.1f} ms | {r['tokens_per_s']:5.0f} tok/s")

# %%
by = {(r["policy"], r["rate"]): r for r in load_rows}
over = sum(rate > caps["static"] for rate in rates)
ttft_ratio = [by["static", rate]["ttft_p99_s"] / by["continuous", rate]["ttft_p99_s"]
              for rate in rates]
tpot = [compare(by["static", rate]["tpots"], by["continuous", rate]["tpots"], "static",
                "continuous", quantity="TPOT", unit="requests") for rate in rates]
iter_ratio = cap_steps["static"] / cap_steps["continuous"]
step_ratio = cap_ms["continuous"] / cap_ms["static"]
display(Markdown(
    f"Continuous batching serves {caps['continuous'] / caps['static']:.2f}× the requests per "
    f"second of static batching before its queue grows. The count explains it: with every "
    f"request waiting, static ran {iter_ratio:.2f}× the iterations, and each continuous "
    f"iteration took {step_ratio:.2f}× as long as a static one (its steps are fuller), so "
    f"{iter_ratio:.2f} / {step_ratio:.2f} = {iter_ratio / step_ratio:.2f}×. "
    f"Static's p99 TTFT is {', '.join(f'{x:.1f}×' for x in ttft_ratio)} continuous's at the "
    f"four rates ({over} of them above static's capacity, where its queue only grows): a "
    "newcomer waits for a whole batch to end. TPOT is the other side of the trade, per "
    "request at each rate: continuous's is "
    + ", ".join(f"{1 / c.ratio:.2f}× static's" + ("" if c.resolved else " (a tie)")
                for c in tpot)
    + f". With every request waiting, a continuous step took {step_ratio:.2f}× a static one; "
    f"under these loads the TPOTs differ by at most "
    f"{max(abs(1 / c.ratio - 1) for c in tpot):.0%}: the capacity is bought cheaply."))
expect(all(x > 1 for x in ttft_ratio[-2:]),
       "static's p99 TTFT above continuous's at the two highest rates")

# %% [markdown]
# ### Chunked prefill: no step is long
#
# A step that prefills a newcomer's whole prompt is long, and every sequence that is decoding
# waits for it: for their readers the text stops for that step, an **inter-token stall**. With
# `enable_chunked_prefill=True` the token budget `max_num_batched_tokens` becomes a hard cap per
# step: decodes go first, and a prompt is fed in chunks of whatever budget is left, over several
# steps (Agrawal et al.: Sarathi, 2023, and Sarathi-Serve, OSDI 2024). It matters when long prompts arrive while others decode, so here the requests are
# the trace's first with prompts of at least 100 tokens, 2 seats, a budget of 64 tokens per step,
# three rounds on SmolLM2-135M. What it is judged on is the **worst stall**: the longest gap
# between two consecutive tokens of any request.
#
# ### Exercise 4 (predict, then measure): the worst stall
#
# Use the step cost fitted above (fixed part and cost per prompt token) and the prompt lengths
# printed below. Without chunks the worst stall is about one step that feeds a whole prompt;
# with chunks a step feeds at most 64 tokens. How many times shorter does chunking make the worst
# stall? Commit a number; within 30% of the measurement counts.

# %%
my_stall_prediction = ...  # YOUR ANSWER: a ratio, e.g. 1.5

# %%
from llmlab.viz.serving import plot_step_times

BUDGET = 64
long_part = [r for r in load_trace(TRACE, tokenizer=tok, output_scale=0.25)
             if len(r.prompt_token_ids) >= 100][:3 if QUICK else 4]
chunk_args = dict(max_num_seqs=2, num_blocks=128, enable_prefix_caching=False)
chunkers = {"continuous": LLM(model, tok, **chunk_args),
            f"chunked prefill, {BUDGET} tokens/step":
                LLM(model, tok, enable_chunked_prefill=True, max_num_batched_tokens=BUDGET,
                    **chunk_args)}
for e in chunkers.values():          # warm-up
    run_llmlab(e, warm[:2])
chunk_rounds = {k: [] for k in chunkers}
for _ in range(ROUNDS):              # interleaved, like the rounds above
    for k, e in chunkers.items():
        chunk_rounds[k].append(run_llmlab(e, long_part))
WHOLE, CHUNKED = chunkers
print(f"{len(long_part)} requests: prompts {[len(r.prompt_token_ids) for r in long_part]} tokens, "
      f"outputs {[r.output_tokens for r in long_part]}")
per_token, stalls = {}, {}
for name, runs in chunk_rounds.items():
    sums = [summarize(r["metrics"], r["wall_s"]) for r in runs]
    pick = lambda key: sorted(s[key] for s in sums)[ROUNDS // 2]
    stalls[name] = [s["stall_max_s"] for s in sums]
    biggest = max(st.prefill_tokens + st.decode_tokens for st in runs[-1]["stats"].steps)
    per_token[name] = prompt_token_cost(r["stats"] for r in runs)
    print(f"{name:34s} worst stall {pick('stall_max_s') * 1e3:4.0f} ms   largest step {biggest:3d} "
          f"tokens   {pick('tokens_per_s'):5.1f} tok/s   TPOT p90 {pick('tpot_p90_s') * 1e3:4.0f} ms"
          f"   TTFT mean {pick('ttft_mean_s'):5.2f} s   (medians of {ROUNDS} rounds)")
print("same tokens as without chunks:", chunk_rounds[CHUNKED][-1]["tokens"] == chunk_rounds[WHOLE][-1]["tokens"])
fig = plot_step_times({"continuous": chunk_rounds[WHOLE][-1]["stats"],
                       f"chunked, {BUDGET} tokens/step": chunk_rounds[CHUNKED][-1]["stats"]},
                      title=f"SmolLM2-135M, {len(long_part)} long prompts, 2 seats, last round "
                            f"({device_name()})")
stall = compare(stalls[WHOLE], stalls[CHUNKED], "whole prompts", "chunked prefill",
               quantity="worst stall")
tput = compare([r["wall_s"] for r in chunk_rounds[WHOLE]], [r["wall_s"] for r in chunk_rounds[CHUNKED]],
               "whole prompts", "chunked prefill")
print("stall:", stall.sentence())
print("run:  ", tput.sentence())
print(exercises.check("nb05.predict_stall", my_stall_prediction, measured=stall.ratio))

# %%
display(Markdown(
    f"What chunking is for: {stall.sentence()}. "
    f"The whole run: {tput.sentence()}. A prompt token adds {per_token[CHUNKED]:.2f} ms to a "
    f"chunk step and {per_token[WHOLE]:.2f} ms to a whole-prompt step (each step's time less "
    "that of a pure decode step of as many rows, median over the steps that fed prompt "
    "tokens): chunking moves prompt tokens into more steps, it does not make them "
    f"{'cheaper' if per_token[CHUNKED] >= 0.8 * per_token[WHOLE] else 'dearer'} on this CPU."))
expect(stall.verdict == "faster", "a shorter worst stall with chunked prefill")

# %% [markdown]
# Chunked prefill was made for a GPU. There a decode step of a few dozen rows is far below the ridge
# point (hundreds of FLOPs per byte, notebook 02): its time is the weight read, and a few hundred
# prompt tokens added to it ride along almost for free (Agrawal et al. measure this as the
# "piggybacking" of decodes on prefill chunks), so the stall shrinks and the throughput stays.
# On a CPU whose ridge point is a dozen FLOPs per byte, every prompt token costs its full compute
# in whichever step it lands: chunking still bounds the stall, but it buys nothing else.
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
# ### Exercise 5 (compute): static iterations
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
# * A decode step costs mostly its fixed part (the weight read, or here the engine's own cost), so
#   the gain is counted in iterations, and under load it shows as capacity: past static's, its
#   queue and its p99 TTFT grow while continuous still keeps up; the price is fuller steps.
# * Chunked prefill bounds the worst stall between two tokens; on a CPU it buys nothing else.
#   With a paged cache, running out of blocks is not an error: preempt, free, recompute later.
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
