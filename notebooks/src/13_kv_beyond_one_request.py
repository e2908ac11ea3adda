# %% [markdown]
# # 13 · KV beyond one request
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
# Long contexts bring the opposite problem: one sequence's K/V becomes too long to read quickly,
# or to keep at all. The second half of this notebook splits a long sequence's K/V across the
# chip (flash-decoding) and keeps only a few *sink* tokens and a window (StreamingLLM).
#
# In the first half you **build** the radix tree's two operations, `match` and `insert`, run the
# engine with them on a multi-turn chat trace whose turns arrive when the previous answer ends,
# check that the greedy tokens do not change, measure how many prompt tokens each cache saves and
# what that does to the time to first token, and compare first-come-first-served admission with
# cache-aware admission over pool sizes.

# %%
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.cache.block_manager import BlockManager
from llmlab.cache.radix import RadixCache
from llmlab.device import describe
from llmlab.engine.sessions import Session, Turn, run_sessions, sessions_of
from llmlab.profiling.steps import fit_step_cost
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
#   before it. Its own tokens go into the rest of that last block, so it writes into a copy.
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
# hangs below it. The radix cache found every shared token; the block of the split is copied
# for the second prompt, which writes its question into its copy.
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
display(Markdown(
    f"In this run the radix tree computed **{rdx.computed_share:.0%}** of the prompt tokens it "
    f"was sent and the hash cache {hsh.computed_share:.0%} (no cache: {none.computed_share:.0%}). "
    f"The radix tree's TTFT p90 was {rdx.ttft(0.9) * 1e3:.0f} ms against the hash cache's "
    f"{hsh.ttft(0.9) * 1e3:.0f} ms and no cache's {none.ttft(0.9) * 1e3:.0f} ms: "
    + ("the radix tree had the lowest p90." if rdx.ttft(0.9) <= min(hsh.ttft(0.9), none.ttft(0.9))
       else "the radix tree did not have the lowest p90 here; with prompts this short a "
            "turn's prefill is a small part of its wait on a busy machine.")))

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
# measures it). Here the engine's real scheduler and block manager serve the whole trace on a
# **step-cost model** fitted to the three runs above. The hit rates and token counts are the
# real cache's; the times are the model's.

# %%
cost = fit_step_cost([r.step_stats for r in runs.values()])
print(f"step-cost model: {cost.fixed_ms:.1f} ms + {cost.per_row_ms:.2f} ms per decoding "
      f"sequence + {cost.per_prompt_token_ms:.3f} ms per prompt token "
      f"(fitted on {cost.num_steps} steps, rms {cost.rms_ms:.1f} ms)")
tight = sweep_policies(sessions, cost, num_blocks=48)
for name, r in tight.items():
    print(f"{name:20s} hit rate {r.hit_rate:4.0%}, computes {r.computed_share:4.0%} of "
          f"{r.prompt_tokens} prompt tokens, TTFT p50 {r.ttft(0.5) * 1e3:5.0f} ms, "
          f"p90 {r.ttft(0.9) * 1e3:5.0f} ms (model), preempted {r.num_preemptions}")
ra, hs, rf = tight["radix + cache-aware"], tight["hash"], tight["radix"]
display(Markdown(
    f"On this model of the machine, with 48 blocks, radix + cache-aware admission computes "
    f"{ra.computed_share:.0%} of the prompt tokens (hash: {hs.computed_share:.0%}, radix first "
    f"come first served: {rf.computed_share:.0%}), and its TTFT p90 is "
    f"{ra.ttft(0.9) * 1e3:.0f} ms against the hash cache's {hs.ttft(0.9) * 1e3:.0f} ms: "
    + ("lower." if ra.ttft(0.9) < hs.ttft(0.9) else
       "not lower. Admitting cached prefixes first shortens most waits, but the requests it "
       "passes wait longer, and the tail is theirs.")))

# %% [markdown]
# ## Play: cache size × policy
#
# Move the pool size and pick a policy. Every policy is served at that size, the chosen one
# highlighted. Where does the radix tree stop helping? When does cache-aware admission pay?

# %%
def play_prefix(num_blocks, policy):
    explore_prefix_cache(sessions, cost, num_blocks, policy)
    plt.show()


widgets.interactive(play_prefix,
                    num_blocks=widgets.SelectionSlider(options=[32, 40, 48, 64, 96, 256],
                                                       value=48, description="blocks"),
                    policy=widgets.Dropdown(options=[p for p in tight], value="radix"))

# %% [markdown]
# ## Long contexts: split-KV decode and attention sinks
#
# Splitting one sequence's K/V across the chip (flash-decoding) and keeping a few sink tokens
# beside a sliding window (StreamingLLM).

# %% [markdown]
# ## Predict, explain, stretch
#
# A match that ends inside a block gives the new prompt a copy of that block, not the block
# itself. Why?

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
# - A long context is a memory and bandwidth problem of its own: split one sequence's K/V across
#   the chip and merge the partials exactly, or keep a few sink tokens and a window.
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
