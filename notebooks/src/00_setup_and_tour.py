# %% [markdown]
# # 00 · Setup and a tour of the workbook
#
# This workbook takes one real language model — **SmolLM2-135M-Instruct** (Allal et al., 2025), a
# Llama-architecture model with 30 layers and grouped-query attention — and, one notebook at a
# time, swaps a single component of its inference path for a faster one. Every notebook follows
# the same arc: **why** (the problem in numbers), **how** (the idea in a few lines), **build** (you
# write the core of it), **check** (same answer as the baseline), **measure** (time and memory,
# plotted), **play** (a widget over the knob), **predict, explain, stretch**, **takeaways**.
#
# This first notebook checks the machine, turns a sentence into the tokens a model reads, loads
# the model, runs one chat completion, shows how the next token is sampled, and draws the map of
# what comes next.

# %%
import os
import statistics

import torch

import llmlab
from llmlab import exercises
from llmlab.device import describe

for k, v in describe().items():
    print(f"{k:12s} {v}")
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
print(f"torch computes with {torch.get_num_threads()} threads; this process may use {cores} cores")

# %% [markdown]
# ## From text to tokens
#
# A language model never sees characters. A **tokenizer** cuts the text into pieces from a fixed
# vocabulary (SmolLM2's has 49,152, learned by byte-pair encoding: frequent words are one piece,
# rare ones several) and replaces each piece by its number. The model reads those numbers and, at
# every position, scores every entry of the vocabulary as the next one.

# %%
# NBVAL_CHECK_OUTPUT
tok = llmlab.load_tokenizer("smollm2-135m")
prompt = "What is the capital of France?"
ids = tok(prompt)["input_ids"]
print(f"{len(prompt)} characters -> {len(ids)} tokens:", ids)
print("pieces:", [tok.decode([i]) for i in ids])
print("a rarer word takes several:", [tok.decode([i]) for i in tok(" crimson")["input_ids"]])

# %% [markdown]
# A chat model was trained on conversations laid out by a **chat template**: special tokens mark
# who speaks, and a system turn comes first. The tokenizer carries the template; the prompt the
# model really reads is this:

# %%
# NBVAL_CHECK_OUTPUT
chat_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_dict=False)
print(tok.decode(chat_ids))
print(f"{len(chat_ids)} tokens")

# %% [markdown]
# ## The model
#
# `llmlab.load_model` reads the safetensors file that `make setup` wrote, and builds the decoder
# from llmlab's own layers (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU). HF
# transformers is used only as the correctness oracle, in the tests. Grouped-query attention
# (Ainslie et al., 2023): 9 query heads share 3 key/value heads, which makes the KV cache three
# times smaller than with one KV head per query head (notebook 02 measures what that buys).

# %%
# NBVAL_CHECK_OUTPUT
model = llmlab.load_model("smollm2-135m", attention="naive")
c = model.config
print(f"layers={c.num_layers} hidden={c.hidden_size} heads={c.num_heads} kv_heads={c.num_kv_heads} "
      f"head_dim={c.head_dim} mlp={c.intermediate_size} vocab={c.vocab_size} rope_theta={c.rope_theta:g}")
n_params = sum(p.numel() for p in model.parameters())
print(f"parameters: {n_params:,} ({n_params * 4 / 2**20:.0f} MiB in float32)")
print("attention backends:", llmlab.attention.available()[:2], "...")

# %% [markdown]
# The weights come from the model's release as a GGUF file (llama.cpp's format) in which every
# linear layer is stored in 4 bits (GGUF's Q4_1). `make setup` dequantized them once into float32,
# and this workbook computes in float32 with exactly those values. So llmlab is checked against HF
# transformers loading **these same** weights, not against the bfloat16 checkpoint on the Hugging
# Face hub, which differs by the 4-bit rounding and can pick other tokens. Notebook 08 opens the
# file's 4-bit blocks and measures what quantization costs and buys.
#
# ## One chat completion
#
# `llmlab.generate` wraps the prompt in the chat template and decodes greedily (`temperature=0`):
# one forward over the prompt, then one token per step, each fed back in. `kv_cache="contiguous"`
# keeps each token's keys and values instead of recomputing them at every step (notebook 01
# measures the loop without it, notebook 02 builds it).

# %%
# NBVAL_CHECK_OUTPUT
out = llmlab.generate(model, tok, prompt, max_new_tokens=24, kv_cache="contiguous")
print(out.text)
print("tokens:", out.token_ids)
print("finish:", out.finish_reason)

