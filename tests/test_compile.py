"""The static KV cache and ``compile=True``: same tokens as eager, one graph per batch size."""
from __future__ import annotations

import pytest
import torch

import llmlab
from llmlab.cache import ContiguousKVCache, StaticKVCache, slots_for
from llmlab.compile import compiled_step, graphs_compiled

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20]]


def tokens(gens):
    return [g.token_ids for g in gens]


def test_slots_are_powers_of_two_within_the_context():
    assert [slots_for(n, 2048) for n in (1, 256, 257, 1000, 2048)] == [256, 256, 512, 1024, 2048]
    assert slots_for(300, 300) == 300
    with pytest.raises(ValueError, match="length=0 must be an int in 1..2048"):
        slots_for(0, 2048)


@torch.inference_mode()
def test_static_cache_logits_match_the_contiguous_cache_with_left_padding(tiny):
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    caches = [ContiguousKVCache.for_model(tiny, 2, 16), StaticKVCache.for_model(tiny, 2, 16)]
    out = []
    for cache in caches:
        steps = [tiny(ids, positions=cache.begin(5, mask), cache=cache, last_only=True)]
        cache.advance()
        for tok, real in ((torch.tensor([[3], [4]]), None),
                          (torch.tensor([[2], [6]]), torch.tensor([[True], [False]]))):
            steps.append(tiny(tok, positions=cache.begin(1, real), cache=cache, last_only=True))
            cache.advance()
        out.append(steps)
    real_rows = ([0, 1], [0, 1], [0])           # the last step feeds row 1 a pad
    for a, b, rows in zip(*out, real_rows):
        assert (a[rows] - b[rows]).abs().max().item() < 1e-5
    assert caches[1].lengths == [5, 6]          # the pad fed to row 1 was not counted


def test_static_cache_refuses_what_does_not_fit(tiny):
    cache = StaticKVCache.for_model(tiny, 1, 4)
    cache.begin(3)
    with pytest.raises(ValueError, match="begin\\(\\) called twice"):
        cache.begin(1)
    cache.advance()
    with pytest.raises(ValueError, match="do not fit: rows hold \\[3\\] of max_len=4"):
        cache.begin(2)
    cache.truncate(1)
    assert cache.lengths == [1]
    with pytest.raises(ValueError, match="past the model's context"):
        StaticKVCache.for_model(tiny, 1, 10**6)


@pytest.mark.parametrize("b, s, heads, kv, d, slots", [
    (1, 1, 9, 3, 64, 257), (2, 3, 4, 2, 16, 9), (3, 1, 6, 3, 20, 33), (2, 5, 4, 4, 8, 6)])
