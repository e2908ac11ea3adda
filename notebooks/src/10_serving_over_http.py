# %% [markdown]
# # 10 · Serving over HTTP: an OpenAI-compatible server, judged by its latency percentiles
#
# **Why.** Notebooks 04 and 05 built the heart of a serving engine, paged KV blocks and
# continuous batching, inside one Python process. What runs in production is a **server**:
# many clients send requests over HTTP whenever they like, and the operator judges it by
# latency percentiles under load, not by one batch's tokens per second.
#
# - **One API for every engine.** OpenAI's HTTP API (`/v1/completions`,
#   `/v1/chat/completions`) has become the common interface. vLLM ships an
#   OpenAI-compatible server, so an application written for OpenAI's client changes only its
#   base URL; Hugging Face's Text Generation Inference (TGI) has an OpenAI-compatible Messages
#   API beside its own, and llama.cpp's `llama-server` offers the same routes.
# - **Streaming.** A chat client shows tokens as they come. The API streams them as
#   *server-sent events* (SSE): one `data: {json}` event per chunk on a long-lived HTTP
#   response, ending with `data: [DONE]`. So the first token's latency (**TTFT**) and the gap
#   between tokens (**TPOT**, time per output token) are what a user feels; the end-to-end
#   latency is what a batch job feels.
# - **Under load, the scheduler decides.** Orca (Yu et al., OSDI 2022) showed that scheduling
#   per iteration instead of per request raises the load a server sustains at the same latency
#   many times; vLLM (Kwon et al., SOSP 2023) added paged KV memory and reported 2–4× the
#   throughput of the systems of its day at the same latency. Serving benchmarks send
#   requests at random (Poisson) arrival times at a sweep of rates and report, per rate,
#   p50/p90/p99 of TTFT, TPOT and end-to-end latency, plus *goodput*: DistServe (Zhong et
#   al., OSDI 2024) defines it as the requests per second that meet **both** a TTFT target
#   and a TPOT target, since a fast first token followed by a stuttering stream is no better.
#
# In this notebook you start llmlab's own OpenAI-compatible server, `python -m llmlab.serve`,
# talk to it with the official `openai` client and with curl, and watch its Prometheus
# metrics move. You write the client's SSE parser as a warm-up, then **build the heart of the
# server**: the engine loop that lets requests from many HTTP clients join one running batch
# and drops a request whose client went away. Last, a rate sweep of the static scheduler
# against the continuous one, with an interval on each p90 and p99 and the goodput computed.

# %%
import asyncio
import json
import math
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import matplotlib.pyplot as plt
import openai
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.bench.serve_http import rate_sweep, request_bodies, run_load
from llmlab.device import describe
from llmlab.profiling import compare, expect
from llmlab.serve.client import (percentile_interval, scrape_metrics, summarize,
                                 watch_metrics)
from llmlab.serve.process import ServerProcess
from llmlab.traces import TRACES_DIR, load_trace
from llmlab.viz.http import explore_rate, plot_gauges, plot_sweep, read_gauges

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
for key, value in describe().items():
    print(f"{key:12s} {value}")
MODEL = "smollm2-135m"
SEATS = 8
server = ServerProcess(MODEL, scheduler="continuous", extra=["--max-num-seqs", str(SEATS)])
print(server)

# %% [markdown]
# `ServerProcess` ran `python -m llmlab.serve --model smollm2-135m --scheduler continuous
# --port …` as a child process and waited until `/health` answered. (From a terminal you
# would run `llmlab-serve --model smollm2-135m --port 8000`.) How that process turns many
# HTTP clients into one batch is the build of this notebook; first, the server from outside.
#
# ## How (1): the API, with the official client

# %%
client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="not-needed")
print("models:", [m.id for m in client.models.list().data])
question = [{"role": "user", "content": "What is the capital of France?"}]
reply = client.chat.completions.create(model=MODEL, messages=question, max_tokens=24,
                                       temperature=0)
print("answer:", repr(reply.choices[0].message.content))
print("finish:", reply.choices[0].finish_reason, "| usage:", reply.usage.model_dump())