# %% [markdown]
# Two latencies describe a generation: the **time to first token** (TTFT: the prompt is read and the
# first token produced) and the **time per output token** after it (TPOT). Five runs of 8 tokens
# after a warm-up, median and range. Each decode step reads every weight once to produce one token,
# so TPOT is set by how fast the weights stream from memory, and by how many threads stream them:
# the cell divides the weight bytes by the TPOT (notebooks 01 and 02 take these numbers apart and
# measure the machine's bandwidth).

# %%
runs = [llmlab.generate(model, tok, prompt, max_new_tokens=8, ignore_eos=True,
                        kv_cache="contiguous").metrics for _ in range(6)][1:]   # run 0: warm-up
ttft = [m.ttft_s * 1e3 for m in runs]
tpot = [m.tpot_s * 1e3 for m in runs]
print(f"on {describe()['device']}, median of {len(runs)} runs (min–max):")
print(f"  TTFT {statistics.median(ttft):6.1f} ms ({min(ttft):.1f}–{max(ttft):.1f})")
print(f"  TPOT {statistics.median(tpot):6.1f} ms ({min(tpot):.1f}–{max(tpot):.1f})")
weight_mb = n_params * 4 / 1e6
print(f"one token reads the {weight_mb:.0f} MB of float32 weights: "
      f"{weight_mb / statistics.median(tpot):.1f} GB/s at the median TPOT, "
      f"with {torch.get_num_threads()} of {cores} cores")
if torch.get_num_threads() < cores:
    print(f"(torch was limited to {torch.get_num_threads()} threads here, e.g. by OMP_NUM_THREADS; "
          f"with all {cores} cores the weights stream faster and TPOT is lower)")
load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
if load > cores:
    print(f"(the machine's load average was {load:.1f} on {cores} cores: other processes were "
          "running, and each step's threads waited for them, so these times are far from this "
          "machine's own; run the cell again when it is quiet)")

# %% [markdown]
# ## Swapping one component
#
# Every optimization is chosen by name and has the same interface as its baseline. Here the
# attention backend goes from the textbook formula (`naive`, which builds the full score matrix)
# to PyTorch's fused `scaled_dot_product_attention` (`sdpa`); the answer must not change.

# %%
# NBVAL_CHECK_OUTPUT
ids = torch.tensor([chat_ids])
with torch.inference_mode():
    ref = model(ids)
    model.set_attention("sdpa")
    new = model(ids)
    model.set_attention("naive")
err = (new - ref).abs().max().item()
print(f"max |Δ logits| = {err:.1e}, below 1e-4: {err < 1e-4}")
print("same greedy next token at every position:", bool((new.argmax(-1) == ref.argmax(-1)).all()))

# %% [markdown]
# ## How the next token is chosen
#
# The model's last layer gives one **logit** per vocabulary entry (49,152 of them). Greedy decoding
# takes the largest; sampling draws from `softmax(logits / temperature)`, optionally cut to the `k`
# most likely tokens (top-k) or to the smallest set whose probabilities add up to `p` (top-p,
# Holtzman et al., 2020). The plots below continue a plain sentence (no chat template), whose
# likely next tokens are colours — some of them only the first piece of a word, because the
# tokenizer splits rare words.
#
# **Predict first.** Going from temperature 1.0 to 0.5, what happens to the probability of the
# most likely token? (a) it rises, (b) it falls, (c) it stays the same, (d) it becomes exactly 1.

# %%
my_prediction = ...   # YOUR ANSWER: "a", "b", "c" or "d"

# %%
from llmlab.exercises.nb00 import COLOUR_PROMPT
from llmlab.viz.tour import next_token_distribution

fig, top_1 = next_token_distribution(model, tok, COLOUR_PROMPT, 1.0, chat=False)
fig, top_half = next_token_distribution(model, tok, COLOUR_PROMPT, 0.5, chat=False)
print(f"{COLOUR_PROMPT!r} → top tokens at temperature 1.0:",
      ", ".join(f"{t} {p:.2f}" for t, p in top_1[:5]))

# %%
exercises.check("nb00.predict_temperature", my_prediction, p_at_1=top_1[0][1], p_at_half=top_half[0][1])

# %% [markdown]
# ## Play: temperature, top-k, top-p
#
# Move the sliders and watch the distribution the sampler draws from.

# %%
import ipywidgets as widgets


def show(temperature=1.0, top_k=50, top_p=1.0):
    next_token_distribution(model, tok, COLOUR_PROMPT, temperature, top_k=top_k, top_p=top_p,
                            chat=False)


widgets.interactive(show, temperature=(0.0, 2.0, 0.1), top_k=(1, 100, 1), top_p=(0.05, 1.0, 0.05))

# %% [markdown]
# ## Exercises
#
# **1.** Write `apply_temperature(logits, temperature)` returning the probabilities the sampler
# draws from: `logits` is `[batch, vocab]`, the result has the same shape and each row sums to 1.

