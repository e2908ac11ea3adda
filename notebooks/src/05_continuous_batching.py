# %% [markdown]
# # 05 · Continuous batching
#
# **Why.** The seed article on inference frameworks (seed 002) explains continuous batching with a
# restaurant: a new guest is seated the moment *a* seat frees up, instead of waiting until the whole
# table has finished eating. vLLM schedules at the level of iterations — the batch can change at
# every forward pass — and the same article credits TurboTransformers with "smart batching": packing
# sequences of different lengths so that no compute is spent on zero padding. The serving metrics are
# those of seed 001: **throughput** (tokens/s, what decides how many servers you pay for) against
# **TTFT** and **TPOT** (what each user feels). Seed 000 reports that vLLM, built on PagedAttention
# and this scheduler, serves LLaMA 7B/13B with more than 10× the throughput of HF transformers.
#
# Where does a *static* batch lose? Take the request trace in `data/traces/cpu.jsonl` (80 requests,
# prompts 16–256 tokens, outputs 8–128 tokens) in batches of 8:

# %%
import inspect
import os
import matplotlib.pyplot as plt
import torch
import llmlab
from llmlab.device import device_name
from llmlab.bench.serve import load_trace
from llmlab.models.registry import model_dir, repo_root
from llmlab.exercises.nb05 import static_decode_steps

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
if os.environ.get("LLMLAB_THREADS"):      # e.g. 1 on a machine whose cores are busy
    torch.set_num_threads(int(os.environ["LLMLAB_THREADS"]))
torch.manual_seed(0)
tok = llmlab.load_tokenizer("smollm2-135m")
trace = load_trace(repo_root() / "data" / "traces" / "cpu.jsonl",
                   tokenizer=tok)
outs = [r["output_tokens"] for r in trace]
prompts_len = [len(r["prompt_token_ids"]) for r in trace]
B = 8
static_steps = static_decode_steps(outs, B)
print(device_name())

# %%
# NBVAL_CHECK_OUTPUT
pads = sum(len(prompts_len[i:i + B]) * max(prompts_len[i:i + B]) - sum(prompts_len[i:i + B])
           for i in range(0, len(trace), B))
print(f"{len(trace)} requests, {sum(outs)} output tokens, {sum(prompts_len)} prompt tokens")
print(f"static batches of {B}: {static_steps} decode iterations; "
      f"with every seat always busy: {-(-sum(outs) // B)}")
print(f"left-padding the prompts of each batch adds {pads} pad tokens "
      f"({pads / sum(prompts_len):.0%} of the real prompt tokens)")

# %% [markdown]
# A static batch decodes until its *longest* member is done, so seats that finished early sit idle:
# about twice the iterations that a scheduler keeping every seat busy needs. And left-padding the
# prompts into a rectangle computes pad tokens that no one reads.
#
# ## How: the engine
#
# `llmlab.engine` has the parts of a vLLM-shaped server:
#
# * `Sequence` / `Request` (`engine/sequence.py`): tokens, how many already have K/V in the cache,
#   a seat, a random generator, token times;
# * `Scheduler` (`engine/scheduler.py`): policy `"static"` (the baseline) or `"continuous"`;
# * `ModelRunner` (`engine/runner.py`): one forward over the paged KV cache of notebook 04;
# * `LLM` / `SamplingParams` (`engine/llm.py`): the offline API.
#
# The whole continuous policy fits on a screen. Every step, each running sequence gets one decode
# token (preempting the newest running sequence if the block pool is empty), then waiting requests
# join while there are seats, token budget and blocks:

# %%
from llmlab.engine.scheduler import Scheduler

print(inspect.getsource(Scheduler._schedule_continuous))
print(inspect.getsource(Scheduler._schedule_decodes))

# %% [markdown]
# Prompts that join are **packed**: the runner concatenates every sequence's new tokens into one row
# and marks where each starts with `cu_seqlens`, FlashAttention's varlen convention. Here are two
# steps of the engine on the tiny random model: three prompts arrive, then everyone decodes.

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
    b = eng.runner.packed.batch
    print("cu_seqlens", b.cu_seqlens.tolist(), "| new tokens", b.num_new,
          "| fresh prompts", b.fresh, "| decodes", b.decode)

