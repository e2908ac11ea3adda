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
ttfts = {name: [t.ttft_s for t in r.turns] for name, r in runs.items()}
vs_none = compare(ttfts["no cache"], ttfts["radix"], "no cache", "the radix tree")
vs_hash = compare(ttfts["hash"], ttfts["radix"], "the hash cache", "the radix tree")
display(Markdown(
    f"In this run the radix tree computed **{rdx.computed_share:.0%}** of the prompt tokens it "
    f"was sent and the hash cache {hsh.computed_share:.0%} (no cache: {none.computed_share:.0%}). "
    f"The radix tree's TTFT p90 was {rdx.ttft(0.9) * 1e3:.0f} ms against the hash cache's "
    f"{hsh.ttft(0.9) * 1e3:.0f} ms and no cache's {none.ttft(0.9) * 1e3:.0f} ms: "
    + ("the radix tree had the lowest p90." if rdx.ttft(0.9) <= min(hsh.ttft(0.9), none.ttft(0.9))
       else f"the radix tree did not have the lowest p90 here. It computed "
            f"{hsh.computed_prompt_tokens - rdx.computed_prompt_tokens} fewer prompt tokens than "
            f"the hash cache, about {(hsh.computed_prompt_tokens - rdx.computed_prompt_tokens) / len(rdx.turns):.0f} "
            f"per turn, and a p90 over {len(rdx.turns)} turns is one of its slowest turns.")
    + f" By the median TTFT of the {len(rdx.turns)} turns, {vs_none.sentence()}; against the "
      f"hash cache, {vs_hash.sentence()}."))

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
import numpy as np

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
tight = sweep_policies(sessions, cost, num_blocks=48, max_num_seqs=max_rows)
for name, r in tight.items():
    print(f"{name:20s} hit rate {r.hit_rate:4.0%}, computes {r.computed_share:4.0%} of "
          f"{r.prompt_tokens} prompt tokens, TTFT p50 {r.ttft(0.5) * 1e3:5.0f} ms, "
          f"p90 {r.ttft(0.9) * 1e3:5.0f} ms (model), preempted {r.num_preemptions}")
