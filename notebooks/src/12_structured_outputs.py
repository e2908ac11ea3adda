# %% [markdown]
# # 12 · Structured outputs: grammars as token masks
#
# **Why.** An application that reads a model's answer with `json.loads` needs the answer to be
# JSON, every time, in the shape its code expects. Serving frameworks do this by *constrained
# decoding*: at each step, the logits of every token that would break a grammar (a regex, a JSON
# schema, a list of choices) are set to −∞ before sampling. vLLM (`guided_json`,
# `guided_regex`, `guided_choice`, and OpenAI's `response_format` and `tools`) and TGI
# (`grammar`) both offer it, and it is the serving feature users most often report as slow or
# broken:
#
# - vLLM issue [#3567](https://github.com/vllm-project/vllm/issues/3567): guided JSON generated
#   about 70 tokens/s against about 800 without it;
# - [#12122](https://github.com/vllm-project/vllm/issues/12122): the median time to first token
#   went from 0.6 s to 4 s with the xgrammar backend;
# - [#19056](https://github.com/vllm-project/vllm/issues/19056) and
#   [#22885](https://github.com/vllm-project/vllm/issues/22885): streamed tool calls whose
#   arguments lost a closing `}` in the streaming parser.
#
# The fast answer is to compute as much of the mask as possible *before* generation. Outlines
# (Willard and Louf, *Efficient Guided Generation for Large Language Models*, 2023,
# [arXiv:2307.09702](https://arxiv.org/abs/2307.09702)) turns a regex into a DFA and indexes, for
# every DFA state, which tokens may follow. XGrammar (Dong et al., MLSys 2025,
# [arXiv:2411.15100](https://arxiv.org/abs/2411.15100)) does it for context-free grammars:
# it splits the vocabulary into *context-independent* tokens, whose validity in a grammar
# position is precomputed, and a few *context-dependent* ones checked at run time, and reports
# under 40 µs per mask against a decode step of milliseconds.
#
# Building a mask is CPU work even on a GPU server (the GPU is busy with the forward meanwhile),
# and SmolLM2's 49,152-token vocabulary is a realistic size, so this notebook measures it
# honestly on this machine. You will turn a regex into a DFA over characters, see why tokens
# make it hard, **build** the per-state token table, run SmolLM2 constrained by it, compare it
# with a well-kept library (llguidance), measure mask time and tokens per second, and look at
# how tool calls stream.

# %%
import json
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.device import describe
from llmlab.profiling import compare
from llmlab.structured import (TokenVocab, brute_force_mask, compile_grammar, has_library,
                               json_schema_to_regex, regex_to_dfa)

torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
print("torch threads", torch.get_num_threads())
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
EOS = model.config.eos_token_id
print("llguidance installed:", has_library())

# %% [markdown]
# ## How, part 1: an automaton over characters
#
# Take a small JSON answer with a fixed shape: a city name (a capital and 1 to 11 lowercase
# letters) and a temperature (1 or 2 digits, maybe negative). As a regex:

# %%
from llmlab.exercises.nb12 import PATTERN

print(PATTERN)
dfa = regex_to_dfa(PATTERN)
print(f"DFA: {dfa.num_states} states, {dfa.num_classes} character classes")

# %% [markdown]
# `regex_to_dfa` does three classical steps, given to you in `llmlab.structured`: a parser for a
# regex subset (classes, groups, `|`, `* + ? {m,n}`), Thompson's construction of an NFA
# (K. Thompson, CACM 1968, [doi:10.1145/363347.363387](https://doi.org/10.1145/363347.363387)),
# and the subset construction to a DFA (Rabin and Scott, 1959,
# [doi:10.1147/rd.32.0114](https://doi.org/10.1147/rd.32.0114)), then removes the states that
# can no longer reach an accepting one (so every live state can still be completed) and merges
# equivalent ones.
#
# The alphabet is every Unicode code point, but the pattern only asks about a few sets of
# characters (`[A-Z]`, `[a-z]`, `[0-9]`, `"`, ...), so code points fall into *classes* that
# behave alike, and the table is `transitions[state, class]`, −1 for *dead*. Walking a string
# is one lookup per character:

