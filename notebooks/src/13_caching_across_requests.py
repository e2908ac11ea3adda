# %% [markdown]
# # 13 · Caching across requests
#
# **Why.** Notebook 04 kept one request's K/V in blocks and shared full blocks between prompts
# that start alike. Real traffic repeats itself far more than that. Every turn of a chat resends
# the whole conversation: ten turns of 100 tokens each send 100 + 200 + … + 1,000 = 5,500 prompt
# tokens to add 1,000 tokens of new text. Agents call the model again and again on a growing
# transcript, and few-shot prompts share a long preamble. Production engines keep that K/V:
#
# - **SGLang's RadixAttention** keeps the K/V of finished requests in a radix tree over tokens,
#   evicts unreferenced leaves least recently used first, and admits the waiting request with the
#   longest cached prefix first. On programs with shared prefixes (few-shot, multi-turn chat,
#   agents, tree search) it reports up to 6.4× the throughput of systems without it (Zheng et
#   al., *SGLang: Efficient Execution of Structured Language Model Programs*, NeurIPS 2024,
#   [arXiv:2312.07104](https://arxiv.org/abs/2312.07104)).
# - **DeepSeek's API** keeps context caches on disk: in one day of its service, 56.3% of the
#   input tokens (342B of 608B) hit the KV cache ([*DeepSeek-V3/R1 Inference System
#   Overview*](https://github.com/deepseek-ai/open-infra-index/blob/main/202502OpenSourceWeek/day_6_one_more_thing_deepseekV3R1_inference_system_overview.md),
#   2025).
#
# In this notebook you **build** the radix tree's two operations, `match` and `insert`, run the
# engine with them on a multi-turn chat trace whose turns arrive when the previous answer ends,
# check that the greedy tokens do not change, count how many prompt tokens each cache saves, then
# time what that does to the time to first token, and compare first-come-first-served admission
# with cache-aware admission over pool sizes. (Notebook 14 takes the other side of the KV cache:
# one sequence so long that its K/V is hard to read quickly, or to keep at all.)

# %%
import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.cache.block_manager import BlockManager
from llmlab.cache.radix import RadixCache
from llmlab.device import describe
from llmlab.engine.sessions import Session, Turn, run_sessions, sessions_of
from llmlab.profiling.compare import compare, fit_linear
from llmlab.profiling.steps import StepCost, fit_step_cost, prompt_token_cost, step_arrays
from llmlab.traces import load_trace
from llmlab.viz.prefix import explore_prefix_cache, plot_session_runs, sweep_policies, tree_text

torch.manual_seed(0)
for key, value in describe().items():
    print(f"{key:12s} {value}")
print("torch threads", torch.get_num_threads())
model = llmlab.load_model("smollm2-135m", attention="sdpa")
tok = llmlab.load_tokenizer("smollm2-135m")
sessions = sessions_of(load_trace("multiturn_chat", tokenizer=tok))
print(f"multi-turn trace: {len(sessions)} conversations, "
      f"{sum(len(s.turns) for s in sessions)} turns")

# %% [markdown]
# ## How: a radix tree over the block pool
#
# The hash cache of notebook 04 finds a prompt's prefix one **full block** at a time: a block's
# hash chains the hash of the block before it, so equal blocks after equal prefixes match. A
# prompt that shares 61 tokens with another, in blocks of 16, gets 48 of them back; the last 13
# are computed again.
#
# A **radix tree** finds the prefix **token by token**. Each edge holds a run of tokens and the
# physical blocks where their K/V live (a node covering positions 40–70 lists the blocks of
# logical blocks 2, 3 and 4). To match a prompt, walk down from the root: take the child whose
# edge starts with the next token, count how many of the edge's tokens agree, descend when the
# whole edge agrees, and when only part of it does, **split** the edge there, so that the match
# ends at a node. To insert a finished sequence, match it, then hang what is left under the node
# where the match ended as one new leaf.
#
# Three rules make it a cache over a shared pool:
#
# - **Reference counts.** The tree holds a reference to every block it lists, and a node is
#   *locked* while a running sequence's prefix goes through it.
# - **Eviction.** When the pool runs short, the least recently used *unlocked leaf* gives up its
#   last blocks. The shared heads (a system prompt) are inner nodes, and they go last.
# - **Partial blocks.** A match may end inside a block. The new prompt shares the full blocks
#   before it and gets a *copy* of the block where the match ends (the question at the end of
#   the notebook asks why).
#
# Two first turns of the trace share a system prompt. Here is what each cache finds when the
# second arrives after the first has finished:

