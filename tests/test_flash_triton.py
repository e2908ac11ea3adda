"""The Triton FlashAttention kernel (``flash_triton``) against ``naive``.

Without CUDA the kernel runs in the Triton interpreter, so these sizes are small; the
tests marked ``gpu`` run it compiled at realistic sizes.
"""
import pytest
import torch

import llmlab
import llmlab.attention as A
from llmlab.kernels.flash_attn import flash_attn_func, flash_attn_varlen_func

from .conftest import on_kernel_device, tolerance

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # interpreter on CPU, compiled on CUDA


def qkv(b, sq, sk, h, kvh, d, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g).to(device=device, dtype=dtype)
                 for s, n in ((sq, h), (sk, kvh), (sk, kvh)))


def rel_err(out, ref, rows=slice(None)):
    out, ref = out[:, rows].double(), ref[:, rows].double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("sq,sk,causal,h,kvh,blocks", [
    (37, 37, True, 4, 2, (16, 16)),     # ragged prefill, GQA, tail blocks masked
    (37, 37, False, 4, 4, (16, 32)),
    (50, 50, True, 6, 2, (32, 16)),     # groups of 3 interleaved in a tile
    (5, 70, True, 4, 2, (16, 16)),      # chunked prefill: 5 new queries over 70 keys
    (1, 45, True, 3, 1, (16, 16)),      # decode: one query sees the whole cache
    (20, 20, False, 2, 1, (16, 16)),
])
def test_matches_naive_float32(sq, sk, causal, h, kvh, blocks):
    q, k, v = qkv(2, sq, sk, h, kvh, 32, seed=sq + sk)
    out = flash_attn_func(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1])
    ref = A.naive_attention(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert rel_err(out, ref) <= 2e-6


def test_more_queries_than_keys_causal():
    # bottom-right alignment: the first sq - sk queries see no key and return zeros
    q, k, v = qkv(1, 24, 10, 2, 2, 16, seed=5)
    out = flash_attn_func(q, k, v, causal=True, block_m=16, block_n=16)
    ref = A.naive_attention(q, k, v, causal=True)
    assert rel_err(out, ref, slice(14, None)) <= 2e-6
    assert out[:, :14].abs().max().item() == 0.0


@pytest.mark.parametrize("d", [64, 128])
def test_head_dims_64_and_128_through_the_backend(d):
    q, k, v = qkv(1, 21, 21, 2, 1, d, seed=d)
    out = A.get("flash_triton").forward(q, k, v, causal=True)
    assert rel_err(out, A.naive_attention(q, k, v)) <= 2e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
def test_half_precision_inputs(dtype, tol):
    q, k, v = qkv(1, 33, 33, 4, 2, 32, seed=9)
    out = flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), block_m=16, block_n=16)
    assert out.dtype == dtype
    assert rel_err(out, A.naive_attention(q, k, v)) <= tol


def test_padding_mask_becomes_a_key_range():
    q, k, v = qkv(3, 30, 30, 4, 2, 32, seed=2)
    mask = torch.ones(3, 30, dtype=torch.bool, device=DEV)
    mask[0, :19] = False       # left padding that ends inside the second key block
    mask[2, :3] = False        # left padding, and a row that finished 5 tokens ago
    mask[2, 25:] = False
    out = A.get("flash_triton").forward(q, k, v, causal=True, key_padding_mask=mask)
    ref = A.naive_attention(q, k, v, causal=True, key_padding_mask=mask)
    assert rel_err(out[:1], ref[:1], slice(19, None)) <= 2e-6
    assert rel_err(out[1:], ref[1:], slice(3, None)) <= 2e-6
    assert out[0, :19].abs().max().item() == 0.0   # padding queries see nothing
    dec = A.get("flash_triton").forward(q[:, -1:], k, v, causal=False, key_padding_mask=mask)
    assert rel_err(dec, A.naive_attention(q[:, -1:], k, v, causal=False,
                                          key_padding_mask=mask)) <= 2e-6
    holes = mask.clone()
    holes[1, 4] = False
    with pytest.raises(ValueError, match=r"one run per row.*row 1"):
        A.get("flash_triton").forward(q, k, v, key_padding_mask=holes)