# %%
# NBVAL_CHECK_OUTPUT
target = '{"city":"Paris","temp":21}'
state, path = dfa.start, []
for ch in target:
    state = dfa.step(state, ch)
    path.append(state)
print("states:", path)
print("accepts:", bool(dfa.accepting[path[-1]]), "| 'Paris' with a digit:",
      dfa.fullmatch('{"city":"Par1s","temp":21}'))

# %% [markdown]
# ## How, part 2: the model does not write characters
#
# The model picks *tokens*. Here is how SmolLM2's tokenizer cuts the same answer:

# %%
# NBVAL_CHECK_OUTPUT
ids = tok.encode(target, add_special_tokens=False)
print(len(target), "characters,", len(ids), "tokens:", [tok.decode([i]) for i in ids])

# %% [markdown]
# A mask must say, for each of the 49,152 tokens, whether it may come next. The DFA judges one
# character at a time, so the obvious shortcut is to look at each token's first character. It
# fails because a token carries several characters. After `{"city":"Par`, the tokens `'is'`
# and `'ité'` both start with a lowercase letter, but the `é` of the second is outside `[a-z]`
# and breaks the city further in. And `'",'` closes the string *and* goes on into the
# separator: where a token ends, not where it starts, decides the state the next token is
# judged in.
#
# So a token is allowed in a state when *all* of its characters walk through the DFA without a
# dead transition, and the state where its last character lands is where the next token starts.
# Tokens like `'":"'` close one field and open the next; `'Par'` stops in the middle of the city.
# Neither end of a token has to line up with the pattern's pieces.
#
# There is one more catch: SmolLM2's tokenizer works on **bytes** (GPT-2's byte-level BPE). Most
# tokens are whole UTF-8 characters, but some hold part of one: a CJK character is often three
# single-byte tokens. Such a token cannot be judged from the DFA state alone; it depends on the
# bytes the previous tokens left pending. That is XGrammar's split, with pending bytes as the
# context:

# %%
# NBVAL_CHECK_OUTPUT
vocab = TokenVocab.from_tokenizer(tok, model.config.vocab_size, EOS)
print(f"vocabulary {vocab.vocab_size}: {int(vocab.independent.sum())} context-independent "
      f"(whole characters), {len(vocab.dependent_ids)} context-dependent (part of a "
      f"character), {int(vocab.special.sum())} special")
print("'龥' is", [vocab.token_bytes[i] for i in tok.encode("龥", add_special_tokens=False)])

# %% [markdown]
# The context-independent tokens get a table computed once per grammar: for each DFA state, the
# tokens allowed and the state each one leads to. The few hundred context-dependent tokens are
# checked at run time against the pending bytes (and that check is remembered per state and
# pending bytes). A mask is then one table lookup.
#
# Before building it, a prediction. Inside a JSON string value (after `"a`, with the string
# still open), what share of SmolLM2's vocabulary may come next?

# %%
exercises.ask("nb12.predict_allowed_fraction")

# %%
fraction_answer = ...  # YOUR ANSWER: "a", "b", "c" or "d"

# %% [markdown]
# ## Build: the token table
#
# Write `token_table(dfa, vocab)`. Given (you do not write these): the DFA above and the
# vocabulary as arrays.
#
# - `dfa.transitions` `[num_states, num_classes]` (int, −1 = dead), `dfa.accepting`
#   `[num_states]` (bool), `dfa.classify(codepoints)` maps code points (any int array) to classes;
# - `vocab.codepoints` `[vocab_size, max_chars]`: the characters of each context-independent
#   token as code points, −1 past its end; `vocab.lengths` `[vocab_size]`; `vocab.independent`
#   `[vocab_size]` (bool); `vocab.eos_token_id`;
# - return `allowed` (bool) and `next_state` (int), both `[num_states, vocab_size]`: a
#   context-independent token is allowed in state `s` when every one of its characters has a
#   transition, walking from `s`; `next_state` is where its last character lands (−1 where not
#   allowed); the end-of-sequence token is allowed exactly in the accepting states (otherwise a
#   finished answer could never stop); nothing else is allowed.
#
# Loop over states and over character positions, and let numpy move all 49,152 tokens at once
# (a Python loop over tokens is the *naive scan* measured below: seconds per state). The checker
# compares your table with llmlab's on every state and with a token-by-token walk on two, then
# runs SmolLM2 constrained by your table, greedy and sampled, and checks every output against the
# pattern. It fails a wrapper around llmlab's own walk.

