"""The contiguous KV cache: same logits and same greedy tokens as the no-cache baseline,
exact cache sizes, preallocation, and clear errors."""
import pytest
import torch

import llmlab
from llmlab import cache as kv_caches
from llmlab.cache import ContiguousKVCache, kv_bytes_per_token, kv_cache_bytes
from llmlab.config import ModelConfig
from llmlab.generate import encode_prompts, left_pad

from .conftest import FRANCE

PROMPTS = [FRANCE, "Write a short poem about the sea, please, with rhymes.", "2+2="]

# Llama-2-13B: 40 layers, 40 heads (no grouped-query attention), head_dim 128.
LLAMA2_13B = ModelConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                         num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
                         max_position_embeddings=4096)


def _greedy_by_full_forward(model, encoded, generated, pad):
    """Teacher-forced no-cache baseline: one full forward over prompt + generated tokens
    (left-padded, masked); the greedy token after each prefix is the argmax there."""
    full = [p + g for p, g in zip(encoded, generated)]
    ids, mask = left_pad(full, pad, model.device)
    with torch.inference_mode():
        logits = model(ids, attention_mask=mask)
    n = ids.shape[1]
    out = []
    for row, (p, g) in enumerate(zip(encoded, generated)):
        first = n - len(p) - len(g)  # index of the row's first real token
        preds = logits[row, first + len(p) - 1: n - 1].argmax(-1).tolist()
        out.append(preds)
    return out


def test_cached_logits_match_full_forward_with_left_padding(smollm2, tokenizer):
    encoded = encode_prompts(tokenizer, PROMPTS[1:], chat=True)
    follow = tokenizer(" The sea is wide and the waves are loud tonight.")["input_ids"][:12]
    full = [e + follow for e in encoded]
    ids, mask = left_pad(full, tokenizer.pad_token_id, smollm2.device)
    n_prompt = ids.shape[1] - len(follow)
    cache = ContiguousKVCache.for_model(smollm2, batch=2, max_len=ids.shape[1])
    with torch.inference_mode():
        ref = smollm2(ids, attention_mask=mask)
        pos = cache.begin(n_prompt, mask[:, :n_prompt])
        got = [smollm2(ids[:, :n_prompt], positions=pos, cache=cache)]
        cache.advance()
        for t in range(n_prompt, ids.shape[1]):
            pos = cache.begin(1)
            assert pos[:, 0].tolist() == (mask[:, :t + 1].sum(1) - 1).tolist()
            got.append(smollm2(ids[:, t:t + 1], positions=pos, cache=cache))
            cache.advance()
    got = torch.cat(got, dim=1)
    real = mask.bool()
    err = (got - ref).abs().amax(-1)[real].max().item()
    assert err < 1e-3, err
    assert cache.length == ids.shape[1]
    assert cache.real_lengths.tolist() == [len(f) for f in full]


@pytest.mark.slow
def test_cached_greedy_64_tokens_single_prompt(smollm2, tokenizer):
    out = llmlab.generate(smollm2, tokenizer, PROMPTS[1], max_new_tokens=64, ignore_eos=True,
                          kv_cache="contiguous")
    assert len(out.token_ids) == 64 and out.finish_reason == "length"
    ref = _greedy_by_full_forward(smollm2, [out.prompt_token_ids], [out.token_ids],
                                  tokenizer.pad_token_id)
    assert out.token_ids == ref[0]


@pytest.mark.slow
def test_cached_greedy_64_tokens_padded_batch(smollm2, tokenizer):
    outs = llmlab.generate(smollm2, tokenizer, PROMPTS, max_new_tokens=64, ignore_eos=True,
                           kv_cache="contiguous")
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert len(set(lengths)) == 3  # really different lengths, so rows are left-padded
    assert all(len(o.token_ids) == 64 for o in outs)
    ref = _greedy_by_full_forward(smollm2, [o.prompt_token_ids for o in outs],
                                  [o.token_ids for o in outs], tokenizer.pad_token_id)
    for o, r in zip(outs, ref):
        assert o.token_ids == r, o.prompt


@pytest.mark.slow
def test_generate_with_and_without_cache_agree_including_eos(smollm2, tokenizer):
    prompts = [FRANCE, "2+2="]  # the first stops at the end-of-sequence token early
    base = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=12)
    cached = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=12, kv_cache="contiguous")
    assert base[0].finish_reason == "stop" and len(base[0].token_ids) < 12
    for b, c in zip(base, cached):
        assert b.token_ids == c.token_ids and b.finish_reason == c.finish_reason
        assert b.text == c.text


def test_ignore_eos_generates_every_token(smollm2, tokenizer):
    stop = llmlab.generate(smollm2, tokenizer, FRANCE, max_new_tokens=16, kv_cache="contiguous")
    full = llmlab.generate(smollm2, tokenizer, FRANCE, max_new_tokens=16, kv_cache="contiguous",
                           ignore_eos=True)
    assert stop.finish_reason == "stop" and len(stop.token_ids) < 16
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    assert full.token_ids[:len(stop.token_ids)] == stop.token_ids
    assert len(full.token_times_s) == 16 and full.metrics.ttft_s <= full.metrics.e2e_s