ra, hs, rf = tight["radix + cache-aware"], tight["hash"], tight["radix"]
display(Markdown(
    f"On this model of the machine, with 48 blocks and at most {max_rows} sequences at once, "
    f"radix + cache-aware admission computes "
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
    explore_prefix_cache(sessions, cost, num_blocks, policy, max_num_seqs=max_rows)
    plt.show()


widgets.interactive(play_prefix,
                    num_blocks=widgets.SelectionSlider(options=[32, 40, 48, 64, 96, 256],
                                                       value=48, description="blocks"),
                    policy=widgets.Dropdown(options=[p for p in tight], value="radix"))

# %% [markdown]
# ## Long contexts: split-KV decode and attention sinks
#
# **Why.** A KV cache grows by a fixed number of bytes per token, the same for every token,
# and a long context multiplies it. Per token and layer, with $n_h$ query heads of dimension
# $d_h$, $n_g$ KV heads and $b$ bytes per number (DeepSeek-AI, *DeepSeek-V2*, 2024,
# [arXiv:2405.04434](https://arxiv.org/abs/2405.04434), Table 1):
#
# | attention | bytes per token and layer | |
# |---|---|---|
# | multi-head (MHA) | $2\,n_h d_h b$ | every head keeps its own K and V |
# | grouped-query (GQA) | $2\,n_g d_h b$ | heads share K/V in groups (Ainslie et al., EMNLP 2023, [arXiv:2305.13245](https://arxiv.org/abs/2305.13245)) |
# | multi-head latent (MLA) | $(d_c + d_h^R)\, b$ | one compressed latent per token, K and V rebuilt from it |
#
# Llama-3-8B has 32 layers and 8 KV heads of 128 (its
# [config.json](https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json)).
# Before the calculator below prints it: how many GiB of bfloat16 K/V does **one** sequence of
# 128k tokens (131,072) need?

# %%
gib_128k = ...  # YOUR ANSWER: a number of GiB

# %%
print(exercises.check("nb13.kv_gib_128k", gib_128k))

# %% [markdown]
# `llmlab.profiling.kv_memory.kv_bytes` is that arithmetic for the three models and the three
# schemes, and for a sliding window that keeps `sinks + window` tokens whatever the context.

# %%
# NBVAL_CHECK_OUTPUT
import os

import torch

from llmlab.profiling.kv_memory import MODELS, kv_bytes

if os.environ.get("LLMLAB_THREADS"):      # e.g. 1 on a machine whose cores are busy
    torch.set_num_threads(int(os.environ["LLMLAB_THREADS"]))

print(f"{'model':13s} {'scheme':6s} {'KiB/token':>10s} {'GiB at 128k':>12s}")
for name in MODELS:
    for scheme in ("mha", "gqa", "mla"):
        if scheme == "mla" and not MODELS[name].latent_dim:
            continue
        if scheme == "gqa" and MODELS[name].native == "mla":
            continue
        r = kv_bytes(name, scheme, context=128 * 1024)
        mark = " (its own)" if scheme == MODELS[name].native else ""
        print(f"{r.model:13s} {scheme:6s} {r.per_token / 1024:10.1f} {r.total / 2**30:12.2f}{mark}")
w = kv_bytes("llama-3-8b", context=128 * 1024, window=1020, sinks=4)
print(f"Llama-3-8B, 4 sinks + 1020-token window: {w.cached_tokens} tokens kept, "
      f"{w.total / 2**30:.3f} GiB at 128k ({w.per_token / 1024:.1f} KiB per token of context)")

# %% [markdown]
# Two ways out, both for one long sequence, and this section builds both:
#
# - **Read the long cache faster.** Decoding reads every cached K/V once per token. The paged
#   kernel of notebook 04 gives each (sequence, KV head) *one* program that walks the whole
#   context alone: SmolLM2 at batch 1 decodes with 3 programs, on a GPU with 132 SMs.
#   *Flash-decoding* (Dao, Haziza, Massa, Sizov, [Flash-Decoding for long-context
#   inference](https://crfm.stanford.edu/2023/10/12/flashdecoding.html), 2023) also splits
#   the keys of each sequence across programs and merges their results exactly: up to 8×
#   faster generation of very long sequences in their measurements.
# - **Keep less.** A sliding window keeps the last $w$ tokens; StreamingLLM (Xiao, Tian,
#   Chen, Han, Lewis, *Efficient Streaming Language Models with Attention Sinks*, ICLR 2024,
#   [arXiv:2309.17453](https://arxiv.org/abs/2309.17453)) found that a window alone collapses
#   as soon as the first tokens leave it, and that keeping 4 of them ("attention sinks")
#   beside the window keeps perplexity stable over 4 million tokens.

# %% [markdown]
# ### How: partial outputs and their log-sum-exp
#
# For one query, softmax attention over keys $1..n$ with scores $x_j = q\cdot k_j / \sqrt{d}$
# is $\mathrm{out} = \sum_j e^{x_j} v_j \,/\, \sum_j e^{x_j}$. Split the keys into ranges
# $R_1 \dots R_S$. Program $s$ sees only its range and returns two things:
#
# $$o_s = \frac{\sum_{j \in R_s} e^{x_j} v_j}{\sum_{j \in R_s} e^{x_j}}, \qquad
#   \mathrm{lse}_s = \log \sum_{j \in R_s} e^{x_j}$$
#
# Each $o_s$ is a proper softmax average, but over its own range only, and $\mathrm{lse}_s$
# says how much softmax mass that range holds. A range a short sequence does not reach holds
# no key: its $o_s$ is zeros and its $\mathrm{lse}_s = -\infty$.
#
# `llmlab.attention.split_kv.split_kv_partials` computes the partials from the paged pool
# (in PyTorch; the Triton kernel writes the same ones). Four sequences of ragged lengths,
# SmolLM2's 9 query heads over 3 KV heads, 4 splits each:

# %%
import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

from llmlab.attention.paged import paged_attention_reference
from llmlab.attention.split_kv import split_bounds, split_kv_partials

g = torch.Generator().manual_seed(0)
lens, block, kv_heads, heads, head_dim = [37, 70, 5, 129], 16, 3, 9, 64
blocks = [-(-n // block) for n in lens]
k_pool = torch.randn(sum(blocks) + 2, block, kv_heads, head_dim, generator=g)
v_pool = torch.randn(sum(blocks) + 2, block, kv_heads, head_dim, generator=g)
order = torch.randperm(sum(blocks) + 2, generator=g).tolist()
table = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32)
for b, nb in enumerate(blocks):
    table[b, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
seqlens = torch.tensor(lens, dtype=torch.int32)
q = torch.randn(len(lens), 1, heads, head_dim, generator=g)
o_parts, lse_parts = split_kv_partials(q, k_pool, v_pool, seqlens, table, 4, tile=32)
print("o  ", tuple(o_parts.shape), "  [splits, batch, 1, heads, head_dim]")
print("lse", tuple(lse_parts.shape), "      [splits, batch, 1, heads]")
for b, n in enumerate(lens):
    print(f"sequence of {n:3d} keys: ranges {split_bounds(n, 4, 32)}, lse of head 0: "
          + ", ".join(f"{float(x):6.2f}" for x in lse_parts[:, b, 0, 0]))

# %% [markdown]
# ### Build: merge the partials
#
# Write `merge_splits(o, lse)`: `o [splits, ..., head_dim]` and `lse [splits, ...]` as
# above; return the attention output over *all* keys, `[..., head_dim]`. Every query sees at
# least one key, but a split may see none. Work out which weight each $o_s$ needs so that
# $\sum_s w_s o_s$ is the softmax over every key, and keep every `exp` finite (the scores of a
# real model reach the hundreds).
#
# The checker merges partials like those above (4 ragged sequences, 4 splits, some of them
# empty) against unsplit attention, then runs SmolLM2 through the paged engine with every
# layer's decode attention split in 4 and merged by your function: the greedy tokens must be
# the unsplit ones.

# %%
def merge_splits(o, lse):
    raise NotImplementedError


# %%
print(exercises.check("nb13.lse_merge", merge_splits))

# %% [markdown]
# ### Check: the Triton kernels
#
# llmlab's merge is `llmlab.attention.split_kv.merge_partials`. In Triton
# (`llmlab.kernels.paged_attn.paged_attention_split`), a first kernel runs on a grid of
# (query tiles, sequence × KV head, **split**), each program walking only its run of key
# tiles and writing a float32 partial and its lse; a second kernel merges them, one program
# per 16 rows. Without a GPU both run in Triton's interpreter. Against the unsplit kernel of
# notebook 04, at the ragged lengths above (none a multiple of the 16-token block or the
# 32-key tile):

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.attention.paged import paged_attention_triton
from llmlab.attention.split_kv import merge_partials
from llmlab.kernels.paged_attn import paged_attention_split

want = paged_attention_reference(q, k_pool, v_pool, seqlens, table)
merged, _ = merge_partials(o_parts, lse_parts)
kernel_device = "cuda" if torch.cuda.is_available() else "cpu"   # compiled there, else interpreted
on_kernel = [t.to(kernel_device) for t in (q, k_pool, v_pool, seqlens, table)]
unsplit = paged_attention_triton(*on_kernel).cpu()
split4, lse4, _, _ = paged_attention_split(*on_kernel, 4, return_partials=True)
split4, lse4 = split4.cpu(), lse4.cpu()
print(f"PyTorch merge vs unsplit reference: max |error| < 1e-5 (float32 rounding): "
      f"{float((merged - want).abs().max()) < 1e-5}")
print(f"Triton split (4) vs Triton unsplit: max |error| < 1e-5 (float32 rounding): "
      f"{float((split4 - unsplit).abs().max()) < 1e-5}")
print("the kernels' merged lse equals log Σ_s exp(lse_s) of the PyTorch partials:",
      bool(torch.allclose(lse4, torch.logsumexp(lse_parts, dim=0), atol=1e-4)))

# %% [markdown]
# ### Model: how many splits on an H100
#
# More splits mean more programs, but each split adds a partial to write and merge.
# `choose_num_splits` follows FlashAttention-2's rule (`num_splits_heuristic` in
# [`flash_api.cpp`](https://github.com/Dao-AILab/flash-attention/blob/main/csrc/flash_attn/flash_api.cpp)):
# no split when the unsplit grid fills 80% of the chip's program slots; otherwise the fewest
# splits whose *wave efficiency* (programs / slots, over its round-up) is within 85% of the
# best. The slots per SM come from the compile report: how many programs of the split kernel
# fit on one SM of an H100 by registers and shared memory (built ahead of time for sm_90,
# `python -m llmlab.kernels.report --kernel paged_split`).
#
# The plot is a **model** (`split_occupancy`): programs run in waves of `slots`, a wave lasts
# one split's walk over its keys, the merge costs a second launch plus the partials' bytes.
# It leaves out that a full chip is limited by HBM bandwidth, not by programs.

# %%
from llmlab.attention.split_kv import choose_num_splits, split_occupancy
from llmlab.kernels import report as R
from llmlab.viz.long_context import plot_split_occupancy

build = R.lookup("paged_split", "H100", "bf16", block_size=16, head_dim=64)
print(f"split kernel, sm_90 bfloat16, head_dim 64: {build.registers} registers/thread, "
      f"{build.spill_bytes} B spilled, {build.shared_bytes / 1024:.0f} KiB shared -> "
      f"{build.blocks_per_sm} programs per SM (limited by {build.occupancy_limiter})")
cases = {"SmolLM2, batch 1, 32k": (1, 3, 32768), "Llama-3-8B, batch 1, 32k": (1, 8, 32768),
         "Llama-3-8B, batch 16, 4k": (16, 8, 4096)}
plot_split_occupancy(cases, num_sms=132, blocks_per_sm=build.blocks_per_sm)
plt.show()

# %%
picked, waves = {}, {}
for label, (batch, kvh, ctx) in cases.items():
    s = choose_num_splits(batch * kvh, -(-ctx // 64), 132, build.blocks_per_sm)
    one, best = (split_occupancy(batch, kvh, ctx, n, 132, build.blocks_per_sm) for n in (1, s))
    picked[label] = (s, one.step_time / best.step_time)
    waves[label] = (one.waves, best.waves)
    print(f"{label:26s} {s:4d} splits: slots busy {one.sm_busy:5.1%} -> {best.sm_busy:5.1%}, "
          f"waves {one.waves} -> {best.waves}, modeled step {one.step_time / best.step_time:5.1f}x faster")


def extreme(pick):
    """Every case at the highest (or lowest) speed-up as printed: a tie names them all."""
    x = pick(round(v, 1) for _, v in picked.values())
    ks = [k for k, (_, v) in picked.items() if round(v, 1) == x]
    if len(ks) == 1:
        return ks[0]
    alike = len({(picked[k][0], waves[k]) for k in ks}) == 1
    return (" and ".join(ks) + f", tied at {x:.1f}×"
            + (f" (the same {picked[ks[0]][0]} splits and the same waves, split or not, so the "
               "model gives them equally long steps)" if alike else ""))


display(Markdown(
    "In this model, " + "; ".join(f"{k} takes {s} split{'s' * (s > 1)} "
                                  f"({x:.1f}× the unsplit step's speed)"
                                  for k, (s, x) in picked.items())
    + f". Splitting pays most for {extreme(max)}, and least for {extreme(min)}: what it fixes "
    "is a grid with fewer programs than the chip has slots."))

# %% [markdown]
# ### How: a window with attention sinks
#
# A rolling cache keeps the first $s$ tokens and the last $w$, and evicts everything between.
# Positions follow StreamingLLM's section 3.2: RoPE is applied at positions **within the
# cache**, not in the text. Keys are cached *before* RoPE; at each step the $c$ kept keys are
# rotated at $0 \dots c-1$ and the query at $c-1$. With $s = 4$, $w = 4$, decoding token 9
# of the text:
#
# ```
# text index     0  1  2  3  .  .  6  7  8  9      (4, 5 evicted)
# cache position 0  1  2  3        4  5  6  7      the query: 9 -> 7
# ```
#
# RoPE scores depend only on the difference of two positions, so the window's distances are
# the text's; what changes is the distance to the sinks, which never exceeds the cache's size.
# `llmlab.cache.sinks.SinkKVCache` does this for every layer of SmolLM2 (it asks the model to
# rotate at position 0, where RoPE is the identity, and rotates itself), and takes a chunk of
# tokens at a time, each with its own window, with the same result as one at a time.
#
# ### Measure: SmolLM2 past its window
#
# The text is the first 1,024 tokens of the workbook's own prose (`data/text/`), scored on the
# predictions after token `skip` (where every window of the sweep below has started to
# evict). `python -m llmlab.bench sinks` measured the full cache and every window × sinks
# setting of the widget below on it (committed); this run measures a window of 256 alone and
# with 4 sinks again, live:

# %%
import time

from llmlab.bench.sinks import load_sweep, long_text_ids
from llmlab.cache.sinks import streaming_nll

sweep = load_sweep()
committed = {(r["sinks"], r["window"]): r["ppl"] for r in sweep["rows"]}
smol = llmlab.load_model("smollm2-135m", attention="sdpa")
smol_tok = llmlab.load_tokenizer("smollm2-135m")
ids = long_text_ids(smol_tok, sweep["tokens"])
WINDOW = 256
live = []
for sinks in (0, 4):
    t0 = time.perf_counter()
    nll = streaming_nll(smol, ids, sinks, WINDOW, chunk=sweep["chunk"])
    ppl = float(torch.exp(nll[sweep["skip"]:].mean()))
    live.append({"sinks": sinks, "window": WINDOW, "ppl": ppl})
    print(f"{sinks} sinks + {WINDOW} recent tokens: perplexity {ppl:6.2f} "
          f"(committed sweep {committed[(sinks, WINDOW)]:.2f}; {time.perf_counter() - t0:.1f} s)")
full_ppl = committed[(0, None)]
alone_ppl, sinks_ppl = live[0]["ppl"], live[1]["ppl"]
print(f"full cache (every token), from the sweep: {full_ppl:.2f} "
      f"({sweep['meta']['device']}, {sweep['meta']['date']})")

# %%
display(Markdown(
    f"Over tokens {sweep['skip']}–{sweep['tokens'] - 1} of the text, the window of {WINDOW} "
    f"alone has {alone_ppl / full_ppl:.2f}× the full cache's perplexity ({alone_ppl:.1f} "
    f"against {full_ppl:.1f}); keeping 4 sinks beside it brings it to "
    f"{sinks_ppl / full_ppl:.2f}× ({sinks_ppl:.1f}), with a cache of {WINDOW + 4} tokens "
    f"instead of {sweep['tokens']}. Across the sweep, the window alone ranges from "
    + ", ".join(f"{committed[(0, w)] / full_ppl:.1f}× (window {w})" for w in
                sorted(w for s_, w in committed if s_ == 0 and w is not None))
    + " and 4 sinks from "
    + ", ".join(f"{committed[(4, w)] / full_ppl:.2f}×" for w in
                sorted(w for s_, w in committed if s_ == 4 and w is not None)) + "."))

# %% [markdown]
# Why did the window alone do so much worse, and why do 4 tokens that say nothing about the
# rest of the text repair it?

# %%
exercises.ask("nb13.explain_sinks")

# %%
sinks_answer = ...  # YOUR ANSWER: "a", "b", "c" or "d"

# %%
print(exercises.check("nb13.explain_sinks", sinks_answer, alone=alone_ppl / full_ppl,
                      with_sinks=sinks_ppl / full_ppl))

# %% [markdown]
# ### Play: window × sinks
#
# The widget reads the committed sweep (`python -m llmlab.bench sinks`, every window and sink
# count below on the same text; the rings are this run's measurements). Left: perplexity
# against the window per sink count; right: the loss along the text for the chosen setting
# and for its window alone, against the full cache. Where does the window alone depart from
# the full cache, and how many sinks does it take to come back?

# %%
import ipywidgets as widgets

from llmlab.viz.long_context import explore_sinks

windows = sorted({r["window"] for r in sweep["rows"] if r["window"] is not None})
sink_counts = sorted({r["sinks"] for r in sweep["rows"] if r["window"] is not None})


def play_sinks(window: int, sinks: int) -> None:
    row = explore_sinks(sweep, window, sinks, live)
    plt.show()
    print(f"window {window} + {sinks} sinks: perplexity {row['ppl']:.2f}, "
          f"{row['vs_full']:.2f}× the full cache's")


widgets.interactive(play_sinks, window=widgets.SelectionSlider(options=windows, value=WINDOW),
                    sinks=widgets.SelectionSlider(options=sink_counts, value=4))

# %% [markdown]
# ### Stretch: one decode query of the sinks cache
#
# Write `sinks_attention(q, k, v, sinks, window, rope)` for one new token: `q [batch, 1,
# heads, head_dim]`; `k`, `v [batch, n, kv_heads, head_dim]`, **every** token so far with the
# query's own last, none of them rotated. Keep the sinks and the window, rotate with
# `rope(x, positions)` (`x [batch, m, heads, head_dim]`, `positions [m]`) as StreamingLLM
# does, and return `[batch, 1, heads, head_dim]` (query head h reads KV head
# `h // (heads // kv_heads)`). The checker tries random cases, then decodes a SmolLM2 text
# token by token with your function in every layer against `SinkKVCache`'s losses.

# %%
def sinks_attention(q, k, v, sinks, window, rope):
    raise NotImplementedError


# %%
print(exercises.check("nb13.sinks_attention", sinks_attention))

# %% [markdown]
# ### Further reading (long contexts)
#
# - Dao, Haziza, Massa, Sizov, [Flash-Decoding for long-context
#   inference](https://crfm.stanford.edu/2023/10/12/flashdecoding.html) (2023), and
#   FlashAttention-2's `flash_attn_with_kvcache(..., num_splits=)`.
# - Xiao et al., [Efficient Streaming Language Models with Attention
#   Sinks](https://arxiv.org/abs/2309.17453), ICLR 2024.
# - DeepSeek-AI, [DeepSeek-V2](https://arxiv.org/abs/2405.04434) (2024), section 2.1:
#   multi-head latent attention.
# - Ainslie et al., [GQA](https://arxiv.org/abs/2305.13245), EMNLP 2023; Jiang et al.,
#   [Mistral 7B](https://arxiv.org/abs/2310.06825) (2023): a sliding window in a released model.

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