# %%
# NBVAL_CHECK_OUTPUT
first, second = sessions[0].turns[0].token_ids, sessions[1].turns[0].token_ids
shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
for cache in ("hash", "radix"):
    bm = BlockManager(num_blocks=32, block_size=16, prefix_cache=cache)
    bm.allocate("turn 1", first)
    bm.mark_computed("turn 1", len(first))
    bm.free("turn 1")
    print(f"{cache:5s}: {bm.allocate('turn 2', second):2d} of the {shared} shared tokens found "
          f"(prompts of {len(first)} and {len(second)} tokens, blocks of 16); "
          f"blocks to copy: {bm.take_copies()}")
print(tree_text(bm.radix, lambda ids: tok.decode(ids), width=48))

# %% [markdown]
# The tree has split the first prompt's edge where the second one leaves it: the upper node
# (locked by the second prompt) holds the system prompt, and the first prompt's own question
# hangs below it. The radix cache found every shared token, the hash cache only the full blocks
# of them; the pair `(old, new)` is the block where the match ended and the copy the second
# prompt got of it.
#
# ## Build: the radix tree's match and insert
#
# Write the two operations of `llmlab.cache.radix.RadixCache`, as functions of the tree:
#
# - `match(tree, tokens) -> (node, length)`: the longest prefix of `tokens` the tree holds.
#   `node.end == length` must hold, so a match that stops inside an edge splits it there. Mark
#   the path used with `tree.touch(node)`: eviction takes the least recently used leaf first.
# - `insert(tree, tokens, table) -> node`: put `tokens` into the tree. Their K/V are in the
#   blocks of `table`, a block table that covers them. Return the node that ends at
#   `len(tokens)`. The shared part keeps the tree's blocks. The rest becomes one new leaf.
#
# What a tree offers: `tree.root`; for a node, `node.children` (a dict keyed by the first token
# of each child's edge), `node.tokens` (the edge), `node.start` and `node.end` (the positions it
# covers); `tree.split(node, n)` cuts `node`'s edge after `n` tokens and returns the new upper
# node; `tree.add_leaf(parent, tokens, table)` hangs a new leaf (it takes its blocks from
# `table` and their references); `tree.touch(node)` marks `node` and its ancestors used.
#
# The checker builds a tree with your pair and one with the library's, on a script of
# operations and 300 random ones, and compares them. It runs the block manager on your tree and
# follows every cached token's K/V slot by slot. Then SmolLM2 serves two conversations of the
# trace with it.

# %%
def match(tree, tokens):
    """The longest prefix of ``tokens`` the tree holds: (node, length), node.end == length."""
    raise NotImplementedError


def insert(tree, tokens, table):
    """Put ``tokens`` (K/V in the blocks of ``table``) into the tree; -> the node ending at
    len(tokens)."""
    raise NotImplementedError


# %%
# NBVAL_CHECK_OUTPUT
verdict = exercises.check("nb13.radix_tree", (match, insert))
print(verdict)

# %% [markdown]
# The engine below runs with your tree once it passes, and with the library's until then:

# %%
if verdict.passed:
    radix = lambda allocator, block_size: RadixCache(allocator, block_size, match=match,  # noqa: E731
                                                     insert=insert)
    print("the radix engine runs your match and insert")
else:
    radix = "radix"
    print("the radix engine runs llmlab's tree (yours has not passed yet)")

# %% [markdown]
# ## Predict, then measure
#
# Three conversations of the trace, three turns each, answers of 8 tokens, arriving at the
# trace's times (halved). Each turn resends the conversation. Before the run: what share of
# the prompt tokens it is sent will the radix cache compute?

# %%
exercises.ask("nb13.predict_computed_share")

# %%
predicted = ...  # YOUR ANSWER: a letter

