"""The tiled online-softmax backend ``flash`` (plain PyTorch) against dense attention."""
import math

import pytest
import torch

import llmlab
import llmlab.attention as A
from llmlab.attention.flash import (CAUSAL_SKIPPED, FULL_BLOCK, MASKED_BLOCK, block_schedule,
                                    flash_attention, flash_attention_varlen, kv_blocks,
                                    key_ranges, online_softmax_update)
from llmlab.profiling import peak_memory


def dense64(q, k, v, causal, key_padding_mask=None):
    """softmax(QKᵀ/√d + mask)V entirely in float64 (naive's formula without its fp32 softmax)."""
    q, k, v = q.double(), k.double(), v.double()
    h = q.shape[2]
    qt, kt, vt = (A.expand_kv(t, h).transpose(1, 2) for t in (q, k, v))
    s = qt @ kt.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = A.causal_mask(q.shape[1], k.shape[1])
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ vt).transpose(1, 2)


def qkv(b, sq, sk, h, kvh, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=g, dtype=dtype),
            torch.randn(b, sk, kvh, d, generator=g, dtype=dtype),
            torch.randn(b, sk, kvh, d, generator=g, dtype=dtype))


def visible_rows(sq, sk, causal):
    """Query rows that see at least one key (with bottom-right causal, rows < sq - sk see none)."""
    return slice(max(0, sq - sk) if causal else 0, None)


@pytest.mark.parametrize("sq,sk", [(37, 37), (1, 29), (5, 70), (50, 20)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks", [(16, 16), (8, 32), (32, 4)])
def test_float64_exact_up_to_rounding(sq, sk, causal, blocks):
    q, k, v = qkv(2, sq, sk, 6, 2, 16, torch.float64, seed=sq * 7 + sk)
    out = flash_attention(q, k, v, causal=causal, block_q=blocks[0], block_k=blocks[1])
    ref = dense64(q, k, v, causal)
    rows = visible_rows(sq, sk, causal)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert (out - ref)[:, rows].abs().max().item() <= 1e-12
    naive = A.get("naive").forward(q, k, v, causal=causal)  # the textbook backend, also float64
    assert (out - naive)[:, rows].abs().max().item() <= 1e-12


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk,h,kvh", [(45, 45, 4, 4), (45, 45, 9, 3), (7, 60, 6, 2)])
def test_float32_matches_naive(causal, sq, sk, h, kvh):
    q, k, v = qkv(2, sq, sk, h, kvh, 32, seed=sq + h)
    out = A.get("flash").forward(q, k, v, causal=causal)
    ref = A.get("naive").forward(q, k, v, causal=causal)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.float32 and rel <= 2e-6


def test_float16_inputs_give_float16_close_to_float64():
    q, k, v = qkv(1, 33, 33, 4, 2, 32, torch.float16)
    out = flash_attention(q, k, v, block_q=16, block_k=16)
    assert out.dtype == torch.float16
    assert (out.double() - dense64(q, k, v, True)).abs().max().item() < 5e-3


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_masks(causal):
    q, k, v = qkv(3, 20, 20, 4, 2, 16, torch.float64)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, :7] = False                 # left padding
    mask[1, [2, 5, 11, 19]] = False     # arbitrary holes: the torch version takes any mask
    out = flash_attention(q, k, v, causal=causal, key_padding_mask=mask, block_q=8, block_k=8)
    ref = dense64(q, k, v, causal, mask)
    ok = torch.isfinite(ref).all(-1).all(-1)     # rows that see at least one key
    assert torch.isfinite(out).all()
    assert (out - ref)[ok].abs().max().item() <= 1e-12
    if (~ok).any():
        assert out[~ok].abs().max().item() == 0.0   # rows that see nothing return zeros


def test_blocks_must_be_powers_of_two():
    q, k, v = qkv(1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match=r"block_q=24 must be a positive power of two"):
        flash_attention(q, k, v, block_q=24)
    with pytest.raises(ValueError, match=r"block_k=0 must be a positive power of two"):
        block_schedule(8, 8, 4, 0)


def test_block_schedule_causal_square():
    grid = block_schedule(64, 64, 16, 16, causal=True)
    n = 4
    assert grid.shape == (n, n)
    assert (grid.diagonal() == MASKED_BLOCK).all()
    assert int((grid == CAUSAL_SKIPPED).sum()) == n * (n - 1) // 2
    assert int((grid == FULL_BLOCK).sum()) == n * (n - 1) // 2
    assert torch.equal(grid.triu(1), torch.zeros_like(grid))
    assert (block_schedule(64, 64, 16, 16, causal=False) == FULL_BLOCK).all()


def test_block_schedule_decode_and_chunk_see_the_cache():
    # one decode query sees every key: nothing skipped, nothing masked (the ragged tail
    # is cut by the key length, not by the causal mask)
    assert block_schedule(1, 100, 1, 32, causal=True).tolist() == [[1, 1, 1, 1]]
    # a chunk of 8 queries at the end of 44 keys, Br=4 Bc=8: queries 0-3 see keys <= 39
    grid = block_schedule(8, 44, 4, 8, causal=True).tolist()
    assert grid == [[1, 1, 1, 1, 2, 0], [1, 1, 1, 1, 1, 2]]


def test_kv_blocks_cover_exactly_the_visible_keys():
    sq, sk, bq, bk = 13, 29, 4, 8
    for q0 in range(0, sq, bq):
        q1 = min(q0 + bq, sq)
        visited = [j for s, e, _ in kv_blocks(q0, q1, sq, sk, bk, True) for j in range(s, e)]
        needed = max(j for j in range(sk) if j <= q1 - 1 + sk - sq) + 1
        assert visited[: needed] == list(range(needed)) and len(visited) < needed + bk


def test_online_softmax_update_equals_softmax_of_the_row():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 20, generator=g, dtype=torch.float64) * 4
    vals = torch.randn(20, 5, generator=g, dtype=torch.float64)
    m = torch.full((3,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(3, dtype=torch.float64)
    acc = torch.zeros(3, 5, dtype=torch.float64)
    for j in range(0, 20, 6):
        m, l, acc = online_softmax_update(m, l, acc, scores[:, j:j + 6], vals[j:j + 6])
    assert torch.allclose(m, scores.max(-1).values)
    assert torch.allclose(l, torch.exp(scores - m[:, None]).sum(-1))
    assert torch.allclose(acc / l[:, None], torch.softmax(scores, -1) @ vals, atol=1e-13)


def test_online_softmax_update_of_fully_masked_block_keeps_state():
    m = torch.tensor([float("-inf"), 1.0])
    l = torch.tensor([0.0, 2.0])
    acc = torch.tensor([[0.0], [3.0]])
    s = torch.full((2, 4), float("-inf"))
    m2, l2, acc2 = online_softmax_update(m, l, acc, s, torch.ones(4, 1))
    assert torch.equal(l2, l) and torch.equal(acc2, acc) and not torch.isnan(m2[1])


def test_varlen_matches_per_sequence_dense():
    lq, lk = [5, 17, 1, 0], [5, 30, 9, 4]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), 6, 16, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), 2, 16, generator=g, dtype=torch.float64)
    cq = torch.tensor([0, 5, 22, 23, 23], dtype=torch.int32)
    ck = torch.tensor([0, 5, 35, 44, 48], dtype=torch.int32)
    out = A.get("flash").varlen(q, k, v, cq, ck, 17, 30, causal=True)
    for i in range(3):
        ref = dense64(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                      v[None, ck[i]:ck[i + 1]], True)[0]
        assert (out[cq[i]:cq[i + 1]] - ref).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match=r"cu_seqlens_q=\[0, 5, 22\] must start at 0"):
        flash_attention_varlen(q, k, v, cq[:3], ck[:3], 17, 30)


