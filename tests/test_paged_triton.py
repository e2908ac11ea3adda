"""The Triton paged-attention kernel against the PyTorch reference (interpreter on CPU;
realistic sizes on a GPU)."""
import pytest
import torch

import llmlab
from llmlab.attention.paged import paged_attention_reference, paged_attention_triton
from llmlab.generate import generate_paged

from .test_paged import make_paged


@pytest.mark.parametrize("block_size,heads,kv_heads,seq_q,causal", [
    (8, 4, 4, 1, True),      # multi-head, decode
    (16, 6, 2, 1, True),     # GQA group 3 (as SmolLM2), decode
    (32, 4, 1, 5, True),     # multi-query, prefill on a cached prefix
    (128, 8, 2, 3, False),   # one block larger than a key tile
])
def test_kernel_matches_reference(block_size, heads, kv_heads, seq_q, causal):
    lens = [7, 70, 1 + seq_q, 33]            # ragged, not multiples of the block size
    k_cache, v_cache, table, seqlens, _ = make_paged(lens, block_size, kv_heads, 16, seed=block_size)
    q = torch.randn(len(lens), seq_q, heads, 16, generator=torch.Generator().manual_seed(1))
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table, causal=causal)
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table, causal=causal)
    assert (out - ref).abs().max().item() < 1e-5


def test_kernel_left_pad_rows_and_empty_sequences():
    k_cache, v_cache, table, _, _ = make_paged([3, 20], 8, 2, 16)
    seqlens = torch.tensor([3, 0], dtype=torch.int32)
    q = torch.randn(2, 5, 4, 16)
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table)
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table)
    assert torch.all(out[0, :2] == 0) and torch.all(out[1] == 0)
    assert (out - ref).abs().max().item() < 1e-5


def test_kernel_refuses_head_dim_it_cannot_tile():
    k_cache, v_cache, table, seqlens, _ = make_paged([3], 8, 1, 12)
    with pytest.raises(ValueError, match="head_dim=12 must be a power of two"):
        paged_attention_triton(torch.randn(1, 1, 1, 12), k_cache, v_cache, seqlens, table)


def test_tiny_llama_greedy_tokens_with_the_kernel(tokenizer):
    model = llmlab.load_model("tiny-llama")
    prompts = [list(range(200, 213)), list(range(500, 504))]
    base = llmlab.generate(model, tokenizer, prompts, max_new_tokens=5)
    out = generate_paged(model, tokenizer, prompts, max_new_tokens=5, block_size=8,
                         backend="paged_triton")
    assert [g.token_ids for g in out] == [g.token_ids for g in base]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_kernel_on_gpu_realistic_sizes(dtype, block_size):
    lens = [1, 511, 2000, 4097, 130, 64, 1000, 3]
    k_cache, v_cache, table, seqlens, _ = make_paged(lens, block_size, 8, 128)
    q = torch.randn(len(lens), 1, 32, 128)
    args = [t.cuda() for t in (q, k_cache, v_cache)]
    args = [t.to(dtype) for t in args] + [seqlens.cuda(), table.cuda()]
    out = paged_attention_triton(*args)
    ref = paged_attention_reference(*args)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_smollm2_greedy_on_gpu(tokenizer):
    model = llmlab.load_model("smollm2-135m", device="cuda")
    prompts = ["What is the capital of France?", "Write a short poem about the sea."]
    base = llmlab.generate(model, tokenizer, prompts, max_new_tokens=32)
    out = generate_paged(model, tokenizer, prompts, max_new_tokens=32, backend="paged_triton")
    assert [g.token_ids for g in out] == [g.token_ids for g in base]