# %% [markdown]
# ## Check: the same tokens with and without the cache
#
# The same sessions are served three times on SmolLM2: with no prefix cache, with the hash cache
# and with the radix tree. Each turn is queued only when the previous answer has finished (that
# answer becomes part of the next prompt). Answers are greedy, so all three runs must produce
# the same tokens.

# %%
few = [Session(s.id, [Turn(t.token_ids, 8, t.wait_s) for t in s.turns[:3]])
       for s in sessions[:3]]
engines = {"no cache": None, "hash": "hash", "radix": radix}
runs = {}
for name, cache in engines.items():
    llm = llmlab.LLM(model, tok, prefix_cache=cache, block_size=16, num_blocks=256)
    runs[name] = run_sessions(llm, few, time_scale=0.5)
    print(f"{name:8s}: {len(runs[name].turns)} turns in {runs[name].wall_s:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
tokens = {name: sorted((t.session, t.turn, t.output_token_ids) for t in r.turns)
          for name, r in runs.items()}
print("turns per run:", {name: len(r.turns) for name, r in runs.items()})
print("same greedy tokens in every turn, all three caches:",
      tokens["hash"] == tokens["no cache"] == tokens["radix"])

# %% [markdown]
# ## Measure: prompt tokens computed and the time to first token

# %%
for name, r in runs.items():
    print(f"{name:8s}: hit rate {r.hit_rate:4.0%}, prompt tokens computed "
          f"{r.computed_prompt_tokens:5d} of {r.prompt_tokens} sent ({r.computed_share:4.0%}), "
          f"TTFT p50 {r.ttft(0.5) * 1e3:5.0f} ms, p90 {r.ttft(0.9) * 1e3:5.0f} ms, "
          f"{r.throughput:5.1f} tok/s")
fig = plot_session_runs(runs, title=f"SmolLM2, {len(few)} conversations × 3 turns, "
                        f"{describe()['device']}")
plt.show()
none, hsh, rdx = runs["no cache"], runs["hash"], runs["radix"]
ttfts = {name: [t.ttft_s for t in r.turns] for name, r in runs.items()}
vs_none = compare(ttfts["no cache"], ttfts["radix"], "no cache", "the radix tree")
vs_hash = compare(ttfts["hash"], ttfts["radix"], "the hash cache", "the radix tree")
saved = hsh.computed_prompt_tokens - rdx.computed_prompt_tokens
display(Markdown(
    f"In this run the radix tree computed **{rdx.computed_share:.0%}** of the prompt tokens it "
    f"was sent ({rdx.computed_prompt_tokens} of {rdx.prompt_tokens}), the hash cache "
    f"{hsh.computed_share:.0%} and no cache {none.computed_share:.0%}: the tree computed "
    f"{abs(saved)} prompt tokens {'fewer' if saved >= 0 else 'more'} than the hash cache, about "
    f"{abs(saved) / len(rdx.turns):.0f} per turn"
    + (", the tokens between the last full block a prompt shares and the end of its match. "
       if saved > 0 else ". ")
    + f"By the median TTFT of the {len(rdx.turns)} turns, "
    f"{vs_none.sentence()}; against the hash cache, {vs_hash.sentence()}. A p90 of "
    f"{len(rdx.turns)} turns is one turn, so this run does not compare the tails; "
    "`python -m llmlab.bench prefix --trace multiturn_long` has enough turns for that."))

# %%
print(exercises.check("nb13.predict_computed_share", predicted, measured=rdx.computed_share))

# %% [markdown]
# ### Admission: first come, or longest cached prefix first
#
# With a pool smaller than the conversations, the caches must evict, and the order in which
# waiting requests are admitted matters. `admission="cache_aware"` admits the arrived request
# with the longest cached prefix first, before its prefix is evicted, and its short prefill
# leaves room for the others. It is bounded: a request is overtaken by later arrivals at most
# `max_overtakes` times (8 by default), so nothing starves.
#
# The whole trace with five engines takes minutes on this CPU (`python -m llmlab.bench prefix`
# measures it; `--trace multiturn_long`, 40 sessions and 157 turns, puts enough turns under
# each TTFT percentile to compare the tails). Here the engine's real scheduler and block
# manager serve the whole trace on a **step-cost model** fitted to the three runs above. The
# hit rates and token counts are the real cache's; the times are the model's.
#
# The model: a decode step costs a line through the median step at each number of decoding
# sequences the runs had, and a prompt token adds the median of what prompt tokens added to
# the steps that fed them (`llmlab.profiling.steps.prompt_token_cost`). Medians, so that a
# few steps slowed by other programs on the machine do not move it. A model holds only where
# it was fitted: a decode step reads the weights once however many sequences it carries, and
# the line through a few sequences says nothing about many. So the simulated engine runs at
# most as many sequences at once as the runs above had. The whole trace's longer turns can
# feed more prompt tokens per step than the runs did; there the per-token cost is used beyond
# its range.

# %%
stats = [r.step_stats for r in runs.values()]
step_ms, step_rows, step_prompt = step_arrays(stats)
decoding = (step_prompt == 0) & (step_rows > 0)
counts = sorted({int(n) for n in step_rows[decoding]})
max_rows = int(step_rows.max())
if len(counts) >= 2:
    medians = [float(np.median(step_ms[decoding & (step_rows == n)])) for n in counts]
    line = fit_linear(counts, medians)
    per_token = prompt_token_cost(stats, StepCost(line.a, line.b, 0.0, 0, 0.0))
    cost = StepCost(line.a, line.b, per_token, len(step_ms), 0.0)
    rms = float(np.sqrt(np.mean([(cost.predict_ms(n, t) - m) ** 2
                                 for m, n, t in zip(step_ms, step_rows, step_prompt)])))
    cost = StepCost(line.a, line.b, per_token, len(step_ms), rms)
else:                        # one batch size only: the least-squares fit over every step
    cost = fit_step_cost(stats)
print(f"step-cost model: {cost.fixed_ms:.1f} ms + {cost.per_row_ms:.2f} ms per decoding "
      f"sequence + {cost.per_prompt_token_ms:.3f} ms per prompt token "
      f"(over {cost.num_steps} steps, rms {cost.rms_ms:.1f} ms)")
print(f"range: {min(counts, default=0)}-{max_rows} decoding sequences and up to "
      f"{int(step_prompt.max())} prompt tokens per step")
for n in counts:
    pure = decoding & (step_rows == n)
    print(f"  decode steps of {n} sequence{'s' * (n > 1)}: measured median "
          f"{np.median(step_ms[pure]):5.1f} ms over {int(pure.sum())} steps, the model "
          f"{cost.predict_ms(n, 0):5.1f} ms")
POOL = 32
tight = sweep_policies(sessions, cost, num_blocks=POOL, max_num_seqs=max_rows)
for name, r in tight.items():
    print(f"{name:20s} hit rate {r.hit_rate:4.0%}, computes {r.computed_share:4.0%} of "
          f"{r.prompt_tokens} prompt tokens, TTFT p50 {r.ttft(0.5) * 1e3:5.0f} ms, "
          f"p90 {r.ttft(0.9) * 1e3:5.0f} ms (model), preempted {r.num_preemptions}")
ra, hs, rf = tight["radix + cache-aware"], tight["hash"], tight["radix"]


def against(x: float, y: float) -> str:
    """A modeled time against another: the model has no noise, so a difference under 5% is
    called no difference (the rms above says how far the model is from the steps)."""
    return "about the same as" if abs(x - y) <= 0.05 * y else "below" if x < y else "above"


p50, p90 = against(ra.ttft(0.5), rf.ttft(0.5)), against(ra.ttft(0.9), rf.ttft(0.9))
if p50 == p90 == "about the same as":
    verdict = ". At this pool size the order of admission changes little; the widget below moves it."
elif p50 == p90:
    verdict = f": {'lower' if p50 == 'below' else 'higher'} at both percentiles."
elif (p50, p90) == ("below", "above"):
    verdict = (": it shortens most waits and lengthens the slowest, those of the requests it "
               "passes.")
else:
    verdict = (f". The two percentiles do not move together: over {len(ra.turns)} turns the "
               "modeled times depend on which requests happen to meet in a step, and the count "
               "of prompt tokens computed is the steadier measure of what the order of "
               "admission does.")
display(Markdown(
    f"On this model of the machine, with {POOL} blocks and at most {max_rows} sequences at "
    f"once, first come first served, the radix tree computes {rf.computed_share:.0%} of the "
    f"prompt tokens and the hash cache {hs.computed_share:.0%}. Admitting the longest cached "
    f"prefix first takes the tree to **{ra.computed_share:.0%}** (preemptions: "
    f"{rf.num_preemptions} first come first served, {ra.num_preemptions} cache-aware). Its "
    f"TTFT p50 is {ra.ttft(0.5) * 1e3:.0f} ms, {p50} first come first served's "
    f"{rf.ttft(0.5) * 1e3:.0f} ms, and its p90 {ra.ttft(0.9) * 1e3:.0f} ms, {p90} "
    f"{rf.ttft(0.9) * 1e3:.0f} ms" + verdict))

# %% [markdown]
# ## Play: cache size × policy
#
# Move the pool size and pick a policy. Every policy is served at that size, the chosen one
# highlighted. Where does the radix tree stop helping? When does cache-aware admission pay?

# %%
def play_prefix(num_blocks, policy):
    explore_prefix_cache(sessions, cost, num_blocks, policy, max_num_seqs=max_rows)
    plt.show()


widgets.interactive(play_prefix,
                    num_blocks=widgets.SelectionSlider(options=[20, 24, 28, 32, 40, 48, 64, 256],
                                                       value=POOL, description="blocks"),
                    policy=widgets.Dropdown(options=[p for p in tight], value="radix"))

# %% [markdown]
# ## Explain: the copied block
#
# In the first experiment, the radix match of the second prompt ended inside one of the
# tree's blocks, and the block manager gave the prompt a copy of it (`blocks to copy`), while the full
# blocks before it were shared as they are. Why a copy, and not the block itself?

# %%
exercises.ask("nb13.explain_partial_copy")

# %%
# NBVAL_CHECK_OUTPUT
answer = ...  # YOUR ANSWER: a letter
exercises.check("nb13.explain_partial_copy", answer)

# %% [markdown]
# ## Takeaways
#
# - A multi-turn conversation resends everything it said. A cache that keeps the K/V of finished
#   requests computes only what is new; a radix tree finds the shared prefix token by token, and
#   the hash cache finds it block by block.
# - The pool is shared: the tree holds references, running requests lock their paths, and the
#   least recently used unlocked leaves give their blocks back first. Admitting the longest cached
#   prefix first keeps hits from being evicted, within a bound on how often a request is passed.
# - When the pool is smaller than the conversations, the order of admission decides which
#   cached prefixes survive: the longest cached prefix first, with a bound on how often a request
#   is passed. Count the prompt tokens computed first; the time to first token follows them.
#
# ## Further reading
#
# - Zheng, Yin, Xie, Sun, Huang, Yu, Cao, Kozyrakis, Stoica, Gonzalez, Barrett, Sheng. *SGLang:
#   Efficient Execution of Structured Language Model Programs* (RadixAttention, cache-aware
#   scheduling). NeurIPS 2024. [arXiv:2312.07104](https://arxiv.org/abs/2312.07104); its tree:
#   [`radix_cache.py`](https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/mem_cache/radix_cache.py)
# - Kwon et al. *Efficient Memory Management for Large Language Model Serving with
#   PagedAttention* (block sharing, copy-on-write). SOSP 2023.
#   [arXiv:2309.06180](https://arxiv.org/abs/2309.06180)
# - DeepSeek-AI. *DeepSeek-V3/R1 Inference System Overview* (on-disk KV cache hit rate). 2025.
#   [github.com/deepseek-ai/open-infra-index](https://github.com/deepseek-ai/open-infra-index/blob/main/202502OpenSourceWeek/day_6_one_more_thing_deepseekV3R1_inference_system_overview.md)
# - Morrison. *PATRICIA — Practical Algorithm To Retrieve Information Coded in Alphanumeric*
#   (the radix tree). JACM 15(4), 1968.
#   [doi:10.1145/321479.321481](https://doi.org/10.1145/321479.321481)
