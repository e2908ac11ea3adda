# %% [markdown]
# # 04 · PagedAttention: KV memory in pages
#
# **Why.** With a KV cache (notebook 02) every sequence keeps K and V for all its tokens, and that
# memory, not compute, decides how many requests a server can run at once. Kwon et al. (SOSP 2023)
# draw the budget of a 13B-parameter model on a 40 GB A100: the weights take 26 GB, about 65% of
# the memory, and the KV cache of the requests in flight gets most of the rest. They measured
# that serving systems which reserve one contiguous region per request kept only **20.4%–38.2%**
# of that KV memory filled with token states: the rest was reserved for tokens not generated
# yet, over-provisioned for tokens that never come, or lost in holes between regions. Borrowing
# *paging* from operating systems (fixed-size blocks, a per-sequence block table, blocks
# allocated on demand) brought the waste **under 4%**. The larger batches that fit in the saved
# memory gave vLLM **2–4×** the throughput of FasterTransformer and Orca at the same latency.
#
# This notebook builds that memory manager and the attention that reads it: you write the block
# allocator, the copy-on-write that lets sequences share blocks, and the paged attention read
# that the serving engine then runs in every layer of SmolLM2. Then it measures the waste on a
# request trace, the blocks that sharing saves, and the block size's trade-off. The optional
# notebook 04b reads the fine print: the unfilled tail, the cap a reservation must guess, the
# preemptions that paging's larger batch brings, a labelled model of what the saved memory buys
# on an H100, and what the compiler makes of the paged kernel for one.

# %%
import os

import ipywidgets as widgets
import torch
from IPython.display import Markdown, display

import llmlab
from llmlab import exercises
from llmlab.cache import waste
from llmlab.cache.block_manager import BlockManager, NoFreeBlocksError
from llmlab.cache.paged import PagedKVCache
from llmlab.device import TRITON_MISSING, device_name, has_triton
from llmlab.profiling import compare, expect, fit_linear
from llmlab.viz import paged as pviz

QUICK = os.environ.get("LLMLAB_QUICK") == "1"
torch.manual_seed(0)
model = llmlab.load_model("smollm2-135m")
tok = llmlab.load_tokenizer("smollm2-135m")
cfg = model.config
DEVICE = device_name()
print(DEVICE)

# %%
# NBVAL_CHECK_OUTPUT
per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4      # K and V, float32
print(f"SmolLM2-135M: {cfg.num_layers} layers × {cfg.num_kv_heads} KV heads × {cfg.head_dim} dims "
      f"-> {per_token / 1024:.0f} KiB of K/V per token (float32)")
print(f"reserving 2048 tokens for a request that uses 300: {2048 * per_token / 2**20:.0f} MiB held, "
      f"{300 * per_token / 2**20:.0f} MiB used")

# %% [markdown]
# ## How: blocks, block tables, reference counts
#
# The pool is cut into `num_blocks` blocks of `block_size` token slots; per layer it is one tensor
# `[num_blocks, block_size, kv_heads, head_dim]`. A sequence's **block table** maps its *logical*
# blocks (its first `block_size` tokens, the next `block_size`, ...) to *physical* blocks anywhere
# in the pool, the way a page table maps virtual pages to physical frames. A new block is taken
# from the free list only when the sequence's last block is full, so a sequence never holds more
# than one partly filled block.
#
# Blocks carry **reference counts**, which make sharing safe:
# * **fork** (parallel sampling, beam search) gives a child the parent's table and counts one more
#   reference on each block; the first write into a shared, partly filled block **copies it
#   first** (copy-on-write), so neither sequence sees the other's new tokens.
# * **prefix caching** names every full block by a hash of its tokens chained with its parent
#   block's hash; a new prompt that starts with the same blocks reuses them (the tokens are
#   compared on a hit). The last prompt token is always recomputed, because its logits are needed.
#
# Running out of blocks raises `NoFreeBlocksError` before anything changes, so a scheduler can
# preempt a sequence instead (notebook 05).

