"""The quantized layers under ``torch.compile``: the C decode kernels as torch operators
(``llmlab::int8_gemv``, ``llmlab::q4_gemv``, ..., ``llmlab::dequantize``) give the
reference's answer, trace into one
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


def _gemv_args(layer: QuantizedLinear):
    """(operator, codes, others): the layer's decode product as the layer calls it."""
    fmt, codes, stored = layer.c_layout()
    return cpu_gemv.GEMV_OPS[fmt], codes, list(stored.values())


def _dequantize_args(layer: QuantizedLinear):
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
    """Each layer of a quantized tiny-llama: its gemv operator against the reference
    (dequantize, then a float32 matmul) at 1-8 rows and on a strided view; llmlab::dequantize
    bit for bit the dequantized weight; the layer's decode forward calls its operator, once."""
    model = llmlab.quantize(tiny, scheme)
    layers = _layers(model)
    assert {type(x) for x in layers} == {LAYER_TYPES[scheme], Q8_0Linear}
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        op, codes, others = _gemv_args(layer)
        k = layer.in_features
        for rows in (1, 3, 8):
            x = torch.randn(rows, k, generator=g)
            y = op(x, codes, *others)
            assert y.shape == (rows, layer.out_features) and y.dtype == torch.float32
            assert _rel(y, layer.reference_forward(x)) < 1e-5, (op, rows)
        wide = torch.randn(2, 2 * k, generator=g)[:, ::2]          # not contiguous
        assert torch.equal(op(wide, codes, *others), op(wide.contiguous(), codes, *others))
        assert torch.equal(torch.ops.llmlab.dequantize(*_dequantize_args(layer)),
                           layer.dequantized_weight())
        x = torch.randn(1, 1, k, generator=g)
        with torch.inference_mode():
            ops = count_ops(layer, x)                  # under the profiler: the operator
            assert torch.equal(layer(x), op(x, codes, *others))   # eager: the kernel itself
        assert dict(ops.by_name) == {op.name().replace(".default", ""): 1}, ops.by_name


def test_eager_calls_skip_the_dispatcher_only_where_nothing_needs_it():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.zeros(1, 8)
    cpu_gemv.available()
    # the direct call beats the Python kernels' route, not the C++ kernels'
    assert cpu_gemv.skips_dispatcher(x) == (cpu_gemv._LIB["ops_error"] is not None)
    with torch.profiler.profile():
        assert not cpu_gemv.skips_dispatcher(x)
    with TorchDispatchMode():
        assert not cpu_gemv.skips_dispatcher(x)
    with FakeTensorMode() as mode:
        assert not cpu_gemv.skips_dispatcher(mode.from_tensor(x))
    traced = torch.compile(lambda t: t + cpu_gemv.skips_dispatcher(t), fullgraph=True,
                           backend="eager")
    assert torch.equal(traced(x), x)              # False while tracing: the graph holds the op


def test_the_layers_list_their_tensors_as_the_operators_take_them(tiny):
    """c_layout's dict: the operator's arguments after x and codes, by name and in order
    (the layers pass them by position)."""
    seen = set()
    for scheme, head in (("int8", "q8_0"), ("int4", "int8"), ("fp8", "int4")):
        for layer in _layers(llmlab.quantize(tiny, scheme, lm_head=head)):
            fmt, codes, stored = layer.c_layout()
            names = [a.name for a in cpu_gemv.GEMV_OPS[fmt]._schema.arguments]
            assert names == ["x", "codes", *stored], (fmt, names, list(stored))
            seen.add(fmt)
    assert seen == set(cpu_gemv.GEMV_OPS) - {"f32"}       # f32: the float model's, in a graph pass


def test_the_fake_kernels_give_shapes_without_running_c(tiny):
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = _layers(llmlab.quantize(tiny, "int4"))[0]
    op, codes, others = _gemv_args(layer)
    k = layer.in_features
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        y = op(mode.from_tensor(torch.zeros(2, 1, k)), codes, *others)
        w = torch.ops.llmlab.dequantize(*_dequantize_args(layer))
        assert (tuple(y.shape), y.dtype) == ((2, 1, layer.out_features), torch.float32)
        assert (tuple(w.shape), w.dtype) == ((layer.out_features, k), torch.float32)
        with pytest.raises(ValueError, match=f"must end in K={k}"):
            op(mode.from_tensor(torch.zeros(1, k + 1)), codes, *others)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_opcheck(tiny, scheme):
    """torch.library.opcheck: the schema, the fake kernel against the real one, and the
    operators inside a traced graph (the layer's format and the Q8_0 head's)."""
    x = torch.randn(2, tiny.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in _layers(llmlab.quantize(tiny, scheme))[::4]:
        op, codes, others = _gemv_args(layer)
        torch.library.opcheck(op, (x, codes, *others))
        torch.library.opcheck(torch.ops.llmlab.dequantize.default, _dequantize_args(layer))


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
    gemvs = set(cpu_gemv.GEMV_OPS.values())
    calls = [n for n in explained.graphs[0].graph.nodes
             if n.op == "call_function" and n.target in gemvs]
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
