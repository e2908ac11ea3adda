"""The int8 KV cache option (``kv_dtype="int8"``): memory, per-token error, and the tokens
it generates against the float32 cache, contiguous and paged, the serving engine included."""
import pytest
import torch

import llmlab
from llmlab.attention import get as get_backend
from llmlab.cache import ContiguousKVCache, PagedKVCache
from llmlab.cache.contiguous import dequantize_kv, quantize_kv
from llmlab.engine import LLM, SamplingParams


def kv_like(shape, seed=0):
    """Key-like vectors: mostly small, a few large channels (as real keys have), and one
    token whose values are 1000 times smaller than the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :2] *= 20
    x[0] *= 1e-3
    return x


@pytest.mark.parametrize("head_dim", [64, 128])
def test_memory_is_half_of_float16_and_a_quarter_of_float32_plus_the_scales(head_dim):
    def contiguous(dtype, kv_dtype="auto"):
        return ContiguousKVCache(2, 3, 4, head_dim, 32, dtype=dtype, kv_dtype=kv_dtype).nbytes

    def paged(dtype, kv_dtype="auto"):
        return PagedKVCache(2, 4, head_dim, 8, 16, dtype=dtype, kv_dtype=kv_dtype).nbytes

    for size in (contiguous, paged):
        int8 = size(torch.float32, "int8")
        codes = int8 * head_dim // (head_dim + 4)           # one float32 scale per head_dim codes
        assert codes * 2 == size(torch.float16), size.__name__
        assert codes * 4 == size(torch.float32), size.__name__
        # with the scales: (d + 4) / 2d of float16 (0.531 at d=64), (d + 4) / 4d of float32
        assert int8 / size(torch.float16) == pytest.approx((head_dim + 4) / (2 * head_dim))
        assert int8 / size(torch.float32) <= 0.27


def test_per_token_error_is_at_most_half_a_step():
    x = kv_like((5, 7, 4, 64))
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert torch.equal(scale, x.abs().amax(-1) / 127)
    err = (dequantize_kv(q, scale, torch.float32) - x).abs()
    worst = (err / scale[..., None]).max().item()
    assert worst <= 0.5 + 1e-4, f"max error {worst:.4f} steps (allowed 0.5)"
    # one scale for the whole tensor instead: the small token loses all its digits
    s_all = x.abs().max() / 127
    flat = torch.round(x / s_all).clamp(-127, 127) * s_all
    small = (flat[0] - x[0]).abs().max() / scale[0].max()
    assert small > 1, f"a per-tensor scale errs by {small:.1f} per-token steps on the small token"
    assert torch.equal(quantize_kv(torch.zeros(2, 8))[0], torch.zeros(2, 8, dtype=torch.int8))


class Recorder:
    """A dense backend that records the K/V it is given and returns zeros."""

    def __init__(self):
        self.seen = []

    def forward(self, q, k, v, causal=True, key_padding_mask=None):
        self.seen.append((k.clone(), v.clone()))
        return torch.zeros_like(q)


def test_contiguous_cache_reads_back_within_the_per_token_bound():
    cache = ContiguousKVCache(1, 2, 2, 64, 16, kv_dtype="int8")
    rec = Recorder()
    k, v = kv_like((2, 5, 2, 64), 1), kv_like((2, 5, 2, 64), 2)
    cache.begin(5)
    cache.attend(0, torch.randn(2, 5, 6, 64), k, v, rec)
    cache.advance()
    got_k, got_v = rec.seen[0]
    assert got_k.dtype == torch.float32 and cache.k[0].dtype == torch.int8
    for got, want in ((got_k, k), (got_v, v)):
        step = want.abs().amax(-1, keepdim=True) / 127
        assert ((got - want).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("backend", ["paged", "paged_triton"])
def test_paged_cache_matches_contiguous_int8(tiny, backend):
    """The same int8 rounding in both layouts: paged attention over the compact pool of
    dequantized blocks (the Triton kernel too) gives the contiguous cache's logits."""
    ids = torch.randint(3, 1000, (1, 11), generator=torch.Generator().manual_seed(0))
    cont = ContiguousKVCache.for_model(tiny, 1, 16, kv_dtype="int8")
    logits_c = tiny(ids, positions=cont.begin(11), cache=cont)
    paged = PagedKVCache.for_model(tiny, 6, 4, kv_dtype="int8", backend=backend)
    paged.manager.allocate(1, [5, 6, 7, 8, 9])       # sequence 0's blocks start past these
    paged.manager.allocate(0, ids[0].tolist())
    assert paged.manager.block_table(0)[0] != 0
    logits_p = tiny(ids, positions=paged.prepare([0], [11]), cache=paged)
    err = (logits_p - logits_c).abs().max().item()
    assert err <= 1e-4, f"paged vs contiguous int8: max logit difference {err:.3g}"
    assert paged.k[0].dtype == torch.int8 and paged.k_scale[0].shape == (6, 4, paged.num_kv_heads)


@pytest.mark.slow
def test_greedy_tokens_match_the_float32_cache_on_smollm2(smollm2, tokenizer):
    prompts = ["What is the capital of France?", "Write a haiku about autumn leaves."]
    ref = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=16, kv_cache="contiguous")
    for kv_cache in ("contiguous", "paged"):
        got = llmlab.generate(smollm2, tokenizer, prompts, max_new_tokens=16, kv_cache=kv_cache,
                              kv_cache_dtype="int8")
        for r, g in zip(ref, got):
            same = sum(a == b for a, b in zip(r.token_ids, g.token_ids))
            assert g.token_ids == r.token_ids, (f"{kv_cache} int8: {same}/{len(r.token_ids)} "
                                                f"tokens agree: {g.text!r} vs {r.text!r}")


def test_engine_with_int8_cache_survives_preemption(tiny, tiny_tok):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (6, 9, 5, 11)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    roomy = LLM(tiny, tiny_tok, max_num_seqs=4, block_size=4, num_blocks=64,
                kv_cache_dtype="int8")
    want = [o.outputs[0].token_ids for o in roomy.generate(ids, params, use_tqdm=False)]
    assert roomy.engine.cache.k[0].dtype == torch.int8
    tight = LLM(tiny, tiny_tok, max_num_seqs=4, block_size=4, num_blocks=7,
                kv_cache_dtype="int8")
    outs = tight.generate(ids, params, use_tqdm=False)
    assert tight.stats.num_preemptions > 0
    got = [o.outputs[0].token_ids for o in outs]
    same = sum(a == b for w, o in zip(want, got) for a, b in zip(w, o))
    assert got == want, f"{same}/{sum(map(len, want))} tokens agree after preemption"
    tight.engine.cache.manager.check_invariants()


def test_bad_options_are_named(tiny, tiny_tok):
    with pytest.raises(ValueError, match=r"kv_dtype='fp8'; allowed: \['auto', 'int8'\]"):
        ContiguousKVCache(1, 1, 1, 8, 4, kv_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_dtype='int4'; allowed"):
        PagedKVCache(1, 1, 8, 4, 4, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs kv_cache='contiguous' or"):
        llmlab.generate(tiny, tiny_tok, "hi", max_new_tokens=2, kv_cache="none",
                        kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_dtype='bf16'"):
        LLM(tiny, tiny_tok, kv_cache_dtype="bf16", num_blocks=4)
    # the Triton paged kernel never sees the int8 pool itself: it refuses one
    q = torch.randn(1, 1, 2, 16)
    pool = torch.zeros(2, 16, 1, 16, dtype=torch.int8)
    lens, table = torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="must share one dtype"):
        get_backend("paged_triton").with_kvcache(q, pool, pool, lens, table)