# %% [markdown]
# With `stream=True` the same call returns chunks as they are made. Time them: the first
# chunk's delay is the TTFT, the gaps after it the TPOT.

# %%
t0 = time.perf_counter()
arrivals, pieces = [], []
for chunk in client.chat.completions.create(model=MODEL, messages=question, max_tokens=24,
                                            temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        arrivals.append(time.perf_counter() - t0)
        pieces.append(chunk.choices[0].delta.content)
gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
print("streamed:", repr("".join(pieces)))
print(f"TTFT {arrivals[0] * 1e3:.0f} ms; {len(pieces)} chunks; median gap (TPOT) "
      f"{sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms")

# %% [markdown]
# ## How (2): what is on the wire
#
# The client hides the protocol. Here are the raw bytes of a streamed completion, with curl
# (`-N`: print as it arrives). Each event is a `data:` line and a blank line.

# %%
body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 4,
        "temperature": 0, "stream": True}
if shutil.which("curl"):
    raw = subprocess.run(["curl", "-sN", server.base_url + "/v1/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=120).stdout
else:  # the same request without curl
    raw = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).text
print(raw)

# %% [markdown]
# ## Check: the server says what the engine says
#
# Behind HTTP is the same engine as `llmlab.LLM`. Greedy decoding of the same chat must give
# the same text offline and over the wire, streamed or not.

# %%
# NBVAL_CHECK_OUTPUT
llm = llmlab.LLM(MODEL)
offline = llm.chat(question, llmlab.SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0]
offline_text = offline.outputs[0].text
print("offline == server:", offline_text == reply.choices[0].message.content)
print("offline == streamed:", offline_text == "".join(pieces))
del llm

# %% [markdown]
# ## How (3): watching the server work
#
# The server exports Prometheus metrics at `/metrics` (the text format every monitoring
# stack scrapes). Below, prompts of the trace `data/traces/cpu.jsonl`, each with up to 16
# greedy tokens. Send 16 of them at once to a server with 8 seats and scrape the gauges every
# 0.1 s while they run:

# %%
trace = load_trace(TRACES_DIR / "cpu.jsonl", 24, max_output=16)
bodies = request_bodies(trace, max_tokens=16)


def burst(bodies: list[dict]) -> list[str]:
    def one(body):
        stream = client.completions.create(model=MODEL, stream=True, **{
            k: body[k] for k in ("prompt", "max_tokens", "temperature")},
            extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream if c.choices)
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


BURST = 16 if not QUICK else 12
print(f"prompts of {min(r.prompt_tokens for r in trace[:BURST])} to "
      f"{max(r.prompt_tokens for r in trace[:BURST])} tokens")
names = ["llmlab_requests_running", "llmlab_requests_waiting", "llmlab_kv_blocks_used"]
before = scrape_metrics(server.base_url)
done = threading.Event()
watcher = ThreadPoolExecutor(1).submit(watch_metrics, server.base_url, names, done.is_set, 0.1)
t0 = time.perf_counter()
texts = burst(bodies[:BURST])
burst_s = time.perf_counter() - t0
time.sleep(0.3)
done.set()
samples = watcher.result()
after = scrape_metrics(server.base_url)
generated = after["llmlab_generation_tokens_total"] - before["llmlab_generation_tokens_total"]
capacity = BURST / burst_s         # requests per second with the batch kept full
print(f"{BURST} requests, {generated:.0f} tokens in {burst_s:.1f} s: {generated / burst_s:.0f} "
      f"generated tokens/s, {capacity:.2f} requests/s, with up to {SEATS} in the batch")
story = read_gauges(samples, SEATS)
print(f"peak running {story.peak_running} | peak waiting {story.peak_waiting} | KV blocks: "
      f"peak {story.peak_blocks}, at the end {story.end_blocks}")
expect(story.peak_running == SEATS and story.peak_waiting > 0 and story.end_blocks == 0,
       f"all {SEATS} seats taken, a queue, and every KV block freed at the end")
plot_gauges(samples, f"{MODEL}, {BURST} concurrent streams, {SEATS} seats")
plt.show()


def requests_(k):
    return f"{k} request" + ("" if k == 1 else "s")


if story.full_s is None:
    text = (f"The batch never held all {SEATS} seats at once in these samples (at most "
            f"{story.peak_running} running).")
else:
    text = (f"The gauges first counted the burst's requests at {story.first_s:.1f} s; the "
            f"batch first held all {SEATS} seats at {story.full_s:.1f} s, "
            f"{story.time_to_full_s:.1f} s later.")
if story.stretches:
    text += (" The gauges stood still with seats free and requests waiting " + "; ".join(
        f"for {x.duration_s:.1f} s from {x.start_s:.1f} s ({x.running} running, "
        f"{requests_(x.waiting)} waiting)" for x in story.stretches) + ". They change only "
        "between two steps, and the step that seats waiting requests prefills all their "
        "prompts together, a long step: through it the gauges show the state from before it.")
if story.queue_empty_s is not None:
    text += f" Nobody was waiting from {story.queue_empty_s:.1f} s on"
    text += (f", and the last request ended by {story.last_s:.1f} s." if story.last_s is not None
             else ".")
text += (f" The KV blocks rose to {story.peak_blocks} as the sequences grew and were "
         f"{story.end_blocks} at the end: the server frees a request's blocks when it "
         "finishes, and also when its client disconnects mid-stream.")
display(Markdown(text))

# %% [markdown]
# ## Warm-up (build): the client's SSE parser
#
# Write `parse_sse(lines)`: it gets the response's text lines one by one (with or without
# their line ending) and yields each event's JSON payload as a dict, in order, stopping at
# `data: [DONE]`. The rules, from the HTML standard's server-sent events section:
#
# - an event is made of lines and ends at a **blank line**;
# - its payload is the values of its `data:` lines, **joined with a newline**; one space after
#   the colon is optional, and is not part of the value;
# - a line starting with `:` is a comment (servers send them to keep a connection alive);
#   other fields such as `event:` and `id:` do not carry the payload.
#
# The check runs your parser on hand-made streams, one per rule, then on the raw lines of a
# real stream from this server: your chunks must add up to the non-streamed answer.

# %%
def parse_sse(lines):
    # YOUR CODE HERE: collect the data: values of an event; at a blank line, join them,
    # stop at [DONE], else yield json.loads(...) of the joined payload
    raise NotImplementedError


exercises.check("nb10.parse_sse", parse_sse, base_url=server.base_url, model=MODEL)

# %% [markdown]
# ## How (4): inside the server, one event loop and one engine loop
#
# The server runs on one **asyncio event loop** (uvicorn's). Every HTTP request is handled by
# a coroutine on it, and the loop switches between them each time one `await`s. A handler
# does little: it checks and tokenizes the request, puts it in an **inbox**, then awaits the
# request's **stream** and writes each piece of text to its socket as an SSE event. One more
# coroutine owns the engine, the **engine loop**, and it is where serving happens:
#
# - **Between two steps** it takes every request that has come in and adds it to the engine.
#   A request that arrives while others decode joins the batch at the next step, not when the
#   batch is over: Orca's iteration-level scheduling (notebook 05), now across clients. When
#   nothing runs it waits on the inbox.
# - After each step it hands each new token to its request's stream, and ends the stream of a
#   request that finished.
# - A client that goes away mid-stream leaves an `("abort", stream)` in the inbox. Aborting
#   the request frees its seat and KV blocks at once (notebook 04) instead of generating the
#   rest of its answer for nobody.
# - `engine.step()` is milliseconds to tens of milliseconds of work that never awaits. Called in a
#   coroutine, it holds the event loop for all that time: no handler can read a request, send
#   a token or notice a disconnect. `await asyncio.to_thread(f)` runs a blocking function in
#   a worker thread while the event loop goes on; PyTorch releases Python's GIL inside its
#   operators, so both make progress.
#
# vLLM's `AsyncLLMEngine` (its `vllm/engine/async_llm_engine.py` in the v0 releases) has this
# shape: a background task that, between two steps, adds the new requests and aborts the
# cancelled ones, steps, and routes each output to its request's stream.
#
# ## Build: the engine loop
#
# Write `engine_loop(engine, inbox)`. The check starts a real server (uvicorn, in a thread of
# this kernel) whose engine loop is yours, on SmolLM2 with 4 seats, and sends it requests with
# the official `openai` client from several threads: a long stream A, then B, C (chat,
# streamed) and D (not streamed) while A is generating. Every text must equal llmlab's greedy
# answer, B, C and D must share steps with A, no step may run on the event loop's thread, and
# a client E that reads two tokens and hangs up must have its request aborted and its KV blocks
# freed within a few steps.

# %%
async def engine_loop(engine, inbox):
    """The server's engine loop: one asyncio task on the server's event loop, beside every
    HTTP handler, for as long as the server runs (it never returns).

    engine  the served LLMEngine (notebook 05):
              add_request(prompt_token_ids, params, prompt) -> request
                  (request.request_id; request.finished once all its sequences are)
              step() -> [(seq, token_id), ...]: the tokens one step made; seq.request is
                  the request the sequence belongs to
              abort_request(request_id): the request ends; its seat and KV blocks are freed
              has_unfinished() -> bool;  output(request) -> its final RequestOutput
    inbox   asyncio.Queue of (kind, stream) pairs, put by the HTTP handlers:
              ("add", stream)    a client sent a request: stream.prompt_token_ids,
                                 stream.params, stream.prompt
              ("abort", stream)  that request's client went away before the end
    stream  one request's way back to its handler:
              stream.accept(request) -> bool  the engine has it (False: the engine refused it)
              stream.send(seq, token_id)      a new token of it
              stream.finish(output)           it is over; output = engine.output(request)
              stream.request                  its request, once accepted (else None)
    """
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb10.engine_loop", engine_loop)

# %% [markdown]
# llmlab's server runs the same loop in a thread of its own rather than as a task
# (`EngineLoop` in `llmlab/serve/loop.py`), with what a server needs beyond the idea: a
# bounded waiting queue, and a step that raises fails only the requests it blames.
#
# ## Predict, then measure: how much load does it take?
#
# Next you send requests at random times, as independent users would: a **Poisson
# process**, whose gaps between arrivals are exponential with mean 1/rate. A p90 needs
# enough requests not to rest on the slowest one or two: the sweep sends 100 to 200 per rate
# (as many as fit in about a minute of arrivals), so a p90 rests on the slowest 10 to 20 and
# a p99 on the slowest one or two (its interval says how little that is). At SmolLM2's pace
# on this machine that takes too long:

# %%
TINY = "tiny-llama"
FRACTIONS = (0.5, 0.75, 1.0, 1.5)      # loads, as multiples of the burst's rate
N_MAX = 200
minutes = 2 * N_MAX * sum(1 / (f * capacity) for f in FRACTIONS) / 60
print(f"{N_MAX} requests at each of {len(FRACTIONS)} rates, on 2 servers, at SmolLM2's "
      f"{capacity:.2f} requests/s: about {minutes:.0f} minutes of arrivals alone")
print(f"{MODEL} server stopped (exit status {server.stop()})")

# %% [markdown]
# So the sweep runs on two new servers of **tiny-llama**, the 2-layer random Llama of the
# tests, as notebook 05's load sweep did. Its tokens come milliseconds apart (the bursts'
# TPOT is printed below; compare the gaps of SmolLM2's stream above), so
# its numbers show the shape (queueing, the two schedulers, where a target breaks), not
# SmolLM2's speed. Its answers are random tokens, and every request gets its trace's output length (capped at 16, EOS ignored).
# Prompts come from the longer trace `alpaca_like`; neither server keeps a prefix cache, so
# a prompt sent again at the next rate is prefilled again.
#
# First the tiny server's **capacity**: 64 requests at once, three times, each burst's
# requests over its wall time, the median of the three. Then the **targets**: TTFT within 5
# times the median TTFT of 9 requests sent alone (room for a few steps of waiting), TPOT
# within twice the median TPOT of the bursts' requests (half the pace a full batch keeps).

# %%
sweep_trace = load_trace("alpaca_like", N_MAX, max_output=16)
sweep_bodies = request_bodies(sweep_trace, max_tokens=16)
tiny_args = ["--max-num-seqs", str(SEATS), "--prefix-cache", "none"]
servers = {s: ServerProcess(TINY, scheduler=s, extra=tiny_args) for s in ("continuous", "static")}


def load(srv, bodies, arrivals):
    """Send bodies at their arrival times (s) to srv; -> run_load's results and wall time."""
    with ThreadPoolExecutor(1) as pool:   # an event loop of its own, beside the kernel's
        return pool.submit(asyncio.run, run_load(srv.base_url, TINY, bodies, arrivals)).result()


for srv in servers.values():              # warm-up
    load(srv, sweep_bodies[:SEATS], [0.0] * SEATS)
bursts = [load(servers["continuous"], sweep_bodies[:64], [0.0] * 64) for _ in range(3)]
tiny_capacity = sorted(64 / b["wall_s"] for b in bursts)[1]
burst_tpot = sorted(r.tpot_s for b in bursts for r in b["results"] if r.ok)
burst_tok_s = sorted(sum(r.completion_tokens for r in b["results"] if r.ok) / b["wall_s"]
                     for b in bursts)[1]
lone_ttft = sorted(load(servers["continuous"], [b], [0.0])["results"][0].ttft_s
                   for b in sweep_bodies[:9])[4]
TTFT_TARGET_S = float(f"{5 * lone_ttft:.2g}")
TPOT_TARGET_S = float(f"{2 * burst_tpot[len(burst_tpot) // 2]:.2g}")
RATES = [float(f"{f * tiny_capacity:.2g}") for f in FRACTIONS]
# as many requests per rate as fit in about a minute of arrivals on both servers, 100 to 200
N_REQUESTS = 100 if QUICK else max(100, min(N_MAX, int(60 / (2 * sum(1 / r for r in RATES)))))
sweep_bodies = sweep_bodies[:N_REQUESTS]
print(f"prompts of {min(r.prompt_tokens for r in sweep_trace[:N_REQUESTS])} to "
      f"{max(r.prompt_tokens for r in sweep_trace[:N_REQUESTS])} tokens, outputs of "
      f"{min(b['max_tokens'] for b in sweep_bodies)} to "
      f"{max(b['max_tokens'] for b in sweep_bodies)}")
print("bursts of 64:", ", ".join(f"{64 / b['wall_s']:.0f}" for b in bursts),
      f"requests/s -> capacity {tiny_capacity:.0f} requests/s, {burst_tok_s:.0f} generated "
      f"tokens/s; their median TPOT "
      f"{burst_tpot[len(burst_tpot) // 2] * 1e3:.1f} ms")
print(f"lone requests: median TTFT {lone_ttft * 1e3:.1f} ms")
print(f"targets: TTFT {TTFT_TARGET_S * 1e3:.3g} ms, TPOT {TPOT_TARGET_S * 1e3:.3g} ms")
print(f"{N_REQUESTS} requests per rate at {RATES} requests/s "
      f"({', '.join(f'{f:g}' for f in FRACTIONS)} x the capacity)")

# %% [markdown]
# **Predict** the largest load, as a multiple of the burst's rate (0.5 is half of it), at
# which the continuous server still meets its targets: at least 90% of its requests with
# both TTFT and TPOT within target, DistServe's attainment goal. The sweep offers the loads
# printed above. A server saturates when requests arrive faster than it finishes them.

# %%
my_load = ...  # YOUR PREDICTION: a multiple of the burst's rate

# %% [markdown]
# At each rate both servers get the same requests at the same Poisson times, one right
# after the other, in alternating order, so that a slower minute of this machine does not
# fall on one of them only.

# %%
rows = []
for i, rate in enumerate(RATES):
    for label in (("continuous", "static") if i % 2 == 0 else ("static", "continuous")):
        for r in rate_sweep(servers[label].base_url, TINY, sweep_bodies, [rate], TTFT_TARGET_S,
                            seed=i, label=label, keep_results=True, warmup=False):
            r.update(summarize(r["results"], r["wall_s"], TTFT_TARGET_S,
                               tpot_target_s=TPOT_TARGET_S), load=FRACTIONS[i])
            rows.append(r)
for label, srv in servers.items():
    print(f"{label} server stopped (exit status {srv.stop()})")


def values(r, metric):
    """The finite per-request values of ttft or tpot of one row's completed requests."""
    return [v for x in r["results"] if x.ok and math.isfinite(v := getattr(x, f"{metric}_s"))]


for r in rows:                          # a 90% bootstrap interval for each p90 and p99
    for metric in ("ttft", "tpot"):
        for q in (90, 99):
            r[f"{metric}_p{q}_lo"], r[f"{metric}_p{q}_hi"] = percentile_interval(
                values(r, metric), q)
meets = {(r["scheduler"], r["load"]): not r["lost"] and r["slo_attainment"] >= 0.9
         for r in rows}
sustained = {}                          # the largest load up to which every load met them
for sched in ("continuous", "static"):
    sustained[sched] = 0.0
    for f in FRACTIONS:
        if not meets[sched, f]:
            break
        sustained[sched] = f
print("largest load up to which >= 90% of requests met both targets at every load:",
      sustained, "| lost requests:", sum(r["lost"] for r in rows))

# %%
exercises.check("nb10.predict_capacity", my_load, measured=sustained["continuous"],
                offered=FRACTIONS)

# %% [markdown]
# ## Measure: the rate sweep
#
# Top, the p90 TTFT and p90 TPOT at each rate with their 90% bootstrap intervals and the
# targets (dashed). Bottom left, latency against throughput. Bottom right, the **goodput**:
# the requests per second that met both targets (completed requests with TTFT and TPOT
# within them, over the run's wall time); the dotted diagonal is every request meeting them.

# %%
plot_sweep(rows, TTFT_TARGET_S, f"{TINY}, {SEATS} seats, {N_REQUESTS} requests per rate",
           tpot_target_s=TPOT_TARGET_S)
plt.show()
at = {(r["scheduler"], r["rate"]): r for r in rows}


def ms(r, metric, q):
    v, lo, hi = (r[f"{metric}_p{q}_{k}"] * 1e3 for k in ("s", "lo", "hi"))
    return f"{v:6.1f} [{lo:6.1f}, {hi:6.1f}]"


print(f"{'rate /s':>8} {'scheduler':>10} {'TTFT ms: p50':>12} {'p90 [90% interval]':>22} "
      f"{'p99 [90% interval]':>22}")
for rate in RATES:
    for sched in ("continuous", "static"):
        r = at[sched, rate]
        print(f"{rate:8g} {sched:>10} {r['ttft_p50_s'] * 1e3:12.1f} {ms(r, 'ttft', 90):>22} "
              f"{ms(r, 'ttft', 99):>22}")
print(f"\n{'rate /s':>8} {'scheduler':>10} {'TPOT ms: p50':>12} {'p90 [90% interval]':>22} "
      f"{'p99 [90% interval]':>22} {'met TTFT':>8} {'met TPOT':>8} {'met both':>8} "
      f"{'goodput /s':>10}")
for rate in RATES:
    for sched in ("continuous", "static"):
        r = at[sched, rate]
        ttft_ok = sum(1 for v in values(r, "ttft") if v <= TTFT_TARGET_S)
        tpot_ok = sum(1 for v in values(r, "tpot") if v <= TPOT_TARGET_S)
        print(f"{rate:8g} {sched:>10} {r['tpot_p50_s'] * 1e3:12.2f} {ms(r, 'tpot', 90):>22} "
              f"{ms(r, 'tpot', 99):>22} {ttft_ok:8d} {tpot_ok:8d} "
              f"{r['met_targets']:4d}/{r['requests']} {r['goodput_req_s']:10.1f}")

# %%
low, high = RATES[0], RATES[-1]
s_lo, c_lo = at["static", low], at["continuous", low]
s_hi, c_hi = at["static", high], at["continuous", high]


def versus(a, b, metric, a_name="the static server", b_name="the continuous server"):
    return compare(values(a, metric), values(b, metric), a_name, b_name,
                   quantity=metric.upper(), unit="requests").sentence()


def p90(r, metric, target):
    v, lo, hi = (r[f"{metric}_p90_{k}"] * 1e3 for k in ("s", "lo", "hi"))
    where = ("within the target" if hi <= target * 1e3 else "over the target"
             if lo > target * 1e3 else "the target inside its interval: a tie with it")
    return f"{v:.3g} ms [{lo:.3g}–{hi:.3g}], {where}"


def misses(r):
    t = sum(1 for x in r["results"] if x.ok and not x.ttft_s <= TTFT_TARGET_S)
    p = sum(1 for x in r["results"] if x.ok and x.tpot_s > TPOT_TARGET_S)
    return f"{t} missed the TTFT target and {p} the TPOT target"


display(Markdown(
    f"At the lowest load, {low:g} requests/s ({FRACTIONS[0]:g} × the burst's rate), "
    f"{versus(s_lo, c_lo, 'ttft')}, and {versus(s_lo, c_lo, 'tpot')}. The p90s: continuous "
    f"TTFT {p90(c_lo, 'ttft', TTFT_TARGET_S)}; TPOT {p90(c_lo, 'tpot', TPOT_TARGET_S)}; static "
    f"TTFT {p90(s_lo, 'ttft', TTFT_TARGET_S)}; TPOT {p90(s_lo, 'tpot', TPOT_TARGET_S)}. Of the "
    f"{c_lo['requests']} continuous requests {misses(c_lo)}; of the static ones {misses(s_lo)}.\n\n"
    f"From {low:g} to {high:g} requests/s, "
    f"{versus(c_lo, c_hi, 'ttft', *(f'the continuous server at {x:g}/s' for x in (low, high)))}; "
    f"{versus(s_lo, s_hi, 'ttft', *(f'the static server at {x:g}/s' for x in (low, high)))}. At "
    f"{high:g} requests/s, {versus(s_hi, c_hi, 'ttft')}. There the servers generated "
    f"{c_hi['throughput_tok_s']:.0f} (continuous) and {s_hi['throughput_tok_s']:.0f} (static) "
    f"tokens/s, {c_hi['throughput_tok_s'] / burst_tok_s:.2f}× and "
    f"{s_hi['throughput_tok_s'] / burst_tok_s:.2f}× the {burst_tok_s:.0f} of the bursts, whose "
    "batch was kept full.\n\n"
    "Goodput (requests/s meeting both targets): " + "; ".join(
        f"at {rate:g}/s continuous {at['continuous', rate]['goodput_req_s']:.1f} "
        f"({at['continuous', rate]['met_targets']} of {at['continuous', rate]['requests']} "
        f"requests), static {at['static', rate]['goodput_req_s']:.1f} "
        f"({at['static', rate]['met_targets']} of {at['static', rate]['requests']})"
        for rate in RATES) + ". "
    f"The largest load up to which at least 90% met both at every load (DistServe's goodput, "
    f"read off this sweep): continuous {sustained['continuous']:g}×, static "
    f"{sustained['static']:g}× the burst's rate (0: not even the lowest)." + "".join(
        f" The {sched} server met them again at {', '.join(f'{f:g}×' for f in again)}, above a "
        "load it missed."
        for sched in ("continuous", "static")
        if (again := [f for f in FRACTIONS if f > sustained[sched] and meets[sched, f]]))))

# %% [markdown]
# ## Play: the latency distribution at one rate
#
# Percentiles summarize a distribution; the CDF shows all of it. Pick a rate and a latency.

# %%
import ipywidgets as widgets

widgets.interactive(explore_rate, rows=widgets.fixed(rows),
                    rate=widgets.SelectionSlider(options=RATES, value=RATES[0],
                                                 description="rate /s"),
                    metric=widgets.ToggleButtons(options=["ttft", "tpot", "e2e"], value="ttft"),
                    draw=widgets.fixed(True))

# %%
view = explore_rate(rows, RATES[0], "ttft")
print(f"at {view.rate:g} requests/s, p90 TTFT: " +
      ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in view.p90.items()))