def test_varlen_ragged_batch():
    lq, lk = [5, 19, 1, 0, 12], [5, 40, 9, 3, 12]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lq), 4, 32, generator=g).to(DEV)
    k = torch.randn(sum(lk), 2, 32, generator=g).to(DEV)
    v = torch.randn(sum(lk), 2, 32, generator=g).to(DEV)
    cq = torch.tensor([0, 5, 24, 25, 25, 37], dtype=torch.int32, device=DEV)
    ck = torch.tensor([0, 5, 45, 54, 57, 69], dtype=torch.int32, device=DEV)
    out = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True,
                                 block_m=16, block_n=16)
    also = A.get("flash_triton").varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True)
    for i in range(5):
        if lq[i] == 0:
            continue
        ref = A.naive_attention(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                                v[None, ck[i]:ck[i + 1]])[0]
        for got in (out, also):
            assert rel_err(got[None, cq[i]:cq[i + 1]], ref[None]) <= 2e-6, i


def test_bad_inputs_are_refused_clearly():
    q, k, v = qkv(1, 8, 8, 2, 2, 24)
    with pytest.raises(ValueError, match=r"head_dim=24 is not supported; allowed: 16, 32, 64"):
        flash_attn_func(q, k, v)
    q, k, v = qkv(1, 8, 8, 2, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"float32, float16 or bfloat16.*float64"):
        flash_attn_func(q, k, v)
    q, k, v = qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(ValueError, match=r"block_m=48 must be a power of two"):
        flash_attn_func(q, k, v, block_m=48, block_n=16)


