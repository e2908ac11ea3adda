"""Split-KV decode: partials with their log-sum-exp and the exact merge, in PyTorch and in the
Triton kernels (interpreter on CPU), against unsplit attention at ragged lengths."""
import functools

import pytest
import torch

from llmlab import attention as A
from llmlab.attention.paged import paged_attention_reference, paged_attention_triton
from llmlab.attention.split_kv import (choose_num_splits, merge_partials,
                                       paged_attention_split_reference, split_bounds,
                                       split_kv_partials, split_occupancy)

from .conftest import KERNEL_DEVICE, rel_err, tolerance
from .test_paged import make_paged

LENS = [7, 70, 1, 33, 2]          # ragged: none a multiple of the block size or the key tile


def _case(seq_q, heads=6, kv_heads=2, head_dim=16, block_size=16, seed=0):
    k_cache, v_cache, table, seqlens, _ = make_paged(LENS, block_size, kv_heads, head_dim, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(LENS), seq_q, heads, head_dim, generator=g)
    return q, k_cache, v_cache, table, seqlens


def test_split_bounds_cover_each_key_once():
    for length in (0, 1, 7, 64, 65, 200):
        for splits in (1, 2, 3, 7):
            for tile in (1, 16):
                b = split_bounds(length, splits, tile)
                assert len(b) == splits and b[0][0] == 0 and b[-1][1] == length
                assert all(lo <= hi and hi == nxt for (lo, hi), (nxt, _) in zip(b, b[1:]))
                assert all(lo % tile == 0 or lo == length for lo, _ in b)
    assert split_bounds(70, 3, 32) == [(0, 32), (32, 64), (64, 70)]
    assert split_bounds(33, 4, 32) == [(0, 32), (32, 33), (33, 33), (33, 33)]
    with pytest.raises(ValueError, match=r"num_splits=0 must be an int >= 1"):
        split_bounds(10, 0)


@pytest.mark.parametrize("seq_q,causal", [(1, True), (3, True), (2, False)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_merged_partials_equal_unsplit_attention(seq_q, causal, num_splits):
    q, k_cache, v_cache, table, seqlens = _case(seq_q)
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table, causal=causal)
    o, lse = split_kv_partials(q, k_cache, v_cache, seqlens, table, num_splits, causal=causal)
    assert o.shape == (num_splits, *q.shape) and lse.shape == (num_splits, *q.shape[:3])
    out, total = merge_partials(o, lse)
    assert (out - ref).abs().max().item() < 1e-6        # float32 rounding
    # the merged lse is the unsplit one: log Σ exp(scores) over every visible key
    o1, lse1 = split_kv_partials(q, k_cache, v_cache, seqlens, table, 1, causal=causal)
    assert torch.allclose(total, lse1[0], atol=1e-5)
    # a split with no key says so (-inf) and weighs nothing: row 2 has one key
    if num_splits > 1:
        assert torch.isinf(lse[1:, 2]).all() and (o[1:, 2] == 0).all()


def test_wrong_merges_are_wrong():
    # splits of unequal mass: averaging the partials, or weighting them by their max score,
    # misses the unsplit output by far more than rounding (so the parity test can fail)
    q, k_cache, v_cache, table, seqlens = _case(1, seed=4)
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table)
    o, lse = split_kv_partials(q, k_cache, v_cache, seqlens, table, 3)
    seen = torch.isfinite(lse)
    average = (o * seen[..., None]).sum(0) / seen.sum(0)[..., None]
    assert (average - ref).abs().max().item() > 1e-2
    unscaled = o.sum(0)
    assert (unscaled - ref).abs().max().item() > 1e-2


def test_reference_backend_in_the_registry():
    assert {"paged_split", "paged_triton_split"} <= set(A.paged_backends())
    assert A.get("paged_split").with_kvcache is paged_attention_split_reference
    q, k_cache, v_cache, table, seqlens = _case(1)
    out = A.get("paged_split").with_kvcache(q, k_cache, v_cache, seqlens, table)
    ref = paged_attention_reference(q, k_cache, v_cache, seqlens, table)
    assert (out - ref).abs().max().item() < 1e-6


