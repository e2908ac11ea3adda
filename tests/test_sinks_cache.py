"""The attention-sinks rolling cache (StreamingLLM): the positions of the paper's section 3.2,
chunked feeding equal to one token at a time, an unbounded window equal to the plain model,
and the bytes of a KV cache per token for MHA, GQA, MLA and a window."""
import pytest
import torch

from llmlab.cache.sinks import (SinkKVCache, rope, sink_window_attention, streaming_nll,
                                streaming_perplexity, visible)
from llmlab.layers.rotary import inverse_frequencies


def literal_streaming_attention(q, k, v, sinks, window, inv_freq):
    """For each query i on its own: the kept keys (the sinks, then the last ``window`` up to
    i) at cache positions 0..c-1, the query at c-1, RoPE applied there, softmax."""
    b, n, heads, d = q.shape
    group = heads // k.shape[2]
    out = torch.zeros_like(q)
    for i in range(n):
        kept = [j for j in range(i + 1) if j < sinks or window is None or j > i - window]
        pos = torch.arange(len(kept))
        kk = rope(k[:, kept], pos, inv_freq).repeat_interleave(group, 2)       # [b, c, h, d]
        vv = v[:, kept].repeat_interleave(group, 2)
        qq = rope(q[:, i:i + 1], pos[-1:], inv_freq)                          # [b, 1, h, d]
        att = torch.einsum("bqhd,bkhd->bhqk", qq, kk) / d ** 0.5
        out[:, i] = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), vv)[:, 0]
    return out


@pytest.mark.parametrize("sinks,window", [(4, 6), (0, 5), (2, None), (3, 30)])
def test_positions_are_those_within_the_cache(sinks, window):
    g = torch.Generator().manual_seed(sinks)
    q, k, v = (torch.randn(2, 21, h, 16, generator=g) for h in (6, 2, 2))
    inv_freq = inverse_frequencies(16, 10000.0)
    idx = torch.arange(21)
    got = sink_window_attention(q, k, v, idx, idx, sinks, window, inv_freq)
    want = literal_streaming_attention(q, k, v, sinks, window, inv_freq)
    assert (got - want).abs().max().item() < 1e-5
    # the window's positions matter: text positions for the sinks give other scores
    if window is not None and sinks and window + sinks < 21:
        text = literal_streaming_attention(q, k, v, sinks, None, inv_freq)
        assert (got - text).abs().max().item() > 1e-3


def test_visible_keys():
    i = torch.arange(8)
    ok = visible(i, i, 2, 3)
    assert ok[7].nonzero().flatten().tolist() == [0, 1, 5, 6, 7]
    assert ok[3].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert visible(i, i, 0, None).equal(torch.tril(torch.ones(8, 8, dtype=torch.bool)))


def test_chunks_equal_one_token_at_a_time_and_full_equals_the_model(tiny):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny.config.vocab_size, (16,), generator=g)
    with torch.inference_mode():
        logits = tiny(ids[None]).float()
    plain = torch.nn.functional.cross_entropy(logits[0, :-1], ids[1:], reduction="none")
    full = streaming_nll(tiny, ids, sinks=0, window=None, chunk=16)
    assert (full - plain).abs().max().item() < 1e-5
    one = streaming_nll(tiny, ids, sinks=2, window=5, chunk=1)
    for chunk in (6,):
        assert (streaming_nll(tiny, ids, sinks=2, window=5, chunk=chunk) - one).abs().max() < 1e-5
    assert (one - plain).abs().max().item() > 1e-2          # the window did drop tokens
    ppl = streaming_perplexity(tiny, ids, sinks=2, window=5, chunk=15, skip=8)
    assert ppl == pytest.approx(float(torch.exp(one[8:].mean())), rel=1e-5)


def test_the_cache_holds_sinks_plus_window(tiny):
    cache = SinkKVCache.for_model(tiny, 1, sinks=3, window=5)
    ids = torch.arange(1, 24)[None]
    with torch.inference_mode():
        for start in range(0, 23, 8):
            piece = ids[:, start:start + 8]
            tiny.step(piece, cache.begin(piece.shape[1]), cache)
            cache.advance()
            assert cache.length <= cache.capacity == 8
    assert cache.kept_index.tolist() == [0, 1, 2, 18, 19, 20, 21, 22]
    assert cache.k[0].shape[2] == 8 and cache.seen == 23


def test_bad_input_names_the_value(tiny):
    with pytest.raises(ValueError, match=r"sinks=-1 must be an int >= 0"):
        SinkKVCache.for_model(tiny, sinks=-1)
    with pytest.raises(ValueError, match=r"window=0 must be an int >= 1, or None"):
        streaming_nll(tiny, [1, 2, 3], window=0)
    with pytest.raises(ValueError, match=r"chunk=0 must be an int >= 1"):
        streaming_nll(tiny, [1, 2, 3], chunk=0)
    cache = SinkKVCache.for_model(tiny, 2)
    with pytest.raises(ValueError, match="cannot be padded"):
        cache.begin(3, torch.tensor([[0, 1, 1], [1, 1, 1]]))


def test_kv_bytes_calculator():
    from llmlab.cache import kv_bytes_per_token
    from llmlab.config import ModelConfig
    from llmlab.models.registry import model_dir
    from llmlab.profiling.kv_memory import MODELS, kv_bytes

    smol = kv_bytes("smollm2-135m")
    assert smol.scheme == "gqa" and smol.per_token == 2 * 30 * 3 * 64 * 2 == 23040
    config = ModelConfig.from_file(model_dir("smollm2-135m") / "config.json")   # as shipped
    shape = MODELS["smollm2-135m"]
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == \
        (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim)
    assert smol.per_token == kv_bytes_per_token(config, 2)
    assert kv_bytes("smollm2-135m", "mha").per_token == 3 * smol.per_token
    assert kv_bytes("llama-3-8b").per_token == 128 * 1024                  # 128 KiB a token
    mla = kv_bytes("deepseek-v2")
    assert mla.per_token == 60 * (512 + 64) * 2
    # DeepSeek-V2's Table 1: MLA's cache equals GQA's with 2.25 groups (4.5 d_h l elements)
    assert mla.per_token_per_layer == 4.5 * 128 * 2
    # a window caps the cache: 4 sinks + 1020 recent tokens at 32k context
    w = kv_bytes("llama-3-8b", context=32768, window=1020, sinks=4)
    assert w.cached_tokens == 1024 and w.total == 1024 * 128 * 1024
    assert w.per_token == pytest.approx(128 * 1024 / 32)
    assert kv_bytes("llama-3-8b", context=100, window=1020).cached_tokens == 100
    with pytest.raises(ValueError, match=r"scheme='mla' needs a latent dimension"):
        kv_bytes("llama-3-8b", "mla")
    with pytest.raises(ValueError, match=r"scheme='mqa'; allowed"):
        kv_bytes("llama-3-8b", "mqa")
    with pytest.raises(ValueError, match=r"context=0 must be an int >= 1"):
        kv_bytes("llama-3-8b", context=0)
