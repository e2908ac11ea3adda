"""The Triton paged-attention kernel against the PyTorch reference (interpreter on CPU,
compiled where there is CUDA; realistic sizes on a GPU)."""
import pytest
import torch

import llmlab
from llmlab.attention.paged import paged_attention_reference, paged_attention_triton
from llmlab.generate import generate_paged

from .conftest import KERNEL_DEVICE, rel_err, tolerance
from .test_paged import make_paged


def on_kernel(*tensors):
    return [t.to(KERNEL_DEVICE) for t in tensors]


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
    q, k_cache, v_cache, table, seqlens = on_kernel(q, k_cache, v_cache, table, seqlens)
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table, causal=causal)
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table, causal=causal)
    assert (out - ref).abs().max().item() < 1e-5


def test_kernel_left_pad_rows_and_empty_sequences():
    k_cache, v_cache, table, _, _ = make_paged([3, 20], 8, 2, 16)
    seqlens = torch.tensor([3, 0], dtype=torch.int32)
    q = torch.randn(2, 5, 4, 16)
    q, k_cache, v_cache, table, seqlens = on_kernel(q, k_cache, v_cache, table, seqlens)
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table)
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table)
    assert torch.all(out[0, :2] == 0) and torch.all(out[1] == 0)
    assert (out - ref).abs().max().item() < 1e-5


def test_kernel_refuses_head_dim_it_cannot_tile():
    k_cache, v_cache, table, seqlens, _ = make_paged([3], 8, 1, 12)
    with pytest.raises(ValueError, match="head_dim=12 must be a power of two"):
        paged_attention_triton(torch.randn(1, 1, 1, 12), k_cache, v_cache, seqlens, table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_in_half_precision(dtype):
    # bfloat16 tiles are upcast before tl.dot in the interpreter (it would multiply their
    # raw bit patterns); compiled, they run on tensor cores. Against float32 attention on
    # the same rounded inputs, only the kernel's rounding of p and the output is left.
    lens = [7, 70, 4, 33]
    k_cache, v_cache, table, seqlens, _ = make_paged(lens, 16, 2, 32, seed=3)
    q = torch.randn(len(lens), 2, 6, 32, generator=torch.Generator().manual_seed(2))
    q, k_cache, v_cache = (t.to(KERNEL_DEVICE, dtype) for t in (q, k_cache, v_cache))
    table, seqlens = on_kernel(table, seqlens)
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), seqlens, table)
    assert out.dtype == dtype
    assert rel_err(out, ref) <= tolerance(dtype)


def test_kernel_wrapper_refuses_what_the_compiled_kernel_cannot_do():
    from llmlab.kernels.paged_attn import paged_attention

    k_cache, v_cache, table, seqlens, _ = make_paged([5, 9], 8, 1, 16)
    q = torch.randn(2, 1, 2, 16)
    q, k_cache, v_cache, table, seqlens = on_kernel(q, k_cache, v_cache, table, seqlens)
    with pytest.raises(ValueError, match=r"share one dtype.*torch.float32, torch.bfloat16"):
        paged_attention(q, k_cache.bfloat16(), v_cache, seqlens, table)
    with pytest.raises(ValueError, match=r"block_n=48 must be a power of two >= 16"):
        paged_attention(q, k_cache, v_cache, seqlens, table, block_n=48)
    with pytest.raises(ValueError, match=r"block_m=8 must be a power of two >= 16"):
        paged_attention(q, k_cache, v_cache, seqlens, table, block_m=8)
    odd = torch.zeros(4, 12, 1, 16, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"KV block_size=12 must be a power of two"):
        paged_attention(q, odd, odd, seqlens, table)


def test_tiny_llama_greedy_tokens_with_the_kernel(tokenizer):
    model = llmlab.load_model("tiny-llama", device=KERNEL_DEVICE, dtype=torch.float32)
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
    q, k_cache, v_cache = (t.to("cuda", dtype) for t in (q, k_cache, v_cache))
    seqlens, table = seqlens.cuda(), table.cuda()
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table)
    # the reference in float32 from the same rounded inputs: what is left is the kernel's
    # rounding of probabilities and output to the dtype
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), seqlens, table)
    assert out.dtype == dtype
    assert rel_err(out, ref) <= tolerance(dtype)


@pytest.mark.gpu
def test_smollm2_greedy_on_gpu(tokenizer):
    # float32, so that the two attention paths may differ only in summation order
    model = llmlab.load_model("smollm2-135m", device="cuda", dtype=torch.float32)
    prompts = ["What is the capital of France?", "Write a short poem about the sea."]
    base = llmlab.generate(model, tokenizer, prompts, max_new_tokens=32)
    out = generate_paged(model, tokenizer, prompts, max_new_tokens=32, backend="paged_triton")
    assert [g.token_ids for g in out] == [g.token_ids for g in base]


@pytest.mark.gpu
def test_kernel_reads_a_pool_larger_than_2_to_the_31_elements():
    # bfloat16 pool of 2^31 + 2^21 elements (4.3 GB): the last blocks sit past what int32
    # offsets can address, so the kernel must compute them in int64
    block_size, kv_heads, d = 16, 8, 128
    per_block = block_size * kv_heads * d
    num_blocks = (2 ** 31 + 2 ** 21) // per_block
    k_cache = torch.empty(num_blocks, block_size, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    lens = [40, 40]
    last = torch.arange(num_blocks - 3, num_blocks, device="cuda", dtype=torch.int32)
    table = torch.stack([last, torch.tensor([0, 1, 2], device="cuda", dtype=torch.int32)])
    g = torch.Generator(device="cuda").manual_seed(0)
    for blocks in table:
        k_cache[blocks.long()] = torch.randn(3, block_size, kv_heads, d, device="cuda",
                                             generator=g).bfloat16()
        v_cache[blocks.long()] = torch.randn(3, block_size, kv_heads, d, device="cuda",
                                             generator=g).bfloat16()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 32, d, device="cuda", generator=g).bfloat16()
    out = paged_attention_triton(q, k_cache, v_cache, seqlens, table)
    # the reference on a copy of just the blocks used, renumbered from 0
    small_k = torch.cat([k_cache[table[0].long()], k_cache[table[1].long()]])
    small_v = torch.cat([v_cache[table[0].long()], v_cache[table[1].long()]])
    small_table = torch.arange(6, device="cuda", dtype=torch.int32).view(2, 3)
    ref = paged_attention_reference(q.float(), small_k.float(), small_v.float(), seqlens,
                                    small_table)
    assert rel_err(out, ref) <= tolerance(torch.bfloat16)