# %%
# NBVAL_CHECK_OUTPUT
bm = BlockManager(num_blocks=8, block_size=4)
print("cached prefix tokens:", bm.allocate("A", list(range(10))))     # 10 tokens -> 3 blocks
print("A's table:", bm.block_table("A"), "| free blocks:", bm.num_free_blocks)
bm.fork("A", "B")                                                      # share all 3 blocks
print("after fork, refcounts:", bm.allocator.ref_counts[:4])
print("B appends -> (slot, copy-on-write):", bm.append_slot("B", 42))
print("B's table:", bm.block_table("B"), "| refcounts:", bm.allocator.ref_counts[:4])
try:
    bm.allocate("C", list(range(100, 120)))                            # needs 5 blocks
except NoFreeBlocksError as e:
    print("NoFreeBlocksError:", e)

# %% [markdown]
# The picture: physical blocks as a grid, coloured by owner, filled as far as their tokens go.
# Follow the block tables as requests arrive, grow, finish, hit the prefix cache and fork.

# %%
fig = pviz.plot_block_map_story()

# %% [markdown]
# ### Exercise 1 (compute): where does a token live?
#
# The attention read and the cache writer need, for token `position` of a sequence, its *slot*:
# its row in the pool flattened to `[num_blocks * block_size, kv_heads, head_dim]`. Work it out
# from the picture above: which logical block holds the position, which physical block that is,
# and how far into it the token sits: with the block table `[7, 2, 9]` and blocks of 4 tokens,
# which slot holds token 6 of the sequence?

# %%
answer = ...  # YOUR ANSWER: an integer
exercises.check("nb04.slot_of", answer)

# %% [markdown]
# Compare with llmlab's: `BlockManager.slot(seq_id, position)` computes it from the sequence's own
# table, and `PagedKVCache.prepare` turns every new token's slot into the `slot_mapping` that the
# K/V writes use (slot −1 marks a pad, which is skipped).
#
# ### Exercise 2 (build, warm-up): the block allocator
#
# Under the block tables sits the pool itself: which physical blocks are free, and how many block
# tables point at each (its **reference count**). `BlockManager` asks only this of it:
#
# | member | used when |
# |---|---|
# | `allocate() -> block` | a prompt is allocated, a sequence grows past a block, a copy-on-write needs a copy. The new block has count 1. With no free block it raises `NoFreeBlocksError(1, 0)`: the scheduler catches that one to preempt. |
# | `incref(block)` | fork: the child's table points at the parent's blocks |
# | `decref(block) -> int` | a sequence lets go of a block (it finished, was preempted, or copy-on-write moved it to a copy); returns the count left; at 0 the block is free again |
# | `num_free` | can a prompt or a new block be served? (`can_allocate`, `can_append`) |
# | `ref_counts[block]` | copy-on-write: a write into a partly filled block whose count is above 1 copies it first |
#
# Write `MyBlockAllocator(num_blocks, block_size)`; block ids are `0 .. num_blocks − 1`. The
# checker puts your class under llmlab's block tables (`BlockManager(..., allocator=...)`,
# prefix caching off), runs 10,000 random allocate / append / fork / free operations against a
# model of what every sequence has written, then serves SmolLM2 with
# `LLM(..., allocator=MyBlockAllocator, enable_prefix_caching=False)`, a fork and a preemption
# included, and compares the tokens with llmlab's.

# %%
from llmlab.cache.block_manager import NoFreeBlocksError


