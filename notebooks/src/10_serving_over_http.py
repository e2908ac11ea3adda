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
#   p50/p90/p99 of TTFT, TPOT and end-to-end latency, plus *goodput*: the requests per second
#   that met a latency target.
#
# In this notebook you start llmlab's own OpenAI-compatible server, `python -m llmlab.serve`,
# talk to it with the official `openai` client and with curl, and watch its Prometheus
# metrics move. You write the client's SSE parser as a warm-up, then **build the heart of the
# server**: the engine loop that lets requests from many HTTP clients join one running batch
# and drops a request whose client went away. Last, a rate sweep of the static scheduler
# against the continuous one, with an interval on each p90 and the goodput computed.

# %%
import asyncio
import json
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
from llmlab.bench.serve_http import rate_sweep, request_bodies, sustained_rate
from llmlab.device import describe
from llmlab.serve.client import percentile_interval, scrape_metrics, watch_metrics
from llmlab.serve.process import ServerProcess
from llmlab.traces import TRACES_DIR, load_trace
from llmlab.viz.http import explore_rate, plot_gauges, plot_sweep

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
# stack scrapes). Below, the requests of the load test at the end of this notebook: prompts
# of the trace in `data/traces/` (18 to 233 tokens), each with up to 16 greedy tokens. Send
# 16 of them at once to a server with 8 seats and scrape the gauges every 0.1 s while they run:

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
peak_running = max(m["llmlab_requests_running"] for _, m in samples)
peak_waiting = max(m["llmlab_requests_waiting"] for _, m in samples)
print("peak running", peak_running, "| peak waiting", peak_waiting,
      "| KV blocks used at the end", samples[-1][1]["llmlab_kv_blocks_used"])
assert peak_running == SEATS and peak_waiting > 0 and samples[-1][1]["llmlab_kv_blocks_used"] == 0
plot_gauges(samples, f"{MODEL}, {BURST} concurrent streams, {SEATS} seats")
plt.show()

# %% [markdown]
# Eight requests get a seat at once and the others wait; as the first ones finish, the
# waiting ones take their seats between two steps. The KV blocks rise as the sequences grow
# and fall to 0 when the last one ends: the server frees a request's blocks when it finishes,
# and also when its client disconnects mid-stream.
#
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
# Next you send the trace's requests at random times, as independent users would: a
# **Poisson process**, whose gaps between arrivals are exponential with mean 1/rate.
#
# The burst above kept the batch full and finished a number of requests per second.
# **Predict** the largest arrival rate (requests per second) at which the continuous server
# keeps its p90 TTFT within the target below. A server saturates when requests arrive
# faster than it finishes them.

# %%
my_rate = ...  # YOUR PREDICTION: requests per second

# %% [markdown]
# The sweep offers each server three rates: half, once and 1.5 times the rate the burst
# finished, so that the loads mean about the same on any machine. The TTFT target scales with
# the machine too: 5 times the median TTFT of a lone request here, room for a few steps of
# waiting. Both servers run side by side (the idle one costs nothing), and at each rate they
# get the same requests at the same Poisson times, one right after the other, in alternating
# order, so that a slower minute of this machine does not fall on one of them only.

# %%
lone_ttft = []
for body in bodies[:5]:
    t0 = time.perf_counter()
    stream = client.completions.create(model=MODEL, stream=True, prompt=body["prompt"],
                                       max_tokens=2, temperature=0)
    next(c for c in stream if c.choices and c.choices[0].text)
    lone_ttft.append(time.perf_counter() - t0)
    stream.close()
TARGET_S = round(5 * sorted(lone_ttft)[2], 2)
FRACTIONS = (0.5, 1.0, 1.5)
RATES = [float(f"{f * capacity:.2g}") for f in FRACTIONS]
# 16 requests per rate; fewer (not under 12) where the machine is so slow that the arrivals
# alone would take over a minute per server: the intervals below then widen, as they should
N_REQUESTS = 12 if QUICK else max(12, min(16, int(64 / sum(1 / r for r in RATES))))
sweep_bodies = bodies[:N_REQUESTS]
print(f"lone TTFT median {sorted(lone_ttft)[2] * 1e3:.0f} ms -> p90 TTFT target {TARGET_S:g} s; "
      f"{N_REQUESTS} requests per rate at {RATES} requests/s "
      f"({', '.join(f'{f:g}' for f in FRACTIONS)} x the burst's {capacity:.2f})")
static = ServerProcess(MODEL, scheduler="static", extra=["--max-num-seqs", str(SEATS)])
servers = {"continuous": server, "static": static}
rows = []


def sweep_at(i: int) -> None:
    """Both servers at RATES[i], one after the other (order alternating with i)."""
    order = ("continuous", "static") if i % 2 == 0 else ("static", "continuous")
    for label in order:
        rows.extend(rate_sweep(servers[label].base_url, MODEL, sweep_bodies, [RATES[i]],
                               TARGET_S, seed=i, label=label, keep_results=True,
                               warmup=(i == 0)))


# %%
sweep_at(0)

# %%
sweep_at(1)

# %%
sweep_at(2)
for label, srv in servers.items():
    print(f"{label} server stopped (exit status {srv.stop()})")