# %%
def token_table(dfa, vocab):
    raise NotImplementedError


# %%
print(exercises.check("nb12.token_table", token_table))

# %% [markdown]
# llmlab's version is `llmlab.structured.table.walk_tokens`: the same walk, but each token
# leaves the arrays as soon as it ends or dies, so a state where few tokens fit costs little.
# `TokenTable` keeps the rows, walks a state the first time a sequence reaches it (or all of
# them with `precompute()`), and keeps each state's mask as a bool tensor.

# %% [markdown]
# ## Check: SmolLM2 under a grammar
#
# `llmlab.generate(..., structured=...)` and the engine's `SamplingParams(structured=...)` take a
# regex, a JSON schema (a dict or a pydantic model) or a list of choices. A pydantic model is the
# usual way to say what an application expects:

# %%
from pydantic import BaseModel, ConfigDict, Field


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")      # no properties beyond these three
    city: str = Field(max_length=20)
    temp_c: int
    sunny: bool


question = "What is the weather like in Paris today? Answer in JSON."
free = llmlab.generate(model, tok, question, max_new_tokens=40, kv_cache="contiguous")
constrained = llmlab.generate(model, tok, question, max_new_tokens=40, kv_cache="contiguous",
                              structured={"json_schema": Weather})
print("unconstrained:", repr(free.text[:120]))
print("constrained:  ", constrained.text, f"({len(constrained.token_ids)} tokens, "
      f"{constrained.finish_reason})")
print("validates:", Weather.model_validate_json(constrained.text))

# %% [markdown]
# The schema became a regex (for the subset llmlab's own automaton compiles: objects with
# required properties, strings with length bounds, numbers, integers, booleans, enums, arrays;
# the full JSON Schema goes to the library backend). Two checks that the masking changes nothing
# it should not: a grammar that allows every text leaves greedy decoding exactly as it was, and
# on the states of this output llmlab's masks equal llguidance's wherever llguidance does not
# *force* bytes (where a single way forward remains, llguidance keeps only the canonical tokens
# of the forced text, by design).

# %%
# NBVAL_CHECK_OUTPUT
print(json_schema_to_regex(Weather.model_json_schema()))
anything = llmlab.generate(model, tok, question, max_new_tokens=24, kv_cache="contiguous",
                           structured={"regex": r"(.|\n)*"})
plain = llmlab.generate(model, tok, question, max_new_tokens=24, kv_cache="contiguous")
print("allow-everything grammar, greedy tokens identical:", anything.token_ids == plain.token_ids)
pattern = json_schema_to_regex(Weather.model_json_schema())
own = compile_grammar({"regex": pattern, "backend": "llmlab"}, tok, model.config.vocab_size, EOS)
lib = compile_grammar({"regex": pattern, "backend": "llguidance"}, tok, model.config.vocab_size, EOS)
a, b = own.matcher(), lib.matcher()
equal = compared = 0
for t in constrained.token_ids:
    if not b.m.compute_ff_bytes():
        compared += 1
        equal += bool(torch.equal(a.allowed_mask(), b.allowed_mask()))
    a.advance(t)
    b.advance(t)
print(f"masks equal on {equal} of {compared} unforced states (of {len(constrained.token_ids)})")

# %% [markdown]
# ## Measure: what one mask costs, against a decode step
#
# Four ways to build the mask of one step, timed on the states of the constrained output above:
# the naive scan (each token walked in Python, at every step), the same walk vectorized but
# redone every step, the precomputed table (a lookup; the table's one-time build is printed),
# and llguidance (Rust: a byte-level lexer and an Earley parser over a token trie). The red line
# is one batch-1 decode step of SmolLM2 on this machine.

# %%
from llmlab.structured import TokenTable
from llmlab.structured.table import token_classes, walk_tokens
from llmlab.viz.structured import plot_mask_costs

gdfa = own.dfa
t0 = time.perf_counter()
table = TokenTable(gdfa, own.vocab).precompute()
build_s = time.perf_counter() - t0
own.table = table
states = []
m = own.matcher()
for t in constrained.token_ids:
    states.append((m.state, m.pending))
    m.advance(t)