class MyBlockAllocator:
    """A pool of `num_blocks` physical KV blocks: a free list and a reference count each."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        # YOUR CODE HERE: self.ref_counts (a list, one count per block) and a free list
        raise NotImplementedError

    @property
    def num_free(self):
        # YOUR CODE HERE: how many blocks allocate() can still hand out
        raise NotImplementedError

    def allocate(self):
        # YOUR CODE HERE: take a free block, set its count to 1, return its id;
        # raise NoFreeBlocksError(1, 0) when none is free
        raise NotImplementedError

    def incref(self, block):
        # YOUR CODE HERE: one more block table points at `block` (a fork)
        raise NotImplementedError

    def decref(self, block):
        # YOUR CODE HERE: one table lets go of `block`; at 0 it is free again.
        # Return the count that is left.
        raise NotImplementedError


exercises.check("nb04.block_allocator", MyBlockAllocator, model=model, tokenizer=tok)

# %% [markdown]
# Compare with llmlab's: `llmlab.cache.block_manager.BlockAllocator` is this pool plus the prefix
# cache. A full block whose count drops to 0 keeps its content and stays findable by its hash
# (*cached*, counted as free); when the free list runs dry, `allocate` evicts the least recently
# used cached block. `llmlab.exercises.nb04.random_block_ops()` with no argument runs the same
# 10,000 operations on it, prefix hits and evictions included.
#
# ### Exercise 3 (compute): copy-on-write
#
# With `block_size=4`, a 10-token prompt is allocated and forked into two children; then each of
# the three sequences (parent first) appends one token. How many physical blocks are in use?
# Reason it out, then check (you may verify with `BlockManager.fork` / `append_slot`).

# %%
answer = ...  # YOUR ANSWER: an integer
exercises.check("nb04.cow_blocks", answer)

# %% [markdown]
# ### Exercise 4 (build): the next token's slot, with copy-on-write
#
# Every decode step the scheduler asks the block manager for one more slot per running sequence
# (`BlockManager.append_slot`), and the manager updates the sequence's block table. That update is
# yours: when the last block is full the sequence needs a new one, and when the last block is
# partly filled but **shared** with a forked sibling (its reference count is above 1) the write
# must not land in it. Copy-on-write gives the writer a block of its own and tells the caller which
# block's K/V to copy there before the new token is written (the cache does the copy:
# `PagedKVCache.copy_blocks`). The exercise above is this rule, counted by hand.
#
# The checker calls your function directly on small pools, then runs it under llmlab's block
# manager (`BlockManager(..., append_slot=...)`) through thousands of random allocate / append /
# fork / free operations, and finally serves SmolLM2 with `LLM(..., append_slot=append_slot)`:
# parallel sampling (n = 2, one fork) and a width-3 beam search (forks at every step). The tokens
# must be llmlab's.

# %%
def append_slot(block_table, num_tokens, allocator, block_size):
    """Reserve the slot of a sequence's next token.

    block_table  the sequence's physical block ids, in logical order: update it in place
    num_tokens   tokens the sequence holds so far, i.e. the new token's position
    allocator    the pool, with the interface of Exercise 2 (allocate, incref, decref,
                 num_free, ref_counts)
    block_size   token slots per block
    returns      (slot, cow): the new token's flat slot (as in Exercise 1), and cow = (src, dst)
                 when the K/V already in block src must first be copied into block dst, else None

    When a block is needed and none is free, raise NoFreeBlocksError(1, 0) and change nothing:
    the scheduler then preempts a sequence and retries.
    """
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb04.append_slot", append_slot, model=model, tokenizer=tok)

# %% [markdown]
# Compare with llmlab's: `llmlab.cache.block_manager.append_to_table` is the default that
# `BlockManager.append_slot` calls; the manager itself first checks `can_append` (is a block free
# if one is needed?) and records the token for prefix caching.
#
# ## Build: the paged attention read
#
# In the model, a `PagedKVCache` holds one pool per layer. Each attention layer calls
# `cache.attend(layer_idx, q, k, v, backend)`, which does two things:
#
# ```python
# cache.write(layer_idx, k, v, slot_mapping)     # the new K/V into their slots (−1 skipped)
# out = backend.with_kvcache(q, k_pool, v_pool, cache_seqlens, block_table)   # read through tables
# ```
#
# The second line is the paged attention read, the kernel that gives PagedAttention its name.
# A sequence's K/V are scattered over the pool, one block here, the next one elsewhere, and the
# last one only partly filled. Kwon et al.'s kernel does not copy them together first: it walks
# the sequence's block table, reads each block where it lies, and folds that block's scores into
# a running softmax, the online softmax of notebook 03 (FlashAttention), so that no step needs
# more than one block of K and V.
#
# ### Exercise 5 (build): decode attention through the block table
#
# Write it for decode, where each sequence brings one new query token. The signature is
# FlashAttention's `flash_attn_with_kvcache`, which the library's paged backends share. The
# checker first compares your function with llmlab's on ragged lengths over shuffled pools
# (SmolLM2's head layout: 9 query heads sharing 3 KV heads), then registers it as an attention
# backend (`llmlab.attention.register(..., with_kvcache=paged_attention)`) and serves three
# prompts with `LLM(model, tok, paged_attention=<your backend>)`: every decode step of every layer
# reads the pool through your function, and the greedy tokens must equal those of llmlab's `paged`
# backend. Wrapping llmlab's own paged attention or torch's fused attention is refused.

# %%
def paged_attention(q, k_cache, v_cache, cache_seqlens, block_table, *, softmax_scale=None,
                    causal=True):
    """Decode attention over a paged KV pool, one block of the table at a time.

    q              [batch, 1, heads, head_dim]   each sequence's newest token
    k_cache        [num_blocks, block_size, kv_heads, head_dim]   this layer's pool of keys
    v_cache        [num_blocks, block_size, kv_heads, head_dim]   and of values
    cache_seqlens  [batch] int32   tokens of sequence b in the pool, the newest included
    block_table    [batch, max_blocks] int32   logical block -> physical block; entries past a
                   sequence's own blocks are -1
    softmax_scale  None means 1 / sqrt(head_dim); a decode query sees its whole sequence,
                   so `causal` changes nothing here
    returns        [batch, 1, heads, head_dim], in q's dtype

    Query head h reads KV head h // (heads // kv_heads). Never build a sequence's whole K or V:
    each step reads one block, and only the slots the sequence has filled.
    """
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb04.paged_attention", paged_attention, model=model, tokenizer=tok)

# %% [markdown]
# ## Check: llmlab's paged backends, same tokens
#
# Compare with llmlab's. Three backends read the pool: `paged` (PyTorch: gather the sequence's
# K/V through its table, then the textbook formula), `paged_sdpa` (whole blocks copied, then
# PyTorch's fused attention: the engine's CPU default) and `paged_triton` (the kernel that loads
# each block where it lies, `llmlab.kernels.paged_attn`); `paged_attention_blocks` is that
# kernel's loop written in PyTorch, your Exercise 5. First the attention itself: random K/V for
# three sequences of ragged lengths scattered over a shuffled pool, SmolLM2's head layout, one
# decode query each.

# %%
# NBVAL_CHECK_OUTPUT
from llmlab.attention import naive_attention
from llmlab.attention.paged import (gather_kv, paged_attention_blocks, paged_attention_reference,
                                    paged_attention_triton)

g = torch.Generator().manual_seed(0)
lens, bs = [37, 5, 70], 16
table = torch.randperm(15, generator=g).view(3, 5).to(torch.int32)   # 5 blocks each
k_pool = torch.randn(15, bs, 3, 64, generator=g)
v_pool = torch.randn(15, bs, 3, 64, generator=g)
q = torch.randn(3, 1, 9, 64, generator=g)
seqlens = torch.tensor(lens, dtype=torch.int32)
ref = paged_attention_reference(q, k_pool, v_pool, seqlens, table)
err_dense = max((naive_attention(q[i:i + 1], gather_kv(k_pool, table[i:i + 1], n),
                                 gather_kv(v_pool, table[i:i + 1], n)) - ref[i:i + 1]).abs().max().item()
                for i, n in enumerate(lens))
err_blocks = (paged_attention_blocks(q, k_pool, v_pool, seqlens, table) - ref).abs().max().item()
print(f"paged reference vs dense naive: max |Δ| = {err_dense:.1e} (tolerance 1e-5)")
print(f"block-by-block loop vs paged reference: max |Δ| = {err_blocks:.1e} (tolerance 1e-5)")
if has_triton():
    err_triton = (paged_attention_triton(q, k_pool, v_pool, seqlens, table) - ref).abs().max().item()
    print(f"Triton kernel vs paged reference: max |Δ| = {err_triton:.1e} (tolerance 1e-5)")
else:
    print(TRITON_MISSING)

# %% [markdown]
# Then the whole model: greedy tokens with the paged cache against the contiguous cache of
# notebook 02, two prompts of different lengths in one batch. On a CPU the Triton kernel runs in
# the interpreter, far too slowly for 30 layers: it is checked on the tiny random model here and
# on SmolLM2 in the GPU tests.

# %%
# NBVAL_CHECK_OUTPUT
prompts = ["What is the capital of France?", "Name three colours of the rainbow, please."]
N = 8 if QUICK else 12
paged_out = llmlab.generate(model, tok, prompts, max_new_tokens=N, kv_cache="paged", block_size=16)
contiguous = llmlab.generate(model, tok, prompts, max_new_tokens=N, kv_cache="contiguous")
same = [p.token_ids == c.token_ids for p, c in zip(paged_out, contiguous)]
print("same greedy tokens as the contiguous cache:", same)
print(repr(paged_out[0].text))

if has_triton():
    tiny = llmlab.load_model("tiny-llama")
    tiny_prompts = [list(range(200, 219)), list(range(500, 505))]
    tri = llmlab.generate(tiny, tok, tiny_prompts, max_new_tokens=4, kv_cache="paged",
                          block_size=8, paged_attention="paged_triton")
    alone = llmlab.generate(tiny, tok, tiny_prompts, max_new_tokens=4)
    print("tiny-llama, Triton kernel, same tokens as no cache:",
          [a.token_ids == b.token_ids for a, b in zip(tri, alone)])
else:
    print(TRITON_MISSING)

# %% [markdown]
# ## Measure: where the memory goes
#
# `data/traces/sharegpt_like.jsonl` has 300 requests whose lengths were drawn to follow the
# ShareGPT statistics the vLLM paper reports (mean input 161, output 338 tokens;
# `data/make_trace.py`); the next cell prints what the drawn trace itself holds.
# `llmlab.cache.waste` runs them through a KV pool of 16,384 token slots, one token per request per
# step, all requests waiting at the start, under three policies:
#
# * **(a) `max_len`**: each request reserves prompt + an output cap (1024 tokens here)
#   contiguously, first-fit; it cannot know when generation will stop;
# * **(b) `batch_max`**: static batches; every member reserves the batch's longest request and the
#   batch holds its memory until its longest member finishes;
# * **(c) `paged`**: blocks of 16 allocated on demand; the newest request is preempted when
#   blocks run out.
#
# At every step each slot of the pool falls in one category:
#
# * **used**: holds a token state that is still needed;
# * **reservation**: reserved by a request that *will* write it later (a token not generated yet);
# * **internal** fragmentation: reserved but never to be written (the cap beyond the real output,
#   the tail of a last block, the seat of a finished member of a static batch);
# * **external** fragmentation: free, but only in holes too small for the next waiting request
#   (only contiguous reservation has holes);
# * **idle**: free and usable.
#
# **Waste** is (reservation + internal + external) / (everything held), averaged over the steps.

# %%
# NBVAL_CHECK_OUTPUT
reqs = waste.load_trace("sharegpt_like", limit=150 if QUICK else None)
BUDGET, CAP = 16384, 1024
mean_in = sum(r.prompt_tokens for r in reqs) / len(reqs)
mean_out = sum(r.total_tokens - r.prompt_tokens for r in reqs) / len(reqs)
print(f"{len(reqs)} requests: mean prompt {mean_in:.1f} tokens, mean output {mean_out:.1f} tokens, "
      f"longest output {max(r.total_tokens - r.prompt_tokens for r in reqs)}")

# %% [markdown]
# ### Exercise 6 (predict, then measure)
#
# Before running the next cell: policy (a) reserves prompt + 1024 tokens for every request, and
# the average request ends with the mean prompt and output printed above. What share of the
# memory (a) holds is waste? Commit a fraction (or a percentage); within 10 points of the
# measurement counts.

# %%
my_prediction = ...  # YOUR ANSWER: e.g. 0.5

# %%
results = [waste.simulate(reqs, "max_len", BUDGET, max_tokens=CAP),
           waste.simulate(reqs, "batch_max", BUDGET),
           waste.simulate(reqs, "paged", BUDGET, block_size=16)]
a, b, c = results
fig = pviz.plot_waste_bars(results, f"{len(reqs)} ShareGPT-like requests, pool of {BUDGET} tokens")
exercises.check("nb04.predict_waste", my_prediction, measured=a.waste)

# %%
# NBVAL_CHECK_OUTPUT
for r in results:
    f = r.fractions()
    print(f"{r.label:18s} waste {r.waste:5.1%}  (reservation {f['reservation']:5.1%}, internal "
          f"{f['internal']:5.1%}, external {f['external']:4.1%} of the pool)  "
          f"{r.mean_running:5.1f} sequences in flight  {r.preemptions} preemptions")

# %% [markdown]
# Paging leaves one kind of unfilled memory: the tail of each sequence's last block, at most
# `block_size − 1` slots per sequence, which is all of bar (c)'s waste. The larger batch it allows
# comes with the preemptions counted in the last column: notebook 04b follows them, with the tail,
# the cap that policy (a) must guess, and a model of what the saved memory buys on a GPU.
#
# **Sharing.** Parallel sampling (n = 4 answers to one prompt) forks after the prompt: the prompt's
# blocks are stored once. Beam search (width 4) forks at every step, and beams share long common
# histories. Counted on the block manager for Alpaca-like requests (short prompts) and ShareGPT-like
# ones (longer prompts). The vLLM paper reports savings of 6.1%–9.8% (parallel sampling) and
# 37.6%–55.2% (beam search) on Alpaca; our beam model picks parents at random, so treat its number
# as an illustration.

# %%
alpaca = waste.load_trace("alpaca_like", limit=60)
share = [waste.parallel_sampling_memory(alpaca, n=4), waste.beam_search_memory(alpaca, width=4)]
fig = pviz.plot_sharing(share)
labels = ["Alpaca-like", "Alpaca-like", "ShareGPT-like"]
for name, r in zip(labels, share + [waste.parallel_sampling_memory(reqs[:20], n=4)]):
    print(f"{name:13s} {r.mode:8s} ×{r.width}: {r.blocks_unshared:6.1f} -> {r.blocks_shared:6.1f} blocks "
          f"(saves {r.saving:.0%}, {r.cow_copies} copy-on-write copies)")

# %% [markdown]
# **Prefix caching.** Requests that share a system prompt share its full blocks. Four questions
# follow the same long system prompt. Without the prefix cache every request computes all of its
# prompt; with one cache kept across the four, the first request fills it and the others start
# from its cached blocks. We time the first token (the prefill plus one sampling step) as the CPU
# time of one thread: on a shared machine the wall clock mostly measures the other programs,
# while CPU time counts only this work. The median of 5 rounds with the two variants
# interleaved; each round starts from an empty cache, so request 1 never has a hit.

# %%
import time


def thread_cpu_ms(fn, repeats=5, warmup=1):
    """CPU milliseconds of fn() on this thread, `repeats` runs after `warmup` ones."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        runs.append((time.thread_time() - t) * 1e3)
    return runs


