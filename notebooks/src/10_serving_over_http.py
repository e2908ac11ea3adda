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
# talk to it with the official `openai` client and with curl, watch its Prometheus metrics
# move, **build** the client's SSE parser, and run a small rate sweep of the static scheduler
# against the continuous one.

# %%
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

import llmlab
from llmlab import exercises
from llmlab.bench.serve_http import rate_sweep, request_bodies, sustained_rate
from llmlab.device import describe
from llmlab.serve.client import scrape_metrics, watch_metrics
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
# would run `llmlab-serve --model smollm2-135m --port 8000`.) One thread in that process owns
# the engine and loops over `engine.step()`; each HTTP request is queued to it, joins the
# running batch between two steps, and gets its tokens back through a queue of its own. That
# is continuous batching across clients.
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
# stack scrapes). Send 12 streaming requests at once to a server with 8 seats and scrape the
# gauges every 0.1 s while they run:

# %%
def burst(n: int, max_tokens: int) -> list[str]:
    def one(i):
        stream = client.completions.create(model=MODEL, prompt=f"Count to ten, number {i}:",
                                           max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


names = ["llmlab_requests_running", "llmlab_requests_waiting", "llmlab_kv_blocks_used"]
before = scrape_metrics(server.base_url)
done = threading.Event()
watcher = ThreadPoolExecutor(1).submit(watch_metrics, server.base_url, names, done.is_set, 0.1)
t0 = time.perf_counter()
texts = burst(12, 24)
burst_s = time.perf_counter() - t0
time.sleep(0.3)
done.set()
samples = watcher.result()
after = scrape_metrics(server.base_url)
generated = after["llmlab_generation_tokens_total"] - before["llmlab_generation_tokens_total"]
print(f"12 requests, {generated:.0f} tokens in {burst_s:.1f} s: {generated / burst_s:.0f} "
      f"generated tokens/s with up to {SEATS} in the batch")
print("peak running", max(m["llmlab_requests_running"] for _, m in samples),
      "| peak waiting", max(m["llmlab_requests_waiting"] for _, m in samples),
      "| KV blocks used at the end", samples[-1][1]["llmlab_kv_blocks_used"])
plot_gauges(samples, f"{MODEL}, 12 concurrent streams, {SEATS} seats")
plt.show()

# %% [markdown]
# Eight requests get a seat at once and four wait; as the first ones finish, the waiting ones
# take their seats between two steps. The KV blocks rise as the sequences grow and fall to 0
# when the last one ends: the server frees a request's blocks when it finishes, and also when
# its client disconnects mid-stream (the tests check that).
#
# ## Build: the client's SSE parser
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
# ## Predict, then measure: how much load does it take?
#
# Next you send requests at random times, as independent users would: a **Poisson process**,
# whose gaps between arrivals are exponential with mean 1/rate. Each request is a prompt of
# the trace in `data/traces/` with up to 16 greedy tokens. The target is a p90 TTFT of 1 s.
#
# The burst above measured how many tokens per second the server makes with its batch full.
# **Predict** the largest arrival rate (requests per second) the continuous server sustains
# within the target. A server saturates when requests arrive faster than it finishes them.

# %%
my_rate = ...  # YOUR PREDICTION: requests per second

# %%
TARGET_S = 1.0
N_REQUESTS = 8 if QUICK else 10
RATES = [1.0, 2.0, 4.0, 8.0]
trace = load_trace(TRACES_DIR / "cpu.jsonl", N_REQUESTS, max_output=16)
bodies = request_bodies(trace, max_tokens=16)
print(f"{len(bodies)} requests per rate, {sum(b['max_tokens'] for b in bodies)} tokens in all; "
      f"rates {RATES} requests/s; p90 TTFT target {TARGET_S:g} s")
rows = rate_sweep(server.base_url, MODEL, bodies, RATES, TARGET_S, seed=0, label="continuous",
                  keep_results=True)
code = server.stop()
print(f"continuous server stopped (exit status {code})")

with ServerProcess(MODEL, scheduler="static", extra=["--max-num-seqs", str(SEATS)]) as static:
    rows += rate_sweep(static.base_url, MODEL, bodies, RATES, TARGET_S, seed=0, label="static",
                       keep_results=True)
sustained = {s: sustained_rate([r for r in rows if r["scheduler"] == s], TARGET_S)
             for s in ("static", "continuous")}
print("largest rate within the target:", sustained,
      "| lost requests:", sum(r["lost"] for r in rows))

# %%
exercises.check("nb10.predict_capacity", my_rate, measured=sustained["continuous"])

# %% [markdown]
# ## Measure: the rate sweep

# %%
plot_sweep(rows, TARGET_S, f"{MODEL}, {SEATS} seats, {N_REQUESTS} requests per rate "
           f"(2-core CPU, one run)")
plt.show()

# %% [markdown]
# Both servers get the same requests at the same times. The static server's p90 TTFT is high
# already at the lowest rate: a static batch holds the server until its last member has
# made all its tokens, so a request that arrives meanwhile waits for the whole batch, about
# max_tokens steps, before its own prefill. The continuous server admits it at the next step,
# so its TTFT stays near one prefill until the arrivals approach what it can finish per
# second; then requests queue for seats and its TTFT climbs too. Throughput follows the
# arrival rate while a server keeps up and flattens where it saturates (right: each point is a
# rate); the continuous one flattens higher and at a lower latency, because its seats never
# sit idle waiting for a batch's longest member.
# With ten requests per rate on a 2-core CPU one run's p90 is noisy (read the printed
# numbers, not the curve's wiggles); `python -m llmlab.bench serve-http` runs the larger sweep
# quoted in the README.
#
# ## Play: the latency distribution at one rate
#
# Percentiles summarize a distribution; the CDF shows all of it. Pick a rate and a latency.

# %%
import ipywidgets as widgets

widgets.interactive(explore_rate, rows=widgets.fixed(rows),
                    rate=widgets.SelectionSlider(options=RATES, value=RATES[-2],
                                                 description="rate /s"),
                    metric=widgets.ToggleButtons(options=["ttft", "tpot", "e2e"], value="ttft"),
                    draw=widgets.fixed(True))

# %%
view = explore_rate(rows, RATES[-1], "ttft")
print(f"at {view.rate:g} requests/s, p90 TTFT: " +
      ", ".join(f"{s} {v:.2f} s" for s, v in view.p90.items()))

# %% [markdown]
# ## Explain
#
# Why does the static scheduler's TTFT grow so much faster with the rate than the continuous
# one's?
#
# - (a) each step of a static batch is slower
# - (b) a request that arrives while a batch runs waits until the whole batch has finished
# - (c) HTTP and SSE cost more with the static scheduler
# - (d) the static scheduler admits new requests between steps, but pads them

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
# - Serve for percentiles: TTFT and TPOT under a Poisson load, at a sweep of rates, with a target.
# - Per-step admission (continuous batching) keeps TTFT low far past the rate where per-batch admission queues up.
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
# - Zhong, Liu, Chen, Hu, Zhu, Liu, Jin, Zhang. *DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving.* OSDI 2024. [arXiv:2401.09670](https://arxiv.org/abs/2401.09670)