logits = torch.randn(model.config.vocab_size)


def timed(fn, args):
    out = []
    for x in args:
        t0 = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t0)
    return out


def table_mask(sp):
    mm = own.matcher()
    mm.state, mm.pending = sp
    mm.mask_logits_(logits.clone())


timed(table_mask, states)                                  # warm the per-state masks
classes = token_classes(gdfa, own.vocab)
costs = {"naive scan (Python)": timed(lambda sp: brute_force_mask(gdfa, own.vocab, sp[0]),
                                      states[1:3]),
         "per-step walk (numpy)": timed(lambda sp: walk_tokens(gdfa, own.vocab, sp[0], classes),
                                        states[:8]),
         "token table (llmlab)": timed(table_mask, states)}
lm, lib_times = lib.matcher(), []
for t in constrained.token_ids:
    row = logits.clone()
    t0 = time.perf_counter()
    lm.mask_logits_(row)
    lib_times.append(time.perf_counter() - t0)
    lm.advance(t)
costs["llguidance"] = lib_times
steps = []
for _ in range(5):
    g = llmlab.generate(model, tok, question, max_new_tokens=9, kv_cache="contiguous",
                        ignore_eos=True)
    steps.append(statistics.median(np.diff(g.token_times_s)))
step_s = statistics.median(steps)
rows = [{"method": k, "median_s": statistics.median(v), "p10_s": float(np.percentile(v, 10)),
         "p90_s": float(np.percentile(v, 90))} for k, v in costs.items()]
for r in rows:
    print(f"{r['method']:22s} {r['median_s'] * 1e6:10.1f} µs per mask "
          f"({r['median_s'] / step_s:.2%} of a {step_s * 1e3:.0f} ms step)")
print(f"table build, once per grammar: {build_s * 1e3:.0f} ms for {gdfa.num_states} states")
plot_mask_costs(rows, step_s)
plt.show()

# %%
med = {r["method"]: r["median_s"] for r in rows}
display(Markdown(
    f"The naive scan costs {med['naive scan (Python)'] * 1e3:.0f} ms per step, "
    f"{med['naive scan (Python)'] / step_s:.1f}× a decode step"
    + (": done at every step it would cut the rate to a fraction of the plain one. "
       if med['naive scan (Python)'] > step_s else ". ")
    + f"The table brings it to "
    f"{med['token table (llmlab)'] * 1e6:.0f} µs "
    f"({med['naive scan (Python)'] / med['token table (llmlab)']:,.0f}× less), "
    f"{med['token table (llmlab)'] / step_s:.2%} of a step; llguidance needs "
    f"{med['llguidance'] * 1e6:.0f} µs without any table built ahead."))

# %% [markdown]
# And the whole loop: the time per decoded token of SmolLM2 at batch 1, unconstrained (ignoring
# EOS, the same number of tokens) against constrained by each backend. Each mode runs 5 times in
# turn after a warm-up round; the numbers are medians over every decode step of those runs,
# with the spread of the per-run medians. The schema is a list long enough not to finish first.

# %%
inventory = {"type": "object", "additionalProperties": False, "properties": {"items": {
    "type": "array", "maxItems": 30, "items": {
        "type": "object", "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 16}, "qty": {"type": "integer"}},
        "required": ["name", "qty"]}}}, "required": ["items"]}
ask_list = "List the items in a kitchen as JSON with a quantity for each."
modes = {"unconstrained": None, "llmlab": "llmlab", "llguidance": "llguidance"}
gaps = {k: [] for k in modes}
per_run = {k: [] for k in modes}
for rep in range(6):                                     # the first round warms up
    for mode, backend in modes.items():
        spec = None if backend is None else {"json_schema": inventory, "backend": backend}
        g = llmlab.generate(model, tok, ask_list, max_new_tokens=12, kv_cache="contiguous",
                            ignore_eos=backend is None, structured=spec)
        if rep:
            steps_here = np.diff(g.token_times_s)            # decode steps only
            gaps[mode] += list(steps_here)
            per_run[mode].append(1 / statistics.median(steps_here))