def test_negative_key_start_and_short_max_seqlen_q_are_refused():
    q, k, v = qkv(2, 8, 8, 2, 1, 16)
    start = torch.tensor([0, -1], dtype=torch.int32)
    end = torch.tensor([8, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"key_start=\[0, -1\] has a negative entry"):
        flash_attn_func(q, k, v, key_start=start, key_end=end)
    qv, kv, vv = q.reshape(16, 2, 16), k.reshape(16, 1, 16), v.reshape(16, 1, 16)
    cu = torch.tensor([0, 3, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q=12 is smaller than the longest query "
                                         r"sequence in cu_seqlens_q \(13\)"):
        flash_attn_varlen_func(qv, kv, vv, cu, cu, 12, 13)
    out = flash_attn_varlen_func(qv, kv, vv, cu, cu, 13, 13, block_m=16, block_n=16)
    ref = A.naive_attention(qv[None, 3:], kv[None, 3:], vv[None, 3:])[0]
    assert rel_err(out[None, 3:], ref[None]) <= 2e-6


@pytest.mark.parametrize("h,kvh", [(4, 4), (4, 2)])
def test_strided_queries_in_any_layout(h, kvh):
    # q as a transposed view [b, h, s, d] -> [b, s, h, d]: the packed rows the kernel reads
    # are a view for one query head per KV head, and a copy otherwise
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, h, 19, 32, generator=g).to(DEV).transpose(1, 2)
    k = torch.randn(2, 19, kvh, 32, generator=g).to(DEV)
    v = torch.randn(2, 19, kvh, 32, generator=g).to(DEV)
    assert not q.is_contiguous()
    out = flash_attn_func(q, k, v, causal=True, block_m=16, block_n=16)
    assert out.is_contiguous() and out.shape == q.shape
    assert rel_err(out, A.naive_attention(q, k, v, causal=True)) <= 2e-6


def test_float64_through_the_backend_runs_in_float32():
    q, k, v = qkv(1, 17, 17, 2, 1, 16, dtype=torch.float64, seed=8)
    out = A.get("flash_triton").forward(q, k, v)
    assert out.dtype == torch.float64
    assert rel_err(out, A.naive_attention(q, k, v)) <= 2e-6


@pytest.mark.slow
def test_model_with_flash_triton_gives_the_same_greedy_tokens(smollm2, tokenizer):
    prompt = "The capital of France is"
    model = on_kernel_device(smollm2)
    try:
        ref = llmlab.generate(model.set_attention("naive"), tokenizer, prompt,
                              max_new_tokens=3, chat=False)
        got = llmlab.generate(model.set_attention("flash_triton"), tokenizer, prompt,
                              max_new_tokens=3, chat=False)
    finally:
        model.set_attention("naive")
    assert got.token_ids == ref.token_ids


# -- compiled on a GPU, at realistic sizes ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_matches_sdpa(d, dtype, causal):
    q, k, v = qkv(2, 2047, 2047, 8, 8, d, dtype=dtype, device="cuda", seed=d)
    out = flash_attn_func(q, k, v, causal=causal)
    ref = A.sdpa_attention(q.float(), k.float(), v.float(), causal=causal)
    assert rel_err(out, ref) <= tolerance(dtype)


@pytest.mark.gpu
def test_gpu_gqa_decode_chunk_and_padding():
    q, k, v = qkv(3, 300, 4099, 12, 4, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    mask = torch.ones(3, 4099, dtype=torch.bool, device="cuda")
    mask[1, :1000] = False
    out = A.get("flash_triton").forward(q, k, v, causal=True, key_padding_mask=mask)
    ref = A.naive_attention(q.float(), k.float(), v.float(), causal=True, key_padding_mask=mask)
    assert rel_err(out, ref) <= tolerance(torch.bfloat16)
    one = A.get("flash_triton").forward(q[:, -1:], k, v, causal=True)
    ref1 = A.naive_attention(q[:, -1:].float(), k.float(), v.float(), causal=True)
    assert rel_err(one, ref1) <= tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_float32_and_varlen():
    lens = [1000, 3, 2500, 77]
    total = sum(lens)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, 8, 64, generator=g).cuda() for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for i in range(len(lens)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        ref = A.naive_attention(q[None, s], k[None, s], v[None, s])[0]
        assert rel_err(out[None, s], ref[None]) <= 2e-6


@pytest.mark.gpu
def test_gpu_model_greedy_tokens(tokenizer):
    # float32, so that naive and the kernel may differ only in summation order
    model = llmlab.load_model("smollm2-135m", device="cuda", dtype=torch.float32)
    try:
        ref = llmlab.generate(model.set_attention("naive"), tokenizer, "The capital of France is",
                              max_new_tokens=16, chat=False)
        got = llmlab.generate(model.set_attention("flash_triton"), tokenizer,
                              "The capital of France is", max_new_tokens=16, chat=False)
    finally:
        model.set_attention("naive")
    assert got.token_ids == ref.token_ids


@pytest.mark.gpu
def test_gpu_varlen_keys_past_2_to_the_31_elements():
    # packed K/V of 2^21 + 96 tokens × 8 heads × 128 (bfloat16, 4.3 GB each): the second
    # sequence's keys start past what int32 offsets can address
    kvh, d, first = 8, 128, 2 ** 21 + 32
    k = torch.empty(first + 64, kvh, d, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    g = torch.Generator(device="cuda").manual_seed(0)
    k[first:] = torch.randn(64, kvh, d, device="cuda", generator=g).bfloat16()
    v[first:] = torch.randn(64, kvh, d, device="cuda", generator=g).bfloat16()
    q = torch.randn(64, 2 * kvh, d, device="cuda", generator=g).bfloat16()
    cu_q = torch.tensor([0, 0, 64], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, first, first + 64], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, first, causal=True)
    ref = A.naive_attention(q[None].float(), k[None, first:].float(), v[None, first:].float(),
                            causal=True)[0]
    assert rel_err(out[None], ref[None]) <= tolerance(torch.bfloat16)
