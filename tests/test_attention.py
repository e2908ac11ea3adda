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
