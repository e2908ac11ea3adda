"""The quantized layers under ``torch.compile``: the C decode kernels as torch operators
(``llmlab::gemv``, ``llmlab::dequantize``) give the reference's answer, trace into one
graph with no break, and ``generate(compile=True)`` gives eager's greedy tokens for int8,
int4 and Q4_1 without compiling anything new after the warm-up."""
from __future__ import annotations

import pytest
import torch

import llmlab
from llmlab.cache import StaticKVCache
from llmlab.compile import compiled_step, graphs_compiled
from llmlab.kernels import cpu_gemv
from llmlab.profiling.overhead import count_ops
from llmlab.quant import GroupLinear, Int8Linear, Q8_0Linear, QuantizedLinear

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler: "
                                "the layers keep PyTorch's kernels")

SCHEMES = ("int8", "int4", "q4_1")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20]]
LAYER_TYPES = {"int8": Int8Linear, "int4": GroupLinear, "q4_1": GroupLinear}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _op_args(layer: QuantizedLinear):
    """(fmt, codes, k, scale, d, m, group_size): the layer's weight as the operators take it."""
    fmt, codes, stored = layer.c_layout()
    return (fmt, codes, layer.in_features, stored.get("scale"), stored.get("d"),
            stored.get("m"), stored.get("group_size", 32))


def _layers(model) -> list[QuantizedLinear]:
    """One of each quantized layer of a model: the fused q/k/v, o, gate/up, down, and the head."""
    seen = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantizedLinear):
            seen.setdefault((type(mod), mod.in_features, mod.out_features), (name, mod))
    return [mod for _, mod in seen.values()]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_operators_give_the_dequantized_matmul_and_the_layers_call_them(tiny, scheme):
    """Each layer of a quantized tiny-llama: llmlab::gemv against the reference
    (dequantize, then a float32 matmul) at 1-8 rows and on a strided view; llmlab::dequantize
    bit for bit the dequantized weight; the layer's decode forward calls llmlab::gemv, once."""
    model = llmlab.quantize(tiny, scheme)
    layers = _layers(model)
    assert {type(x) for x in layers} == {LAYER_TYPES[scheme], Q8_0Linear}
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        fmt, codes, k, *rest = _op_args(layer)
        for rows in (1, 3, 8):
            x = torch.randn(rows, k, generator=g)
            y = torch.ops.llmlab.gemv(fmt, x, codes, k, *rest)
            assert y.shape == (rows, layer.out_features) and y.dtype == torch.float32
            assert _rel(y, layer.reference_forward(x)) < 1e-5, (fmt, rows)
        wide = torch.randn(2, 2 * k, generator=g)[:, ::2]          # not contiguous
        assert torch.equal(torch.ops.llmlab.gemv(fmt, wide, codes, k, *rest),
                           torch.ops.llmlab.gemv(fmt, wide.contiguous(), codes, k, *rest))
        assert torch.equal(torch.ops.llmlab.dequantize(fmt, codes, k, *rest),
                           layer.dequantized_weight())
        with torch.inference_mode():
            ops = count_ops(layer, torch.randn(1, 1, k, generator=g))
        assert ops.by_name["llmlab::gemv"] == 1, ops.by_name


def test_the_fake_kernels_give_shapes_without_running_c(tiny):
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layers(llmlab.quantize(tiny, "int4"))[0]
    fmt, codes, k, scale, d, m, group = _op_args(layer)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.zeros(2, 1, k))
        y = torch.ops.llmlab.gemv(fmt, x, codes, k, scale, d, m, group)
        w = torch.ops.llmlab.dequantize(fmt, codes, k, scale, d, m, group)
        assert (tuple(y.shape), y.dtype) == ((2, 1, layer.out_features), torch.float32)
        assert (tuple(w.shape), w.dtype) == ((layer.out_features, k), torch.float32)
        with pytest.raises(ValueError, match=f"must end in k={k}"):
            torch.ops.llmlab.gemv(fmt, mode.from_tensor(torch.zeros(1, k + 1)), codes, k,
                                  scale, d, m, group)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_opcheck(tiny, scheme):
    """torch.library.opcheck: the schema, the fake kernel against the real one, and the
    operators inside a traced graph."""
    layer = _layers(llmlab.quantize(tiny, scheme))[0]
    fmt, codes, k, *rest = _op_args(layer)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.llmlab.gemv.default, (fmt, x, codes, k, *rest))
    torch.library.opcheck(torch.ops.llmlab.dequantize.default, (fmt, codes, k, *rest))


@pytest.mark.parametrize("scheme", [pytest.param("int8", marks=pytest.mark.slow), "int4",
                                    pytest.param("q4_1", marks=pytest.mark.slow)])
def test_a_quantized_decode_step_traces_into_one_graph(tiny, scheme):
    """TorchDynamo alone (no Inductor): one graph, no break, every projection a gemv."""
    model = llmlab.quantize(tiny, scheme)
    cache = StaticKVCache.for_model(model, 2, 16)
    with torch.inference_mode():
        model(torch.zeros(2, 3, dtype=torch.long), positions=cache.begin(3), cache=cache)
        cache.advance()
        ids, pos = torch.zeros(2, 1, dtype=torch.long), cache.begin(1)
        explained = torch._dynamo.explain(model.step)(ids, pos, cache, None, "last")
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
    calls = [n for n in explained.graphs[0].graph.nodes
             if n.op == "call_function" and n.target is torch.ops.llmlab.gemv.default]
    assert len(calls) == 4 * tiny.config.num_layers + 1    # qkv, o, gate/up, down; the head


def _tokens(gens):
    return [g.token_ids for g in gens]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_compiled_quantized_decode_gives_eager_tokens_and_never_recompiles(tiny, tiny_tok,
                                                                           scheme):
    """Float32 greedy: the compiled step's tokens are eager's; after the warm-up, 64 more
    positions of a second batch of the same size compile nothing new."""
    model = llmlab.quantize(tiny, scheme)
    kw = dict(max_new_tokens=64, ignore_eos=True)
    want = _tokens(llmlab.generate(model, tiny_tok, PROMPTS, kv_cache="contiguous", **kw))
    assert _tokens(llmlab.generate(model, tiny_tok, PROMPTS, compile=True, **kw)) == want
    before = graphs_compiled()
    others = [[30, 31], [32, 33, 34, 35], [36]]
    got = _tokens(llmlab.generate(model, tiny_tok, others, compile=True, **kw))
    assert graphs_compiled() == before
    assert got == _tokens(llmlab.generate(model, tiny_tok, others, kv_cache="contiguous", **kw))
    assert compiled_step(model).batch_sizes == {3}


@pytest.mark.slow
def test_compiled_int4_smollm2_gives_eager_greedy_tokens(smollm2, tokenizer):
    model = llmlab.quantize(smollm2, "int4")
    q = "Explain in two sentences why the sky is blue."
    eager = llmlab.generate(model, tokenizer, q, max_new_tokens=48, kv_cache="contiguous")
    before = graphs_compiled()
    compiled = llmlab.generate(model, tokenizer, q, max_new_tokens=48, compile=True)
    assert compiled.token_ids == eager.token_ids and compiled.text == eager.text
    assert graphs_compiled() - before <= 1        # the one graph of batch size 1, or a cached one