def test_the_static_attend_operator_matches_its_reference(b, s, heads, kv, d, slots):
    """llmlab::static_attend (C++ where it builds: writes in place, reads only the visible
    slots) against static_attend: the same caches bit for bit, outputs within 1e-5, at head
    sizes off the vector width, with a padding token writing to the bin."""
    from llmlab.cache.static import static_attend
    from llmlab.kernels import cpu_gemv

    g = torch.Generator().manual_seed(b * 100 + s * 10 + slots)
    kc, vc = torch.randn(2, b, kv, slots, d, generator=g)
    where = torch.randint(0, slots - 1, (b, s), generator=g)
    where[0, -1] = slots - 1                                 # a pad: the bin, never read
    q = torch.randn(b, s, heads, d, generator=g)
    k, v = torch.randn(2, b, s, kv, d, generator=g)
    kr, vr = kc.clone(), vc.clone()
    want = static_attend(kr, vr, where, torch.arange(slots), q, k, v)
    got = torch.ops.llmlab.static_attend(kc, vc, where, q, k, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert (got - want).abs().max().item() < 1e-5
    assert cpu_gemv.cxx_static_attend(kc, q) == (cpu_gemv.describe().endswith("C++ kernels"))
    if cpu_gemv.cxx_static_attend(kc, q):
        with pytest.raises(ValueError, match=rf"slot {slots} outside \[0, {slots}\)"):
            torch.ops.llmlab.static_attend(kc, vc, torch.full((b, s), slots), q, k, v)
        with pytest.raises(ValueError, match="shapes do not match"):
            torch.ops.llmlab.static_attend(kc, vc, where, q, k[..., :1], v[..., :1])


def test_generate_on_the_static_cache_gives_the_contiguous_tokens(tiny, tiny_tok):
    kw = dict(max_new_tokens=12, ignore_eos=True)
    want = tokens(llmlab.generate(tiny, tiny_tok, PROMPTS, kv_cache="contiguous", **kw))
    assert tokens(llmlab.generate(tiny, tiny_tok, PROMPTS, kv_cache="static", **kw)) == want


def test_compile_needs_the_static_cache(tiny, tiny_tok):
    with pytest.raises(ValueError, match="compile=True runs the decode step on the static cache"):
        llmlab.generate(tiny, tiny_tok, PROMPTS, max_new_tokens=2, kv_cache="paged", compile=True)


@pytest.mark.slow
def test_compiled_decode_gives_eager_tokens_and_never_recompiles(tiny, tiny_tok):
    """Float32 greedy: the compiled step's tokens are eager's; after one warm-up call, 256
    positions (and a second batch with other prompts) compile nothing new."""
    kw = dict(max_new_tokens=256, ignore_eos=True)
    want = tokens(llmlab.generate(tiny, tiny_tok, PROMPTS, kv_cache="contiguous", **kw))
    assert tokens(llmlab.generate(tiny, tiny_tok, PROMPTS, compile=True, **kw)) == want
    before = graphs_compiled()
    others = [[30, 31], [32, 33, 34, 35], [36]]
    got = tokens(llmlab.generate(tiny, tiny_tok, others, compile=True, **kw))
    assert graphs_compiled() == before
    assert got == tokens(llmlab.generate(tiny, tiny_tok, others, kv_cache="contiguous", **kw))
    step = compiled_step(tiny)
    assert step.batch_sizes == {3} and step.compile_s > 0


@pytest.mark.slow
def test_compiled_smollm2_gives_eager_greedy_tokens(smollm2, tokenizer):
    q = "Explain in two sentences why the sky is blue."
    eager = llmlab.generate(smollm2, tokenizer, q, max_new_tokens=48, kv_cache="contiguous")
    compiled = llmlab.generate(smollm2, tokenizer, q, max_new_tokens=48, compile=True)
    assert compiled.token_ids == eager.token_ids and compiled.text == eager.text


def test_capture_sizes_and_buckets():
    from llmlab.cache.graphed import bucket, capture_sizes

    assert capture_sizes(1) == [1] and capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert [bucket(n, capture_sizes(12)) for n in (1, 3, 8, 9, 12)] == [1, 4, 8, 12, 12]
    with pytest.raises(ValueError, match="13 sequences exceed the largest capture size 12"):
        bucket(13, capture_sizes(12))
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        capture_sizes(0)


@torch.inference_mode()
def test_graphed_paged_decode_matches_the_eager_paged_read(tiny):
    """Eager (no compile): the fixed-shape decode over the pool gives the packed step's
    logits, with the batch padded past its sequences."""
    from llmlab.cache import PagedKVCache
    from llmlab.cache.graphed import GraphedPagedDecode
    from llmlab.engine.runner import ModelRunner

    paged = PagedKVCache.for_model(tiny, 32, 4, backend="paged_sdpa")
    runner = ModelRunner(tiny, paged)
    prompts = {0: [5, 6, 7, 8, 9, 10], 1: [11, 12, 13]}
    for sid, ids in prompts.items():
        paged.manager.allocate(sid, ids)
        positions = paged.prepare([sid], [len(ids)])
        tiny(torch.tensor([ids]), positions=positions, cache=paged, last_only=True)
        paged.manager.append_slot(sid, 3)
    graphed = GraphedPagedDecode(paged)
    starts = [len(p) for p in prompts.values()]
    ids, pos = graphed.prepare(list(prompts), [3, 3], starts, batch=4)
    assert ids.shape == pos.shape == (4, 1) and graphed.block_tables.shape[0] == 4
    got = tiny.step(ids, pos, graphed, rows="last")[:2, -1]
    want = tiny.step(torch.tensor([[3, 3]]), runner.packed.prepare(list(prompts), [1, 1], starts),
                     runner.packed, rows=runner.packed.step.last_rows)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.slow
def test_llm_compile_gives_eager_tokens_and_never_recompiles(tiny, tiny_tok):
    """A mixed trace on the engine: prompts join and leave, so decode steps run at batch
    sizes 1 and 2; compiled decode gives eager's greedy tokens, and a second pass compiles
    nothing new."""
    from llmlab.engine import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20], list(range(21, 39)), [40, 41]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (30, 5, 50, 20, 64)]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run(LLM(tiny, tiny_tok, max_num_seqs=2, block_size=4))
    llm = LLM(tiny, tiny_tok, max_num_seqs=2, block_size=4, compile=True)
    assert run(llm) == want
    before = graphs_compiled()
    assert run(llm) == want and graphs_compiled() == before
    assert llm.engine.cache.manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="compile=True reads a float KV pool"):
        LLM(tiny, tiny_tok, compile=True, kv_cache_dtype="int8")