# %% [markdown]
# Fourteen prompt tokens cost fourteen token positions, not 3 × 7 = 21; the next step is three
# single-token decodes in one row. Attention inside each layer keeps the sequences apart: fresh
# prompts attend causally among their own tokens (one SDPA call with a block-diagonal mask built from
# `cu_seqlens`), decodes read their K/V from the paged pool through their block tables.
#
# ## Check: batching changes no token
#
# Three prompts on SmolLM2-135M, greedy, through both schedulers with 2 seats, against generating each
# prompt alone.

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
# The same slice of the trace on SmolLM2-135M, three ways, all requests arriving at t = 0, greedy,
# each request generating exactly its `output_tokens` (EOS ignored, as serving benchmarks do):
#
# 1. HF transformers `generate` in padded static batches (left padding, `max_new_tokens` = the
#    batch's longest request — that is what a padded static batch costs);
# 2. llmlab `scheduler="static"` — the same batches over the paged cache;
# 3. llmlab `scheduler="continuous"`.
#
# A small slice so the notebook runs quickly: the first 8 requests, 4 seats, every output length
# scaled by 1/4 (their spread, which is what static batching pays for, is kept).
# `python -m llmlab.bench serve` runs all 80 requests at full length with 64 seats and checks a
# sample of outputs against generating alone.

# %%
from transformers import AutoModelForCausalLM
from llmlab.bench.serve import run_hf, run_llmlab
from llmlab.profiling.metrics import summarize

N, SEATS = (6, 3) if QUICK else (8, 4)
part = load_trace(repo_root() / "data" / "traces" / "cpu.jsonl", N, tokenizer=tok, output_scale=0.25)
hf = AutoModelForCausalLM.from_pretrained(str(model_dir("smollm2-135m")),
                                          dtype=torch.float32).eval()
res = {"HF transformers (padded static)": run_hf(hf, tok, part, SEATS)}
engines = {}
for policy in ("static", "continuous"):
    engines[policy] = LLM(model, tok, scheduler=policy, max_num_seqs=SEATS, num_blocks=128)
    res[f"llmlab {policy}"] = run_llmlab(engines[policy], part)
summary = {k: summarize(v["metrics"], v["wall_s"]) for k, v in res.items()}
for k, s in summary.items():
    print(f"{k:32s} {s['tokens_per_s']:6.1f} tok/s   TTFT mean {s['ttft_mean_s']:5.2f} s   "
          f"TPOT mean {s['tpot_mean_s'] * 1e3:5.0f} ms")
hf_tps = summary["HF transformers (padded static)"]["tokens_per_s"]
print(f"continuous / HF: {summary['llmlab continuous']['tokens_per_s'] / hf_tps:.2f}×   "
      f"static / HF: {summary['llmlab static']['tokens_per_s'] / hf_tps:.2f}×   ({device_name()})")

# %% [markdown]
# ### Who sits where
#
# Each column is one forward pass; each row a seat; each colour a request. In the static run a seat
# whose request is done turns grey and stays empty until the whole batch finishes; in the continuous
# run the next request takes it at the very next iteration.

# %%
from llmlab.viz.serving import plot_occupancy

fig = plot_occupancy({k: e.stats for k, e in engines.items()}, SEATS,
                     title=f"SmolLM2-135M, {N} requests, {SEATS} seats")
fig.savefig("/tmp/nb05_occupancy.png")

# %% [markdown]
# ### The padding that packing saves, counted in tokens

# %%
# NBVAL_CHECK_OUTPUT
for policy, e in engines.items():
    st = e.stats
    print(f"{policy:10s}: {st.computed_tokens} token positions computed for {st.real_tokens} real "
          f"tokens -> {st.padding_tokens} pads, {len(st.steps)} iterations")
hf_pads = sum(len(b) * max(b) - sum(b) for b in
              ([len(r["prompt_token_ids"]) for r in part[i:i + SEATS]] for i in range(0, N, SEATS)))
hf_idle = sum(len(part[i:i + SEATS]) * max(r["output_tokens"] for r in part[i:i + SEATS])
              - sum(r["output_tokens"] for r in part[i:i + SEATS]) for i in range(0, N, SEATS))
print(f"HF padded static: {hf_pads} prompt pads + {hf_idle} decode positions for rows already done")

# %% [markdown]
# ### Where the speedup comes from: work saved × time per position
#
# A speedup has two factors: how many token positions each system computes (a pad, or a row whose
# request is already done, costs a forward row like a real token), and how long one position takes.
# Divide the measured speedup by the work ratio and what is left is the second factor.

