import math

import pytest
import torch

import llmlab.attention as A


def loop_reference(q, k, v, causal, key_padding_mask=None):
    """Attention one (batch, head, query) at a time, in float64: the slowest, plainest form."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // kvh)
            for i in range(sq):
                keys = [j for j in range(sk)
                        if (not causal or j <= i + sk - sq)
                        and (key_padding_mask is None or key_padding_mask[bi, j])]
                s = torch.stack([q[bi, i, hi].double() @ k[bi, j, kv].double() for j in keys]) / math.sqrt(d)
                p = torch.softmax(s, 0)
                out[bi, i, hi] = sum(p[t] * v[bi, j, kv].double() for t, j in enumerate(keys))
    return out


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("sq,sk,causal", [(7, 7, True), (7, 7, False), (3, 10, True), (1, 9, True)])
def test_backends_match_loop_reference(backend, sq, sk, causal):
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(2, sq, 6, 16, generator=g)
    k = torch.randn(2, sk, 2, 16, generator=g)
    v = torch.randn(2, sk, 2, 16, generator=g)
    out = A.get(backend).forward(q, k, v, causal=causal)
    ref = loop_reference(q, k, v, causal)
    assert out.shape == q.shape
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_key_padding_mask(backend):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=g)
    k = torch.randn(2, 5, 2, 8, generator=g)
    v = torch.randn(2, 5, 2, 8, generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = A.get(backend).forward(q, k, v, causal=True, key_padding_mask=mask)
    ref = loop_reference(q[:, 2:], k, v, True, mask)  # rows with no visible key are unused
    assert torch.isfinite(out).all()
    assert (out[:, 2:].double() - ref).abs().max().item() < 1e-5


def test_naive_materializes_scores_and_sdpa_matches_it():
    q = torch.randn(1, 33, 4, 16)
    k = torch.randn(1, 33, 4, 16)
    v = torch.randn(1, 33, 4, 16)
    a = A.get("naive").forward(q, k, v)
    b = A.get("sdpa").forward(q, k, v)
    assert (a - b).abs().max().item() < 1e-5


def test_registry_lists_and_refuses():
    assert A.available()[:2] == ["naive", "sdpa"]
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; allowed: \['naive', 'sdpa'"):
        A.get("nope")


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        A.naive_attention(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        A.naive_attention(torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8))


def packed_qkv(q_lens, k_lens, heads=6, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    k = torch.randn(sum(k_lens), kv_heads, d, generator=g)
    v = torch.randn(sum(k_lens), kv_heads, d, generator=g)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("backend", ["naive", "sdpa", "flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_form_equals_each_sequence_alone(backend, causal):
    """Packed prompts (a one-token one among them, and new tokens on longer key runs,
    bottom-right causal) give what each sequence gets on its own, in float64 too."""
    q_lens, k_lens = [5, 1, 17, 3], [5, 1, 17, 9]
    q, k, v, cu_q, cu_k = packed_qkv(q_lens, k_lens)
    out = A.get(backend).varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    assert out.shape == q.shape
    for i in range(len(q_lens)):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        ref = loop_reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal)[0]
        assert (out[qs:qe].double() - ref).abs().max().item() < 1e-5, (backend, i)


def test_registering_a_plain_function_gives_every_form():
    """A backend registered with only its dense form serves packed sequences too (one call
    per sequence); a bad name or a non-function is refused."""
    calls = []

    def mine(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None):
        calls.append(q.shape[1])
        return A.naive_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 key_padding_mask=key_padding_mask)

    try:
        backend = A.register("test_mine", mine, description="naive, counted")
        assert A.get("test_mine") is backend and "test_mine" in A.available()
        assert "test_mine" not in A.paged_backends()
        q, k, v, cu_q, cu_k = packed_qkv([4, 2, 7], [4, 2, 7], seed=1)
        got = backend.varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True)
        want = A.get("naive").varlen(q, k, v, cu_q, cu_k, 7, 7, causal=True)
        assert calls == [4, 2, 7] and torch.equal(got, want)
    finally:
        A.unregister("test_mine")
    with pytest.raises(ValueError, match="must be callable"):
        A.register("test_bad", "not a function")
    with pytest.raises(ValueError, match="non-empty string"):
        A.register("", mine)


def test_varlen_refuses_bad_offsets():
    q, k, v, cu_q, cu_k = packed_qkv([3, 2], [3, 2])
    with pytest.raises(ValueError, match=r"cu_seqlens_q=\[0, 3, 4\] must start at 0"):
        A.get("sdpa").varlen(q, k, v, torch.tensor([0, 3, 4], dtype=torch.int32), cu_k, 3, 3)
    with pytest.raises(ValueError, match=r"\[total_tokens, heads, head_dim\]"):
        A.get("naive").varlen(q[None], k, v, cu_q, cu_k, 3, 3)