def test_token_id_prompts(tokenizer):
    model = llmlab.load_model("tiny-llama")
    ids = tokenizer("Once upon a time")["input_ids"]
    a = llmlab.generate(model, tokenizer, [ids], max_new_tokens=6, kv_cache="contiguous")
    b = llmlab.generate(model, tokenizer, "Once upon a time", max_new_tokens=6, chat=False)
    assert a[0].prompt_token_ids == ids and a[0].token_ids == b.token_ids


def test_cache_is_preallocated_and_written_in_place(tokenizer):
    model = llmlab.load_model("tiny-llama")
    cfg = model.config
    cache = ContiguousKVCache.for_model(model, batch=2, max_len=20)
    assert cache.k[0].shape == (2, cfg.num_kv_heads, 20, cfg.head_dim)
    ptrs = [t.data_ptr() for t in cache.k + cache.v]
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        pos = cache.begin(5)
        model(ids, positions=pos, cache=cache)
        cache.advance()
        for _ in range(3):
            pos = cache.begin(1)
            model(ids[:, :1], positions=pos, cache=cache)
            cache.advance()
    assert [t.data_ptr() for t in cache.k + cache.v] == ptrs
    assert cache.length == 8 and cache.real_lengths.tolist() == [8, 8]
    assert cache.k[1][:, :, :8].abs().sum() > 0 and cache.k[1][:, :, 8:].abs().sum() == 0
    assert cache.used_bytes == cache.nbytes * 8 // 20
    cache.reset()
    assert cache.length == 0 and cache.real_lengths.tolist() == [0, 0]


def test_kv_bytes_formula_matches_real_tensors_smollm2(smollm2):
    cfg = smollm2.config
    # 2 (K and V) · 30 layers · 3 kv heads · 64 dims · 4 bytes = 46,080 bytes per token
    assert kv_bytes_per_token(cfg, 4) == 2 * 30 * 3 * 64 * 4 == 46_080
    cache = ContiguousKVCache.for_model(smollm2, batch=3, max_len=100)
    assert cache.nbytes == kv_cache_bytes(cfg, 3, 100, bytes_per_el=4)
    half = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, 50,
                             dtype=torch.float16)
    assert half.nbytes == kv_cache_bytes(cfg, 2, 50, bytes_per_el=2) == 2 * 50 * 23_040


def test_kv_bytes_formula_matches_real_tensors_13b():
    # float16: 2 · 40 · 40 · 128 · 2 = 819,200 bytes, about 0.8 MB per token (the vLLM
    # paper's "800 KB per token" for a 13B model).
    per_token = kv_bytes_per_token(LLAMA2_13B, 2)
    assert per_token == 819_200
    cache = ContiguousKVCache(LLAMA2_13B.num_layers, 1, LLAMA2_13B.num_kv_heads,
                              LLAMA2_13B.head_dim, 8, dtype=torch.float16)
    assert cache.nbytes == 8 * per_token
    # one full 4096-token sequence: 3.36 GB, "about 3 GB per sequence" at 13B scale
    full = kv_cache_bytes(LLAMA2_13B, 1, 4096, 2)
    assert full == 4096 * 819_200 and 3.0e9 < full < 3.5e9


def test_bad_cache_names_and_misuse(tokenizer):
    model = llmlab.load_model("tiny-llama")
    with pytest.raises(ValueError, match=r"unknown kv_cache 'paged-ish'; allowed: \['none', 'contiguous'"):
        llmlab.generate(model, tokenizer, "hi", kv_cache="paged-ish")
    assert kv_caches.available()[:2] == ["none", "contiguous"]
    assert kv_caches.create("none", model, 1, 8) is None
    cache = kv_caches.create("contiguous", model, 1, 4)
    with pytest.raises(ValueError, match="advance\\(\\) without begin"):
        cache.advance()
    with pytest.raises(ValueError, match="5 new tokens do not fit: 0 of max_len=4"):
        cache.begin(5)
    cache.begin(2)
    with pytest.raises(ValueError, match="begin\\(\\) called twice"):
        cache.begin(1)
    with pytest.raises(ValueError, match="attend got 3 new tokens but begin\\(\\) announced 2"):
        with torch.inference_mode():
            model(torch.zeros(1, 3, dtype=torch.long), positions=torch.arange(3)[None], cache=cache)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        kv_caches.create("contiguous", model, 2, 4).begin(2, torch.ones(1, 2))
    # slots count left pads too, so a cache may be longer than the context; positions may not
    ctx = model.config.max_position_embeddings
    roomy = ContiguousKVCache.for_model(model, 1, ctx + 1)
    with pytest.raises(ValueError, match=f"position {ctx} is past the model's context of {ctx}"):
        with torch.inference_mode():
            model(torch.zeros(1, ctx + 1, dtype=torch.long), positions=roomy.begin(ctx + 1),
                  cache=roomy)
    with pytest.raises(ValueError, match="batch=0 must be a positive int"):
        ContiguousKVCache(2, 0, 2, 8, 4)