# %%
CONT_NAME = "llmlab continuous"
for name, r in res.items():
    if name != CONT_NAME:
        work = r["positions"] / res[CONT_NAME]["positions"]
        speed = summary[CONT_NAME]["tokens_per_s"] / summary[name]["tokens_per_s"]
        print(f"{name:32s} {r['positions']:5d} positions = {work:.2f}× continuous's "
              f"{res[CONT_NAME]['positions']}; measured {speed:.2f}× faster -> continuous spends "
              f"{work / speed:.2f}× the time per position")

# %% [markdown]
# On a CPU the speedup follows the work ratio closely, because the matrix multiplies are most of
# the cost and they charge a pad as much as a real token. Continuous batching's positions are not
# cheaper by nature, and can be dearer. Near the end of a trace only a few requests are left, so a
# step has few rows. A step with few rows still reads every weight once, which is notebook 02's
# memory-bound corner of the roofline, so each of its rows costs more than a row of a full padded
# batch.
#
# So the work ratio is roughly the speedup to expect, and the seat count sets it.
# `python -m llmlab.bench serve` measured this on the whole 80-request trace, on this CPU:
#
# * **32 seats:** HF's padded batches compute 23,584 positions, 2.83× continuous's 8,346.
#   Continuous was measured 2.5–2.7× faster in the rounds after the first, so each of its
#   positions costs 5–10% more than one of HF's.
# * **64 seats:** a padded batch now waits for the longest of 64 requests, and HF computes
#   25,984 positions, 3.11×. Continuous was measured 2.8–3.5× faster over ten rounds in four
#   runs, median 3.2×: about the same time per position as HF.
#
# Past the work ratio, the speedup has to come from a cheaper position. That is the subject of the
# kernel notebooks (03 and 04).

# %% [markdown]
# ### Chunked prefill: no step is long
#
# Look at TPOT above: continuous batching produces tokens faster overall, yet each decoding request
# can wait *longer* between its tokens than in a static batch. The reason is the steps in which a
# newcomer's prompt is prefilled: every sequence that is decoding waits for that whole step. With
# `enable_chunked_prefill=True` the token budget `max_num_batched_tokens` becomes a hard cap per
# step: decodes go first, and a prompt is fed in chunks of whatever budget is left, over several
# steps (Sarathi-Serve's idea; vLLM V1 turns it on by default). The same requests, the same tokens,
# with a budget of 64 tokens per step:

# %%
chunked_llm = LLM(model, tok, max_num_seqs=SEATS, num_blocks=128, enable_chunked_prefill=True,
                  max_num_batched_tokens=64)
res["llmlab continuous, chunked prefill"] = run_llmlab(chunked_llm, part)
for k, e in (("llmlab continuous", engines["continuous"]),
             ("llmlab continuous, chunked prefill", chunked_llm)):
    s = summarize(res[k]["metrics"], res[k]["wall_s"])
    longest = max(r.end_s - r.start_s for r in e.stats.steps)
    print(f"{k:36s} {s['tokens_per_s']:6.1f} tok/s   longest step {longest * 1e3:5.0f} ms   "
          f"TPOT p90 {s['tpot_p90_s'] * 1e3:4.0f} ms   TTFT mean {s['ttft_mean_s']:5.2f} s")
print("same tokens as without chunks:",
      res["llmlab continuous, chunked prefill"]["tokens"] == res["llmlab continuous"]["tokens"])

# %%
from llmlab.viz.serving import plot_step_times

fig = plot_step_times({"continuous": engines["continuous"].stats,
                       "chunked prefill, 64 tokens/step": chunked_llm.stats},
                      title=f"SmolLM2-135M, {N} requests, {SEATS} seats ({device_name()})")
fig.savefig("/tmp/nb05_steps.png")

# %% [markdown]
# The long steps become more, shorter ones: no decoding request ever waits for a whole 200-token
# prompt again. But read the other numbers: on this CPU, chunking makes throughput *worse* and does
# not help TPOT. Notebook 02's roofline says why. A decode step is memory-bound only while the batch
# is a handful of rows: reading the weights costs the same for 1 row or 4. Sixty prompt tokens added
# to that step are not free here; they cost their full compute, so every chunk step is slower than
# a pure decode step, and the prompt's cost is spread over more of everyone's tokens instead of
# being paid once. On a GPU the ridge point is hundreds of FLOPs per byte: a decode step of 32 rows
# is far below it, and a few hundred prompt tokens ride along almost for free. That is the regime
# chunked prefill was made for (vLLM turns it on by default on GPUs), and why a CPU engine may
# leave it off. `python -m llmlab.bench serve` runs it at 128 tokens/step on the full trace.