def test_key_ranges_and_refusal():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    start, end = key_ranges(mask)
    assert start.tolist() == [2, 0, 4, 1] and end.tolist() == [4, 4, 4, 3]
    with pytest.raises(ValueError, match=r"one run per row.*row 0 is \[1, 0, 1, 1\]"):
        key_ranges(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool))


def test_registered_with_varlen_forms():
    names = A.available()
    assert "flash" in names and "flash_triton" in names
    assert A.get("flash").varlen is flash_attention_varlen
    assert A.get("flash_triton").varlen is not None


def test_peak_memory_is_linear_not_quadratic():
    n = 1024
    q, k, v = qkv(1, n, n, 2, 2, 32)
    naive = peak_memory(lambda: A.get("naive").forward(q, k, v), device="cpu").peak_bytes
    flash = peak_memory(lambda: flash_attention(q, k, v, block_q=128, block_k=128),
                        device="cpu").peak_bytes
    assert naive >= 2 * n * n * 4     # at least one [heads, N, N] float32 score matrix
    assert flash < 0.1 * naive


def test_model_with_flash_gives_the_same_greedy_tokens(smollm2, tokenizer):
    prompts = ["The capital of France is", "2+2="]   # a batch: left padding on the second
    try:
        ref = llmlab.generate(smollm2.set_attention("naive"), tokenizer, prompts,
                              max_new_tokens=3, chat=False)
        got = llmlab.generate(smollm2.set_attention("flash"), tokenizer, prompts,
                              max_new_tokens=3, chat=False)
    finally:
        smollm2.set_attention("naive")
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