SYSTEM = ("You are the help desk of a city library. The library opens at nine and closes at six "
          "on weekdays, and at four on Saturdays; it is closed on Sundays. Members may borrow up "
          "to ten books for three weeks and renew them twice online. Tools, seeds and musical "
          "instruments can be borrowed too, for one week. Printing costs ten cents a page. "
          "Answer briefly and politely, and say when you do not know.")
questions = ["When do you close on Saturday?", "How many books can I borrow?",
             "Can I borrow a guitar?", "How much is printing?"]
ids = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                               add_generation_prompt=True, tokenize=True) for q in questions]
ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
ROUNDS = 3 if QUICK else 5
cold, warm = [[] for _ in ids], [[] for _ in ids]
threads = torch.get_num_threads()
torch.set_num_threads(1)              # all the work on this thread, so thread_time sees it
try:
    llmlab.generate(model, tok, [ids[0]], max_new_tokens=1, kv_cache="paged")    # warm-up
    for _ in range(ROUNDS):
        shared = PagedKVCache.for_model(model, num_blocks=64, block_size=16)   # empty each round
        cached = []
        for i, p in enumerate(ids):       # interleaved: both variants see the same conditions
            t = time.thread_time()
            llmlab.generate(model, tok, [p], max_new_tokens=1, kv_cache="paged")
            cold[i].append((time.thread_time() - t) * 1e3)
            t = time.thread_time()
            hit = llmlab.generate(model, tok, [p], max_new_tokens=1, kv_cache=shared)[0]
            warm[i].append((time.thread_time() - t) * 1e3)
            cached.append(hit.num_cached_tokens)