@pytest.mark.parametrize("seq_q,block_size,heads,kv_heads", [
    (1, 16, 6, 2),       # decode, GQA group 3 (as SmolLM2)
    pytest.param(4, 8, 4, 1, marks=pytest.mark.slow),   # prefill rows on a cached prefix, MQA
])
def test_triton_split_matches_unsplit_kernel(seq_q, block_size, heads, kv_heads):
    from llmlab.kernels.paged_attn import paged_attention_split

    q, k_cache, v_cache, table, seqlens = (t.to(KERNEL_DEVICE) for t in _case(
        seq_q, heads, kv_heads, block_size=block_size, seed=block_size))
    unsplit = paged_attention_triton(q, k_cache, v_cache, seqlens, table)
    for num_splits in (1, 3):
        out, lse, o_part, lse_part = paged_attention_split(
            q, k_cache, v_cache, seqlens, table, num_splits, return_partials=True)
        assert (out - unsplit).abs().max().item() < 1e-5
        # the same partials as the PyTorch reference with the kernel's key tile
        o, l_ref = split_kv_partials(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqlens.cpu(),
                                     table.cpu(), num_splits, tile=32)
        assert (o_part.cpu() - o).abs().max().item() < 1e-5
        assert torch.equal(torch.isinf(lse_part.cpu()), torch.isinf(l_ref))
        finite = torch.isfinite(l_ref)
        assert (lse_part.cpu()[finite] - l_ref[finite]).abs().max().item() < 1e-5


@pytest.mark.slow   # the interpreter: ~2 s
def test_triton_split_in_bfloat16():
    from llmlab.kernels.paged_attn import paged_attention_split

    q, k_cache, v_cache, table, seqlens = _case(1, head_dim=32, seed=3)
    q, k_cache, v_cache = (t.to(KERNEL_DEVICE, torch.bfloat16) for t in (q, k_cache, v_cache))
    table, seqlens = table.to(KERNEL_DEVICE), seqlens.to(KERNEL_DEVICE)
    out = paged_attention_split(q, k_cache, v_cache, seqlens, table, 4)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), seqlens, table)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= tolerance(torch.bfloat16)


def test_triton_split_refuses_bad_splits():
    from llmlab.kernels.paged_attn import paged_attention_split

    q, k_cache, v_cache, table, seqlens = (t.to(KERNEL_DEVICE) for t in _case(1))
    with pytest.raises(ValueError, match=r"num_splits=0 must be an int >= 1"):
        paged_attention_split(q, k_cache, v_cache, seqlens, table, 0)


def test_choose_num_splits_fills_the_chip():
    # FlashAttention-2's example: 48 programs on 108 SMs -> 2 splits (efficiency 0.89)
    assert choose_num_splits(48, 64, 108) == 2
    # SmolLM2 at batch 1 on an H100: 3 programs on 132 SMs. 64 key tiles: only counts that
    # change the tiles per split are eligible; 32 splits of 2 tiles fill 0.73 of a wave, the
    # best there is (64 splits of 1 fill 1.45 waves: 0.73 too). 2048 tiles: 38 (0.86 of a wave)
    assert choose_num_splits(3, 64, 132) == 32
    assert choose_num_splits(3, 2048, 132) == 38
    # a full chip is not split; a short context cannot be split past its key tiles
    assert choose_num_splits(256, 64, 132) == 1
    assert choose_num_splits(3, 4, 132) <= 4
    with pytest.raises(ValueError, match=r"num_sms=0 must be an int >= 1"):
        choose_num_splits(3, 4, 0)


def test_occupancy_model_rises_with_splits_then_pays_the_merge():
    one = split_occupancy(1, 8, 32768, 1)
    best = split_occupancy(1, 8, 32768, choose_num_splits(8, 512, 132))
    assert one.sm_busy < 0.1 and best.sm_busy > 0.8
    assert best.step_time < one.step_time / 5
    huge = split_occupancy(1, 8, 32768, 512)             # more splits than the chip needs
    assert huge.waves > 1 and huge.step_time > best.step_time


@pytest.mark.slow   # the engine with an interpreted kernel in every layer: ~13 s
def test_engine_greedy_tokens_with_forced_splits(tiny, tiny_tok):
    # the split backend in every layer of the serving engine's decode (3 splits forced,
    # where the interpreter's default would be 1): the same greedy tokens as unsplit
    from llmlab.attention.split_kv import paged_attention_split_triton
    from llmlab.engine import LLM, SamplingParams

    A.register("test_split3", A.get("paged_triton_split").forward,
               with_kvcache=functools.partial(paged_attention_split_triton, num_splits=3))
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = ["hello there", "a much longer prompt with more words in it"]
        want = [o.outputs[0].token_ids for o in
                LLM(tiny, tokenizer=tiny_tok, paged_attention="paged").generate(prompts, params)]
        split = LLM(tiny, tokenizer=tiny_tok, paged_attention="test_split3")
        got = [o.outputs[0].token_ids for o in split.generate(prompts, params)]
    finally:
        A.unregister("test_split3")
    assert got == want