tok_s = {k: 1 / statistics.median(v) for k, v in gaps.items()}
for mode in modes:
    print(f"{mode:14s} {tok_s[mode]:6.1f} tok/s (runs {min(per_run[mode]):.1f}–"
          f"{max(per_run[mode]):.1f}), {tok_s[mode] / tok_s['unconstrained']:.0%} of unconstrained")
print("constrained output:", g.text)

# %%
per_token = {m: [1 / r for r in per_run[m]] for m in modes}      # seconds per decoded token
vs = {m: compare(per_token["unconstrained"], per_token[m], "unconstrained decoding",
                 f"decoding constrained by {m}", quantity="time per token")
      for m in ("llmlab", "llguidance")}
mask_s = {"llmlab": med["token table (llmlab)"], "llguidance": med["llguidance"]}
display(Markdown(
    f"Constrained by llmlab's table SmolLM2 ran at "
    f"{tok_s['llmlab'] / tok_s['unconstrained']:.0%} of its unconstrained rate, and at "
    f"{tok_s['llguidance'] / tok_s['unconstrained']:.0%} with llguidance (the target: at least "
    f"90%). Over the runs' medians, {vs['llmlab'].sentence()}; {vs['llguidance'].sentence()}. "
    + (f"The mask, {med['token table (llmlab)'] * 1e6:.0f} µs against a step of "
       f"{step_s * 1e3:.0f} ms, is lost in the noise here."
       if not any(c.resolved for c in vs.values()) else
       " ".join(f"With {m} a token took {abs(1 / tok_s[m] - 1 / tok_s['unconstrained']) * 1e3:.1f} "
                f"ms {'more' if tok_s[m] < tok_s['unconstrained'] else 'less'}, where its mask "
                f"costs {mask_s[m] * 1e6:.0f} µs: something besides the mask moved (the first "
                "visit of each state's row, or the machine's load)."
                for m, c in vs.items() if c.resolved))))

# %%
print(exercises.check("nb12.predict_allowed_fraction", fraction_answer))

# %% [markdown]
# ## Play: from a schema to the share of the vocabulary allowed
#
# Each schema below was run once through SmolLM2 (greedy, constrained by llguidance, whose
# forced stretches use canonical tokens that llmlab's masks allow too); the plot follows its
# output token by token and shows the share of the 49,152 tokens each backend's grammar allowed
# at that step. Inside strings almost everything fits; at the structure (`":"`, `","`, keys) a
# handful do, often exactly one. Where is the model actually choosing?

# %%
import ipywidgets as widgets

from llmlab.viz.structured import SchemaTrace, allowed_fractions, explore_schema