# %% [markdown]
# ## Explain
#
# At the lowest rate the arrivals ask for half of what the burst showed the server can do,
# so it is idle much of the time. Yet the static server's requests wait longer for their
# first token:

# %%
first_token = compare(values(s_lo, "ttft"), values(c_lo, "ttft"), "the static server",
                      "the continuous server", quantity="TTFT", unit="requests")
expect(first_token.verdict == "faster",
       "the continuous server's requests getting their first token sooner at the lowest rate")
display(Markdown(f"At {low:g} requests/s, {first_token.sentence()}; p90 TTFT: static "
                 f"{p90(s_lo, 'ttft', TTFT_TARGET_S)}; continuous "
                 f"{p90(c_lo, 'ttft', TTFT_TARGET_S)}."))
exercises.ask("nb10.explain_static_ttft")

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb10.explain_static_ttft", answer)

# %% [markdown]
# ## Stretch (build): the load generator's clock
#
# Write `poisson_arrivals(rate, n, seed)`: `n` arrival times in seconds from 0, increasing,
# with independent exponential gaps of mean 1/rate, the same times for the same seed. The
# check draws thousands of them and tests the mean gap and the shape of the distribution.

# %%
# NBVAL_CHECK_OUTPUT
def poisson_arrivals(rate, n, seed=0):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb10.poisson_arrivals", poisson_arrivals)

