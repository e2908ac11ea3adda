"""The decoder's small parts: RMSNorm's one-call path and RoPE's shared tables."""
import pytest
import torch

from llmlab.layers import RMSNorm, rotary


def _formula(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_rms_norm_matches_the_formula_bit_for_bit(scale):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(3, 5, 576, generator=g) * scale
    assert torch.equal(norm(x), _formula(x, norm.weight, 1e-5))


def test_rms_norm_keeps_hf_order_for_bfloat16():
    norm = RMSNorm(64).to(torch.bfloat16)
    norm.weight.data = torch.linspace(0.5, 2, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, _formula(x, norm.weight, norm.eps))


def test_rotate_equals_apply_rotary_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    rope = rotary.RotaryEmbedding(64, theta=100000.0)
    q = torch.randn(2, 7, 9, 64, generator=g)
    k = torch.randn(2, 7, 3, 64, generator=g)
    pos = torch.randint(0, 2000, (2, 7), generator=g)
    cos, sin = rope.cos_sin(pos, q.dtype)
    rotary.clear_tables()
    q2, k2 = rope(q, k, pos)
    assert torch.equal(q2, rotary.apply_rotary(q, cos, sin))
    assert torch.equal(k2, rotary.apply_rotary(k, cos, sin))


def test_tables_are_shared_between_layers_and_rebuilt_for_new_positions():
    a, b = rotary.RotaryEmbedding(64), rotary.RotaryEmbedding(64)
    b.reset_frequencies(inv_freq=a.inv_freq)
    c = rotary.RotaryEmbedding(64)                      # its own (equal) frequencies
    pos = torch.arange(5)[None]
    rotary.clear_tables()
    first = a.tables(pos, torch.float32)
    assert b.tables(pos, torch.float32)[0] is first[0]               # reused
    assert c.tables(pos, torch.float32)[0] is not first[0]           # other frequencies
    pos2 = pos + 3
    got = a.tables(pos2, torch.float32)[0]
    want = a.cos_sin(pos2, torch.float32)[0][:, :, None, :]
    assert torch.equal(got, want) and not torch.equal(got, first[0])


def test_model_shares_frequencies_and_survives_positions_changed_in_place(smollm2):
    freqs = {id(layer.self_attn.rotary.inv_freq) for layer in smollm2.layers}
    assert len(freqs) == 1
    ids = torch.tensor([[1, 504, 3432, 314, 260, 1345]])
    with torch.inference_mode():
        want = smollm2(ids[:, 3:], positions=torch.arange(3, 6)[None])
        pos = torch.arange(3)[None]
        smollm2(ids[:, :3], positions=pos)
        pos += 3                                      # same tensor, new values
        got = smollm2(ids[:, 3:], positions=pos)
    assert torch.equal(got, want)