finally:
    torch.set_num_threads(threads)
hit_rate = shared.manager.stats.hit_rate
fig = pviz.plot_prefix_cache([[t / 1e3 for t in c] for c in cold], [[t / 1e3 for t in w] for w in warm],
                             hit_rate, cached, ylabel="first token: CPU ms (one thread)")
med = lambda xs: sorted(xs)[len(xs) // 2]
print(f"prompt tokens {[len(p) for p in ids]}, served from the cache {cached}, hit rate {hit_rate:.0%}")
for i in range(len(ids)):
    print(f"request {i + 1}: {med(cold[i]):5.0f} ms -> {med(warm[i]):5.0f} ms of CPU "
          f"({med(cold[i]) / med(warm[i]):.1f}×, {cached[i]} of {len(ids[i])} prompt tokens cached)")
fresh = [len(p) - n for p, n in zip(ids, cached)]
same = compare(cold[0], warm[0], "request 1 without the cache", "request 1 with it")
hits = [compare(cold[i], warm[i], f"request {i + 1} without the cache", "with it")
        for i in range(1, len(ids))]
ratios = [h.ratio for h in hits]
token_ratio = min(len(p) / f for p, f in zip(ids[1:], fresh[1:]))
expect(all(h.verdict == "faster" for h in hits),
       "every request that finds the system prompt cached reaching its first token faster")
below = ("well below" if max(ratios) < token_ratio / 2 else
         "below" if max(ratios) < token_ratio else "not below")
first = ("its two timings do not differ at this noise: the same work, timed twice"
         if not same.resolved else f"yet {same.sentence()}: the machine's noise, since both "
         "compute the same tokens")
display(Markdown(
    f"Request 1 finds nothing in the cache, and {first} ({same.interval()}). The others reuse "
    f"the system prompt's {min(cached[1:]) // 16} full blocks and compute only the "
    f"{min(fresh[1:])}–{max(fresh[1:])} tokens after them; " + "; ".join(
        f"request {i + 2}'s first token is {h.interval()} as fast ({h.verdict})"
        for i, h in enumerate(hits)) +
    f". That is {below} the ratio of the tokens computed (at least {token_ratio:.0f}× fewer): "
    "a forward pass reads every weight once (about 540 MB in float32) however few tokens it "
    "computes, and with a dozen tokens it sits in notebook 02's memory-bound corner, where the "
    "weight reads, not the tokens, set the time."))

# %% [markdown]
# ## Play: the block size
#
# Small blocks waste less memory (at most `block_size − 1` slots per sequence); large blocks mean
# fewer table entries and fewer, longer reads. The left panel is the waste simulation. The right
# one times one decode attention (batch 8, 1024 tokens each, SmolLM2's heads) that walks the
# block table one block per step as the `paged_triton` kernel does, in PyTorch
# (`paged_attention_blocks`, your Exercise 5); for comparison the cell also times `paged_sdpa`,
# which copies all of a sequence's blocks out with one `index_select` and then calls fused
# attention once. CPU time of one thread as above, median of 5 runs after a warm-up, whiskers
# min–max.

# %%
from llmlab.attention.paged import paged_attention_sdpa
from llmlab.bench.paged import paged_decode_inputs

from llmlab.kernels import report as R

sizes = R.WIDGET_TILES["paged"]["block_size"]    # 1, 2, 4, ..., 256: each has a kernel build
sweep = waste.block_size_sweep(reqs, BUDGET, block_sizes=sizes)
shape = dict(batch=4, context=256) if QUICK else dict(batch=8, context=1024)
threads = torch.get_num_threads()
torch.set_num_threads(1)              # all the work on this thread, so thread_time sees it
try:
    TIMED_ON = device_name().replace(" 1 threads", " 1 thread")
    walk, copy = {}, {}
    for s in (4, 8, 16, 32, 64, 128, 256):
        args = paged_decode_inputs(s, **shape)         # made once, outside the timing
        walk[s] = thread_cpu_ms(lambda: paged_attention_blocks(*args))
        copy[s] = thread_cpu_ms(lambda: paged_attention_sdpa(*args))
finally:
    torch.set_num_threads(threads)
cost_ms = {s: med(r) for s, r in walk.items()}
spread_ms = {s: (min(r), max(r)) for s, r in walk.items()}
sdpa_ms = {s: med(r) for s, r in copy.items()}
YLABEL = "CPU ms, block-by-block read"
fig = pviz.plot_block_size_tradeoff(16, sweep, cost_ms, TIMED_ON, spread_ms, YLABEL)
print("block size:        " + " ".join(f"{s:6d}" for s in cost_ms))
print("block by block ms: " + " ".join(f"{t:6.1f}" for t in cost_ms.values()))
print("paged_sdpa ms:     " + " ".join(f"{t:6.1f}" for t in sdpa_ms.values()))
steps = {s: shape["context"] // s for s in cost_ms}
per_step = fit_linear([steps[s] for s in cost_ms], list(cost_ms.values()))
copy_same = compare(copy[256], copy[4], "paged_sdpa at blocks of 256",
                    "paged_sdpa at blocks of 4")
expect(cost_ms[4] > 2 * cost_ms[32] > 2 * cost_ms[256],
       "the block-by-block walk getting more than 2× faster from blocks of 4 to 32 and again "
       "from 32 to 256")
display(Markdown(
    f"Walking the table costs {cost_ms[4]:.0f} ms at blocks of 4 and {cost_ms[256]:.1f} ms at "
    f"256. The keys and values read are the same bytes at every size; what changes is the "
    f"number of steps, {steps[4]} per sequence at blocks of 4 against {steps[256]} at 256. "
    f"A line through all {per_step.n} block sizes, time against steps, gives "
    f"{per_step.a:.1f} ms + {per_step.b * 1e3:.0f} µs per step (rms residual "
    f"{per_step.rms:.1f} ms): every step pays a fixed cost (here Python and one launch per "
    "operator; in a GPU kernel, a table lookup and a separate load of a small piece of memory). "
    f"Copying whole blocks first (`paged_sdpa`) pays that cost once per call: it takes "
    f"{min(sdpa_ms.values()):.1f}–{max(sdpa_ms.values()):.1f} ms across the block sizes "
    f"({copy_same.sentence()}), at the price of a copy of every sequence's K and V. Kwon et al. report the same trade-off on a GPU, between "
    "parallelism within a block and the waste of large blocks, and settle on 16 tokens per "
    "block by default; `python -m llmlab.bench paged --gpu` times the Triton kernel on a GPU."))

# %% [markdown]
# In the widget, the right panel is what the compiler makes of `paged_triton` at that block size
# for the GPU that `chip` names: compiled on this CPU, not run; notebook 04b reads these builds.

# %%
widgets.interactive(lambda block_size, chip: pviz.plot_block_size_tradeoff(
                        block_size, sweep, cost_ms, TIMED_ON, spread_ms, YLABEL, chip=chip),
                    block_size=widgets.SelectionSlider(options=list(sizes), value=16),
                    chip=["H100", "A100"])

# %% [markdown]
# ## Takeaways
#
# * Reserving each request's maximum length leaves most KV memory unused (bar (a)); paging with
#   16-token blocks leaves only the unfilled tail of each last block.
# * A block table plus reference counts gives sharing for free: forks and common prefixes share
#   blocks, and copy-on-write copies only the partly filled last block. Attention reads the
#   blocks where they lie, one block per step with an online softmax, so nothing is gathered.
# * The saved memory becomes a larger batch, which is where the throughput comes from; the block
#   size trades the tail's waste against the cost of each step of the walk. What the larger
#   batch costs in preemptions, and buys on a GPU, is notebook 04b.
#
# ## Further reading
#
# - Kwon, Li, Zhuang, Sheng, Zheng, Yu, Gonzalez, Zhang, Stoica. *Efficient Memory Management for Large Language Model Serving with PagedAttention.* SOSP 2023. [arXiv:2309.06180](https://arxiv.org/abs/2309.06180), [doi:10.1145/3600006.3613165](https://doi.org/10.1145/3600006.3613165) (Fig. 1, Fig. 2, the block-size ablation)
# - Yu, Jeong, Kim, Kim, Chun. *Orca: A Distributed Serving System for Transformer-Based Generative Models.* OSDI 2022. [USENIX](https://www.usenix.org/conference/osdi22/presentation/yu)
# - Dao, Fu, Ermon, Rudra, Ré. *FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness.* NeurIPS 2022. [arXiv:2205.14135](https://arxiv.org/abs/2205.14135) (the online softmax of Exercise 5)
# - Dao, Haziza, Massa, Sizov. *Flash-Decoding for long-context inference.* 2023. [pytorch.org blog](https://pytorch.org/blog/flash-decoding/) (decode attention split over the keys, combined with the same rescaling)
# - vLLM documentation: [docs.vllm.ai](https://docs.vllm.ai/)