# %% [markdown]
# ## Takeaways
#
# - An OpenAI-compatible server puts any engine behind the same client: change the base URL.
# - A server's heart is one engine loop: it admits requests between steps, steps off the
#   event loop, routes each token to its stream, and aborts a request whose client left.
# - Judge it by percentiles under Poisson load, with their intervals, at a sweep of rates, and
#   by goodput: requests per second meeting both a TTFT and a TPOT target. Per-step admission
#   spares newcomers the wait for a whole batch.
#
# ## Further reading
#
# - Yu, Jeong, Kim, Kim, Chun. *Orca: A Distributed Serving System for Transformer-Based Generative Models.* OSDI 2022. [usenix.org/conference/osdi22/presentation/yu](https://www.usenix.org/conference/osdi22/presentation/yu)
# - Kwon, Li, Zhuang, Sheng, Zheng, Yu, Gonzalez, Zhang, Stoica. *Efficient Memory Management for Large Language Model Serving with PagedAttention.* SOSP 2023. [arXiv:2309.06180](https://arxiv.org/abs/2309.06180)
# - vLLM's OpenAI-compatible server: [docs.vllm.ai/en/latest/serving/openai_compatible_server.html](https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html)
# - OpenAI API reference, streaming responses: [platform.openai.com/docs/api-reference/chat-streaming](https://platform.openai.com/docs/api-reference/chat-streaming)
# - WHATWG HTML standard, server-sent events: [html.spec.whatwg.org/multipage/server-sent-events.html](https://html.spec.whatwg.org/multipage/server-sent-events.html)
# - Hugging Face Text Generation Inference, Messages API: [huggingface.co/docs/text-generation-inference/messages_api](https://huggingface.co/docs/text-generation-inference/messages_api)
# - Prometheus exposition formats: [prometheus.io/docs/instrumenting/exposition_formats](https://prometheus.io/docs/instrumenting/exposition_formats/)
# - vLLM v0's `AsyncLLMEngine`, the engine loop as an asyncio task: [github.com/vllm-project/vllm/blob/v0.5.0/vllm/engine/async_llm_engine.py](https://github.com/vllm-project/vllm/blob/v0.5.0/vllm/engine/async_llm_engine.py)
# - Python documentation, `asyncio.to_thread` and running blocking code: [docs.python.org/3/library/asyncio-task.html#running-in-threads](https://docs.python.org/3/library/asyncio-task.html#running-in-threads)
# - Efron, Tibshirani. *An Introduction to the Bootstrap.* Chapman & Hall, 1993 (the percentile interval, chapter 13).
# - Zhong, Liu, Chen, Hu, Zhu, Liu, Jin, Zhang. *DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving.* OSDI 2024. [arXiv:2401.09670](https://arxiv.org/abs/2401.09670)