for r in rows:                     # a 90% bootstrap interval for each p90
    ttfts = [x.ttft_s for x in r["results"] if x.ok]
    r["ttft_p90_lo"], r["ttft_p90_hi"] = percentile_interval(ttfts, 90)
sustained = {s: sustained_rate([r for r in rows if r["scheduler"] == s], TARGET_S)
             for s in ("static", "continuous")}
print("largest rate within the target:", sustained,
      "| lost requests:", sum(r["lost"] for r in rows))

# %%
exercises.check("nb10.predict_capacity", my_rate, measured=sustained["continuous"],
                capacity=capacity)

# %% [markdown]
# ## Measure: the rate sweep
#
# Left, the p90 TTFT at each rate with its 90% bootstrap interval: with 12-16 requests per rate a
# p90 rests on the slowest few, and the bar shows how far another run could move it. Middle,
# latency against throughput. Right, the **goodput**: the requests per second that met the
# TTFT target (completed requests whose TTFT was within it, over the run's wall time).

# %%
plot_sweep(rows, TARGET_S, f"{MODEL}, {SEATS} seats, {N_REQUESTS} requests per rate")
plt.show()
at = {(r["scheduler"], r["rate"]): r for r in rows}
print(f"{'rate /s':>8} {'scheduler':>10} {'p90 TTFT s [90% interval]':>27} {'p50 TTFT s':>10} "
      f"{'goodput /s':>10} {'met target':>10}")
for rate in RATES:
    for sched in ("continuous", "static"):
        r = at[sched, rate]
        met = sum(1 for x in r["results"] if x.ok and x.ttft_s <= TARGET_S)
        print(f"{rate:8g} {sched:>10} {r['ttft_p90_s']:9.2f} [{r['ttft_p90_lo']:5.2f}, "
              f"{r['ttft_p90_hi']:5.2f}]   {r['ttft_p50_s']:10.2f} {r['goodput_req_s']:10.2f} "
              f"{met:>5}/{r['requests']}")

# %%
low, high = RATES[0], RATES[-1]
s_lo, c_lo = at["static", low], at["continuous", low]
s_hi, c_hi = at["static", high], at["continuous", high]
apart = s_lo["ttft_p90_lo"] > c_lo["ttft_p90_hi"]


def grows(r0, r1):
    f = r1["ttft_p90_s"] / r0["ttft_p90_s"]
    word = "rises" if f > 1.2 else "falls" if f < 1 / 1.2 else "stays about level"
    return f"{word}, from {r0['ttft_p90_s']:.2f} s to {r1['ttft_p90_s']:.2f} s (×{f:.1f})"


def compare(a, b, what):
    ratio = a[what] / b[what] if b[what] else float("inf")
    return (f"{ratio:.1f}× the continuous one's" if ratio > 1.1 else
            f"{1 / ratio:.1f}× below the continuous one's" if ratio < 1 / 1.1 else
            "about the same as the continuous one's")


def within(r):
    return "within the target" if r["ttft_p90_s"] <= TARGET_S else "over the target"


display(Markdown(
    f"At the lowest rate, {low:g} requests/s ({FRACTIONS[0]:g} × what the burst finished per "
    f"second), the static server's p90 TTFT is {s_lo['ttft_p90_s']:.2f} s, "
    f"{compare(s_lo, c_lo, 'ttft_p90_s')} ({c_lo['ttft_p90_s']:.2f} s); the 90% intervals "
    f"{'do not overlap' if apart else 'overlap, so this run cannot tell them apart'}. "
    f"From {low:g} to {high:g} requests/s the continuous server's p90 TTFT {grows(c_lo, c_hi)}; "
    f"the static one's {grows(s_lo, s_hi)}. At {high:g} requests/s the continuous p90 is "
    f"{within(c_hi)} ({TARGET_S:g} s) and the static one {within(s_hi)}, "
    f"{compare(s_hi, c_hi, 'ttft_p90_s')}. Goodput within {TARGET_S:g} s: " + "; ".join(
        f"at {rate:g}/s continuous {at['continuous', rate]['goodput_req_s']:.2f}, static "
        f"{at['static', rate]['goodput_req_s']:.2f}" for rate in RATES) + " requests/s. "
    f"The largest rate whose p90 TTFT met the target: continuous {sustained['continuous']:g}, "
    f"static {sustained['static']:g} requests/s (0: none of the sweep)."))

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
      ", ".join(f"{s} {v:.2f} s" for s, v in view.p90.items()))

# %% [markdown]
# ## Explain
#
# At the lowest rate the arrivals ask for about half of what the burst showed the server can
# do, so it is idle much of the time. Yet the static scheduler's p90 TTFT is above the
# continuous one's:

# %%
assert s_lo["ttft_p90_s"] > 1.2 * c_lo["ttft_p90_s"], "this run does not show it: read the table"
display(Markdown(f"At {low:g} requests/s: static {s_lo['ttft_p90_s']:.2f} s, continuous "
                 f"{c_lo['ttft_p90_s']:.2f} s, {s_lo['ttft_p90_s'] / c_lo['ttft_p90_s']:.1f}×."))
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
# - Judge it by percentiles under Poisson load: p90 TTFT with its interval, and goodput, at a
#   sweep of rates; per-step admission spares newcomers the wait for a whole batch.
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