def test_a_compiled_step_may_keep_a_graph_per_bucket(tiny):
    """TorchDynamo's default of 8 graphs per function would send a ninth bucket (another
    model, batch size or width) back to eager without a word."""
    import torch._dynamo

    from llmlab.compile import RECOMPILE_LIMIT, CompiledStep

    CompiledStep(tiny)
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT >= 64


@pytest.mark.slow
def test_module_guards_are_dropped_but_each_model_keeps_its_own_graph(tiny_tok):
    """The CPU step drops Dynamo's guards on modules (a millisecond a step on SmolLM2): two
    models of one structure must still each run their own weights, and a model rebuilt in
    place (fuse_model) must be traced again, not run through the stale graph."""
    from llmlab.layers.fused import fuse_model

    a = llmlab.load_model("tiny-llama", attention="sdpa")
    b = llmlab.load_model("tiny-llama", attention="sdpa")
    with torch.no_grad():
        b.layers[0].mlp.down_proj.weight.mul_(-3.0)
    kw = dict(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for name, m in (("a", a), ("b", b)):
        want = tokens(llmlab.generate(m, tiny_tok, PROMPTS, kv_cache="contiguous", **kw))
        assert tokens(llmlab.generate(m, tiny_tok, PROMPTS, compile=True, **kw)) == want, name
        outs[name] = want
    assert outs["a"] != outs["b"], "the perturbed model should answer differently"
    step = compiled_step(a)
    stamp, before = step.stamp, graphs_compiled()
    fuse_model(a, "torch")
    want = tokens(llmlab.generate(a, tiny_tok, PROMPTS, kv_cache="contiguous", **kw))
    assert tokens(llmlab.generate(a, tiny_tok, PROMPTS, compile=True, **kw)) == want
    assert compiled_step(a) is step and step.stamp != stamp and graphs_compiled() > before


@pytest.mark.slow
def test_the_cpu_graph_streams_float32_weights_through_the_c_gemv(tiny, tiny_tok):
    """Float32 on the CPU: the graph pass turns each few-row mm against a weight into
    llmlab::f32_gemv (none left over), and greedy tokens stay eager's. Where the C kernels
    did not build, the pass is off and the graph keeps PyTorch's matmuls."""
    from llmlab.compile import CompiledStep
    from llmlab.kernels import cpu_gemv
    from llmlab.profiling import trace_ops

    built = cpu_gemv.available()
    cache = StaticKVCache.for_model(tiny, 2, 256)
    ids = torch.tensor([[5], [6]])
    names = {}
    for gemv in (True, False):
        step = CompiledStep(tiny, gemv=gemv)

        @torch.inference_mode()
        def one():
            cache.reset()
            pos = cache.begin(1)
            out = step(ids, pos, cache)
            cache.advance()
            return out

        one()
        names[gemv] = [op.name for op in trace_ops(one)]
    linears = sum(isinstance(m, torch.nn.Linear) for m in tiny.modules())
    assert names[True].count("llmlab::f32_gemv") == (linears if built else 0)
    assert ("aten::mm" in names[True]) is not built
    assert "llmlab::f32_gemv" not in names[False] and "aten::mm" in names[False]
    assert CompiledStep(tiny).gemv is built
    kw = dict(max_new_tokens=32, ignore_eos=True)
    want = tokens(llmlab.generate(tiny, tiny_tok, PROMPTS, kv_cache="contiguous", **kw))
    assert tokens(llmlab.generate(tiny, tiny_tok, PROMPTS, compile=True, **kw)) == want