# %% [markdown]
# ### Throughput against latency as the load grows
#
# Now requests arrive over time: the trace's arrival times, rescaled to an average rate. For this
# sweep we use the **tiny random model (tiny-llama)** so that a dozen runs fit in seconds; its
# numbers show the shape, not SmolLM2's speed. At a low rate both schedulers keep up; as the rate
# grows the static scheduler's latency climbs first, because a request that arrives during a batch
# waits for the whole batch.

# %%
from llmlab.viz.serving import arrival_sweep, plot_throughput_latency

sweep_n = 16 if QUICK else 32
sweep = trace[:sweep_n]
rates = [20, 160, 640] if QUICK else [10, 40, 160, 640]
llms = {p: LLM(tiny, tok, scheduler=p, max_num_seqs=4, num_blocks=256) for p in ("static", "continuous")}
rows = arrival_sweep(llms, [r["prompt_token_ids"] for r in sweep],
                     [min(r["output_tokens"], 48) for r in sweep],
                     [r["arrival_s"] for r in sweep], rates)
fig = plot_throughput_latency(rows, title=f"tiny-llama, {sweep_n} requests, 4 seats ({device_name()})")
fig.savefig("/tmp/nb05_sweep.png")
for r in rows:
    print(f"{r['policy']:10s} {r['rate']:4g} req/s: {r['tokens_per_s']:7.0f} tok/s, "
          f"mean e2e {r['e2e_mean_s']:.2f} s")

# %% [markdown]
# ## Play: seats and the block budget
#
# 24 requests on tiny-llama with `block_size=4`. Fewer KV blocks than the running sequences need
# forces **preemption by recompute**: the newest running sequence gives its blocks back and returns
# to the front of the queue, to be prefilled again (prompt + what it had generated) when blocks free
# up. Every request still finishes — watch the red markers and the iteration count.

# %%
import ipywidgets as widgets
from llmlab.viz.serving import explore_batching

widgets.interactive(explore_batching, max_num_seqs=widgets.IntSlider(8, 1, 16),
                    num_blocks=widgets.IntSlider(40, 20, 160, 4), block_size=widgets.fixed(4),
                    scheduler=["continuous", "static"])

# %%
fig = explore_batching(max_num_seqs=8, num_blocks=24)
fig.savefig("/tmp/nb05_widget.png")

# %% [markdown]
# ## Exercises
#
# **1. Padding.** Five prompts of lengths `[12, 40, 7, 33, 25]` are left-padded into one rectangle.
# How many pad tokens does the rectangle hold? (Hint: `llmlab.engine.runner.padding_tokens` does it,
# but count it yourself.)

# %%
from llmlab.exercises.nb05 import check_cu_seqlens, check_padding, check_static_steps

lengths = [12, 40, 7, 33, 25]
# YOUR CODE HERE
answer = ...
# END
check_padding(answer, lengths)

# %% [markdown]
# **2. cu_seqlens.** Write `cu_seqlens(lengths)` returning the offsets of packed sequences: `[0, l0,
# l0 + l1, ...]`, as `PackedPagedAttention.prepare` builds them. (Hint: `torch.cumsum` or
# `itertools.accumulate`.)

# %%
def cu_seqlens(lengths):
    # YOUR CODE HERE
    return None
    # END


check_cu_seqlens(cu_seqlens)

# %% [markdown]
# **3. Static iterations.** Output lengths `[5, 60, 8, 12, 90, 7, 3, 40]` arrive in this order and a
# static scheduler takes them 4 at a time. How many decode iterations does it run? (Hint: a batch
# lasts as long as its longest request.)

# %%
out_lengths = [5, 60, 8, 12, 90, 7, 3, 40]
# YOUR CODE HERE
answer = ...
# END
check_static_steps(answer, out_lengths, 4)

# %% [markdown]
# ## Takeaways
#
# * A static batch runs as long as its longest request; iteration-level scheduling gives a finished
#   seat to the next request at the very next forward pass.
# * Packing prompts by `cu_seqlens` spends compute only on real tokens; padding is pure waste.
# * With a paged cache, running out of blocks is not an error: preempt, free, recompute later.
