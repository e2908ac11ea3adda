# %% [markdown]
# # 10 · Solutions
#
# One reference answer per exercise of notebook 10, each followed by its check.

# %%
import json
import random

from llmlab import exercises
from llmlab.serve.process import ServerProcess

server = ServerProcess("smollm2-135m", scheduler="continuous")

# %% [markdown]
# ## Build: the client's SSE parser
#
# Keep the `data:` values of the current event in a list. A blank line ends the event: join
# the values with newlines; `[DONE]` ends the stream, anything else is one JSON chunk. Lines
# starting with `:` are comments; other fields (`event:`, `id:`) are skipped. Strip the line
# ending first (`\r\n` or `\n`), and at most one space after the colon.

# %%
def parse_sse(lines):
    data = []
    for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if not data:
                continue
            payload, data = "\n".join(data), []
            if payload == "[DONE]":
                return
            yield json.loads(payload)
        elif line.startswith("data:"):
            value = line[len("data:"):]
            data.append(value[1:] if value.startswith(" ") else value)


exercises.check("nb10.parse_sse", parse_sse, base_url=server.base_url)

# %% [markdown]
# ## Predict: the rate the continuous server sustains
#
# At full batch the server makes a certain number of tokens per second (the burst measured
# it); each request needs its prompt's prefill plus up to 16 tokens. The sustainable rate is
# about (tokens per second) / (tokens per request), a few requests per second on a 2-core CPU.
# Past it, requests queue and the TTFT grows with every arrival. Without a measurement the
# check compares with a typical 2-core value.

# %%
exercises.check("nb10.predict_capacity", 2.0)

# %% [markdown]
# ## Explain: static TTFT
#
# (b): a static batch is formed once and runs until its last member finishes; whoever arrives
# meanwhile waits for all of it. Orca (OSDI 2022) called this request-level scheduling and
# replaced it with iteration-level scheduling, the continuous batching of notebook 05.

# %%
# NBVAL_CHECK_OUTPUT
exercises.check("nb10.explain_static_ttft", "b")

# %% [markdown]
# ## Stretch: Poisson arrivals
#
# Add up independent exponential gaps of mean 1/rate, drawn from a generator of its own so the
# same seed gives the same times whatever else uses `random`.

# %%
# NBVAL_CHECK_OUTPUT
def poisson_arrivals(rate, n, seed=0):
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


exercises.check("nb10.poisson_arrivals", poisson_arrivals)

# %%
print("server stopped, exit status", server.stop())