schemas = {
    "Weather (pydantic)": ({"json_schema": Weather}, question),
    "inventory list": ({"json_schema": inventory}, ask_list),
    "yes / no / maybe": ({"choice": ["yes", "no", "maybe"]}, "Is Paris in France?"),
    "date (regex)": ({"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, "When did the Berlin wall fall?"),
}
traces = {}
for name, (spec, prompt) in schemas.items():
    g = llmlab.generate(model, tok, prompt, max_new_tokens=28, kv_cache="contiguous",
                        structured={**spec, "backend": "llguidance"})
    ids = g.token_ids
    fr = {"llmlab": allowed_fractions(compile_grammar({**spec, "backend": "llmlab"}, tok,
                                                      model.config.vocab_size, EOS), ids)}
    fr["llguidance"] = allowed_fractions(compile_grammar({**spec, "backend": "llguidance"}, tok,
                                                         model.config.vocab_size, EOS), ids)
    traces[name] = SchemaTrace(name, [tok.decode([i]) for i in ids], model.config.vocab_size, fr)


print(explore_schema(traces, "inventory list"))
plt.show()


def play(schema: str, log_scale: bool) -> None:
    print(explore_schema(traces, schema, log_scale))
    plt.show()


widgets.interactive(play, schema=widgets.Dropdown(options=list(traces)),
                    log_scale=widgets.Checkbox(value=True, description="log scale"))

# %% [markdown]
# ## Predict, then stretch: tool calls on the wire
#
# With `tools` and `tool_choice="required"` (or a named function), llmlab's server constrains
# the output to `{"name": <a tool>, "arguments": <its parameters' schema>}` and answers it as
# OpenAI's `message.tool_calls`. Streamed, OpenAI's format sends the call's id and name in a
# first `delta.tool_calls` chunk and then the *arguments text* in pieces, which the client
# concatenates and parses at the end. The server must therefore cut the arguments out of the
# text as it streams: that streaming parser is where vLLM's bugs above lived.
#
# A first attempt forwards every character after `"arguments":` as it arrives. For the call
# below, what does the client end up with?

# %%
from llmlab.exercises.nb12 import CALL

print(CALL)
exercises.ask("nb12.predict_naive_tool_stream")

# %%
stream_answer = ...  # YOUR ANSWER: "a", "b", "c" or "d"
print(exercises.check("nb12.predict_naive_tool_stream", stream_answer))

# %% [markdown]
# ### Stretch: the streaming parser
#
# Write `stream_arguments(pieces)`: `pieces` is the generated text of one call,
# `{"name": "...", "arguments": {...}}`, cut into pieces as the tokens arrived; return, for each
# piece, the part of the arguments that may be shown once it has arrived (an empty string when
# nothing new is known). Everything shown must concatenate to exactly the arguments' JSON: not
# one character of the wrapper, none of the arguments lost, and a `}` inside a string value is
# text, not the end.

# %%
def stream_arguments(pieces):
    raise NotImplementedError


print(exercises.check("nb12.stream_arguments", stream_arguments))

# %% [markdown]
# llmlab's server uses `llmlab.serve.tools.ToolCallStreamParser` (the same idea, also reading the
# name). The request fields map onto one `structured` spec each; a second one, or a schema that
# is not one, is a 400 naming the field:

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.serve.protocol import ChatCompletionRequest
from llmlab.serve.tools import FieldError, structured_request

tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
req = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}],
                            tools=[tool], tool_choice="required")
print(json.dumps(structured_request(req)))
try:
    structured_request(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                             guided_json={"type": "strin"}))
except FieldError as e:
    print("400:", e.param, "-", e)

# %% [markdown]
# `python -m llmlab.bench structured` prints both tables of this notebook for a longer run, at
# batch 1 and 8, with the engine; the README's results table quotes it.
#
# ## Takeaways
#
# - A grammar becomes a DFA over characters; a token is allowed when *all* its characters walk
#   through it, and the next token starts where its last one landed.
# - Precompute per state for the context-independent tokens, check the few context-dependent
#   ones (here: partial UTF-8 characters) at run time: the mask becomes a lookup, far below a
#   decode step, where a per-step scan costs more than the step itself.
# - Tool calls are structured outputs plus a streaming parser that must stop exactly where the
#   arguments end.
#
# ## Further reading
#
# - B. T. Willard, R. Louf, *Efficient Guided Generation for Large Language Models*, 2023,
#   [arXiv:2307.09702](https://arxiv.org/abs/2307.09702) (Outlines: regex → DFA → token index).
# - Y. Dong et al., *XGrammar: Flexible and Efficient Structured Generation Engine for Large
#   Language Models*, MLSys 2025, [arXiv:2411.15100](https://arxiv.org/abs/2411.15100).
# - llguidance, [github.com/guidance-ai/llguidance](https://github.com/guidance-ai/llguidance),
#   and its note on forced tokens and canonical tokenization,
#   [docs/fast_forward.md](https://github.com/guidance-ai/llguidance/blob/main/docs/fast_forward.md).
# - vLLM, *Structured Outputs*,
#   [docs.vllm.ai/en/latest/features/structured_outputs.html](https://docs.vllm.ai/en/latest/features/structured_outputs.html);
#   OpenAI, *Structured Outputs* and *Function calling* guides,
#   [platform.openai.com/docs/guides/structured-outputs](https://platform.openai.com/docs/guides/structured-outputs),
#   [platform.openai.com/docs/guides/function-calling](https://platform.openai.com/docs/guides/function-calling).
# - K. Thompson, *Regular expression search algorithm*, CACM 11(6), 1968,
#   [doi:10.1145/363347.363387](https://doi.org/10.1145/363347.363387); M. O. Rabin and D. Scott,
#   *Finite automata and their decision problems*, IBM J. Res. Dev. 3(2), 1959,
#   [doi:10.1147/rd.32.0114](https://doi.org/10.1147/rd.32.0114).