# %%
def apply_temperature(logits, temperature):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb00.apply_temperature", apply_temperature)

# %% [markdown]
# **2. Explain.** llmlab's float32 weights are the dequantized 4-bit (Q4_1) values of the GGUF
# file, not the hub's bfloat16 checkpoint.

# %%
exercises.ask("nb00.explain_weights")

# %%
answer = ...   # "a", "b", "c" or "d"
exercises.check("nb00.explain_weights", answer)

# %% [markdown]
# **3. Stretch.** Write the top-p (nucleus) cut: `top_p_filter(logits, top_p)` takes `[batch, vocab]`
# logits and returns them with every token outside the nucleus set to `-inf`. The nucleus is the
# smallest set of most likely tokens whose probabilities add up to at least `top_p` (so the most
# likely token always stays). It is checked against the sampler llmlab uses.

# %%
def top_p_filter(logits, top_p):
    # YOUR CODE HERE
    raise NotImplementedError


exercises.check("nb00.top_p_filter", top_p_filter)

# %% [markdown]
# ## The map of the workbook
#
# Each notebook swaps one thing and says which notebooks to read first. Notebook 03b is
# optional: it takes notebook 03's loop to a GPU.
#
# | # | notebook | the one thing swapped | read first |
# |---|---|---|---|
# | 00 | setup and tour | — | — |
# | 01 | baseline: where time goes | nothing yet: profile the no-cache loop; you write naive attention | 00 |
# | 02 | KV cache and the roofline | recompute everything → cache K and V; prefill vs decode | 01 |
# | 03 | FlashAttention | naive attention → tiled online softmax, in PyTorch | 01 |
# | 03b | FlashAttention on a GPU (optional) | the tiled loop → a Triton kernel, with an H100 model | 03 |
# | 04 | PagedAttention | contiguous cache → blocks, block tables, copy-on-write, prefix cache | 02 |
# | 04b | PagedAttention's fine print (optional) | the unfilled tail, the cap, preemptions and their recompute, an H100 serving model, the paged kernel's sm_90 builds | 04 |
# | 05 | continuous batching | static padded batches → iteration-level scheduling | 04 |
# | 06 | mixture of experts | dense MLP → routed experts; dense / loop / grouped dispatch | 02 |
# | 07 | tensor parallelism | one process → Megatron-style sharding over torch.distributed | 02 |
# | 07b | tensor parallelism at scale (optional) | bfloat16 bytes per token, the degrees a 70B model allows, a labelled 8-GPU scaling model, sequence-parallel RMSNorm | 07 |
# | 08 | quantization | float32 weights → int8 / int4 / Q4_1 / fp8 weights; quality (KLD) and decode speed | 02 |
# | 09 | speculative decoding | one token per forward → k drafted tokens verified in one forward | 02 |
# | 10 | serving over HTTP | one Python process → an OpenAI-compatible server under Poisson load | 04, 05 |
# | 11 | overhead, fusion and compilation | eager operator calls → a static KV cache and a compiled decode step | 02, 08 |
# | 12 | structured outputs | free sampling → a grammar turned into a mask over the tokens | 00 |
# | 13 | caching across requests | one request's cache → a radix prefix cache over the pool, cache-aware admission | 04, 05 |
# | 14 | long context | one program per sequence → split-KV decode with a log-sum-exp merge; a full cache → a window with attention sinks | 03, 04 |
#
# ## Takeaways
#
# - Text becomes tokens, laid out by the chat template; the model is real (135M parameters, GQA 9/3), with the dequantized weights of its 4-bit GGUF release, and our decoder matches HF transformers on them.
# - Every optimization is a named, swappable component with the same interface as its baseline.
# - Every measured number is a median over several runs, labelled with the device and the threads it was measured with; a decode step's time is its bytes over the bandwidth it reaches.
#
# ## Further reading
#
# - Allal et al. *SmolLM2: When Smol Goes Big — Data-Centric Training of a Small Language Model.* 2025. [arXiv:2502.02737](https://arxiv.org/abs/2502.02737); weights: [HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)
# - Touvron et al. *LLaMA: Open and Efficient Foundation Language Models.* 2023. [arXiv:2302.13971](https://arxiv.org/abs/2302.13971)
# - Ainslie et al. *GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints.* EMNLP 2023. [arXiv:2305.13245](https://arxiv.org/abs/2305.13245)
# - Holtzman, Buys, Du, Forbes, Choi. *The Curious Case of Neural Text Degeneration* (top-p sampling). ICLR 2020. [arXiv:1904.09751](https://arxiv.org/abs/1904.09751)
# - GGUF file format and its quantization types: [ggml/docs/gguf.md](https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
# - All references of the workbook: [REFERENCES.md](REFERENCES.md)
