"""llmlab.quant: formats, the Q4_1 round-trip proof, kernels against the reference, the
quantized model end to end, and the quality evaluation."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import llmlab
from llmlab import quant
from llmlab.models import resolve
from llmlab.quant import eval as qeval
from llmlab.kernels import cpu_gemv
from llmlab.quant import formats



def smollm2_file():
    """SmolLM2's float32 weights; FileNotFoundError naming the fetch command if missing."""
    return resolve("smollm2-135m") / "model.safetensors"


@pytest.fixture(scope="module")
def shipped():
    """A few real SmolLM2 linear weights, as loaded from the shipped float32 file."""
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.7.mlp.down_proj.weight", "model.layers.15.self_attn.o_proj.weight",
             "model.layers.29.mlp.gate_proj.weight", "model.layers.29.mlp.up_proj.weight"]
    with safe_open(str(smollm2_file()), "pt") as f:
        return {n: f.get_tensor(n) for n in names}


@pytest.fixture(scope="module")
def tiny():
    return llmlab.load_model("tiny-llama", attention="sdpa")


@pytest.fixture(scope="module")
def tok():
    return llmlab.load_tokenizer("tiny-llama")


# -- the round-trip proof ------------------------------------------------------------------

def test_q4_1_round_trip_of_shipped_weights_is_exact(shipped):
    for name, w in shipped.items():
        back = quant.q4_1_dequantize(quant.q4_1_quantize(w))
        err = (back - w).abs().max().item()
        assert err <= 1e-6, f"{name}: Q4_1 round trip off by {err}"


def test_q4_1_round_trip_with_wrong_block_layout_is_not_exact(shipped):
    # blocks along the output dimension (the transpose) group weights that were never
    # quantized together: the codes no longer land on the grid
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.mlp.down_proj.weight"]:
        wt = shipped[name].T.contiguous()
        err = (quant.q4_1_dequantize(quant.q4_1_quantize(wt)) - wt).abs().max().item()
        assert err > 1e-3, f"{name}: blocks along the output dim round-trip to {err}"
    # and blocks shifted by half a block along the input dimension
    w = shipped["model.layers.29.mlp.up_proj.weight"][:, 16:-16].contiguous()
    err = (quant.q4_1_dequantize(quant.q4_1_quantize(w)) - w).abs().max().item()
    assert err > 1e-3


def test_q4_1_layout_matches_gguf_bytes():
    torch.manual_seed(0)
    w = torch.randn(2, 64)
    b = quant.q4_1_quantize(w)
    raw = b.to_bytes()
    assert len(raw) == 2 * 2 * 20                        # 20 bytes per block of 32
    first = torch.frombuffer(bytearray(raw[:20]), dtype=torch.uint8)
    assert first[:2].view(torch.float16).item() == b.d[0, 0].item()
    assert first[2:4].view(torch.float16).item() == w[0, :32].min().half().item()
    codes = b.codes()
    assert int(first[4]) == int(codes[0, 0]) | (int(codes[0, 16]) << 4)  # weight j and j+16
    # the smallest weight of a block is code 0, the largest code 15
    assert codes[0, :32][w[0, :32].argmin()] == 0 and codes[0, :32][w[0, :32].argmax()] == 15


def test_q4_1_matches_gguf_reference_quantizer():
    from gguf import quants as gquants
    from gguf import GGMLQuantizationType
    torch.manual_seed(1)
    w = torch.randn(8, 96) * 0.05
    ours = quant.q4_1_quantize(w).to_bytes()
    theirs = gquants.quantize(w.numpy(), GGMLQuantizationType.Q4_1).tobytes()
    assert ours == theirs
    deq = gquants.dequantize(gquants.quantize(w.numpy(), GGMLQuantizationType.Q4_1),
                             GGMLQuantizationType.Q4_1)
    assert torch.equal(quant.q4_1_dequantize(quant.q4_1_quantize(w)), torch.from_numpy(deq))


def test_q8_0_round_trip_of_shipped_embedding_is_exact():
    with safe_open(str(smollm2_file()), "pt") as f:
        w = f.get_slice("model.embed_tokens.weight")[:4096]      # a twelfth of the table: fast
    q, d = formats.q8_0_quantize(w)
    assert (formats.q8_0_dequantize(q, d) - w).abs().max().item() <= 1e-6
    # one scale per row (the "int8" scheme's format) is not exact on the same table
    assert (quant.int8_dequantize(*quant.int8_quantize(w)) - w).abs().max().item() > 1e-4


def test_q8_0_matches_gguf_reference_quantizer():
    from gguf import quants as gquants
    from gguf import GGMLQuantizationType
    torch.manual_seed(2)
    w = torch.randn(6, 64) * 0.1
    blocks = gquants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    theirs = torch.from_numpy(gquants.dequantize(blocks, GGMLQuantizationType.Q8_0))
    q, d = formats.q8_0_quantize(w)
    assert torch.equal(formats.q8_0_dequantize(q, d), theirs)
    raw = torch.frombuffer(bytearray(blocks.tobytes()[:34]), dtype=torch.uint8)   # d, then 32 codes
    assert raw[:2].view(torch.float16).item() == d[0, 0].item()
    assert torch.equal(raw[2:].view(torch.int8), q[0, :32])


# -- formats -------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 64), (2, 32)])
def test_group_quantize_error_is_within_half_a_step(bits, group):
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    q, d, m = quant.group_quantize(w, bits=bits, group_size=group)
    assert q.max() <= 2 ** bits - 1 and d.shape == (16, 128 // group)
    err = (quant.group_dequantize(q, d, m) - w).abs()
    step = d.repeat_interleave(group, dim=1)
    assert (err <= step / 2 + 1e-6).all()


def test_int8_and_fp8_errors_are_small():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    q, s = quant.int8_quantize(w)
    assert q.dtype == torch.int8 and (q.abs() <= 127).all()
    assert ((quant.int8_dequantize(q, s) - w).abs() <= s[:, None] / 2 + 1e-6).all()
    w8, s8 = quant.fp8_quantize(w)
    rel = ((quant.fp8_dequantize(w8, s8) - w).abs() / w.abs().clamp_min(1e-3)).median()
    assert rel < 0.04   # e4m3: 3 mantissa bits, relative step 1/16, median error well under


def test_bad_inputs_name_the_value(tiny):
    with pytest.raises(ValueError, match="'int3'.*allowed"):
        llmlab.quantize(tiny, "int3")
    with pytest.raises(ValueError, match="group_size=48.*allowed"):
        llmlab.quantize(tiny, "int4", group_size=48)
    with pytest.raises(ValueError, match="lm_head='int3'"):
        llmlab.quantize(tiny, "int8", lm_head="int3")
    with pytest.raises(ValueError, match="bits=9"):
        quant.group_quantize(torch.randn(4, 32), bits=9)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.q4_1_quantize(torch.randn(4, 40))


# -- kernels against the reference -----------------------------------------------------------

def _layer(scheme: str, w: torch.Tensor) -> quant.QuantizedLinear:
    if scheme == "int8":
        return quant.Int8Linear(w)
    if scheme == "q8_0":
        return quant.Q8_0Linear(w)
    return quant.GroupLinear(w, group_size=32, q4_1=scheme == "q4_1")


@pytest.mark.parametrize("scheme", ["int8", "int4", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3])
def test_packed_kernel_matches_dequantized_reference(scheme, rows):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    layer = _layer(scheme, w)
    x = torch.randn(2, rows, 128)
    ref = torch.nn.functional.linear(x, layer.dequantized_weight())
    # PyTorch's packed kernels round activations (and scales) to bfloat16: ~3 digits
    with quant.use_kernels("torch"):
        assert layer.kernel_forward(x) is not None, "PyTorch's packed kernel did not run"
        err = (layer(x) - ref).abs().max().item()
        assert layer.rounds_activations(x)
    assert 1e-5 * ref.abs().max().item() < err <= 1e-2 * ref.abs().max().item(), err
    # the C decode kernels keep float32: the reference up to the order of the additions
    if cpu_gemv.available():
        with quant.use_kernels(True):
            assert layer.kernel_forward(x) is not None, "the C kernel did not run"
            assert not layer.rounds_activations(x)
            err = (layer(x) - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), err
    with quant.use_kernels(False):
        assert torch.equal(layer(x), ref)


@pytest.mark.parametrize("scheme", ["int8", "int4", "q4_1", "q8_0", "fp8"])
def test_many_rows_give_the_float32_reference_exactly(scheme):
    # prefill: more rows than GEMV_MAX_ROWS are one dequantize and a float32 matmul
    w = torch.randn(64, 128) * 0.05
    layer = quant.FP8Linear(w) if scheme == "fp8" else _layer(scheme, w)
    x = torch.randn(1, quant.linear.GEMV_MAX_ROWS + 1, 128)
    ref = torch.nn.functional.linear(x, layer.dequantized_weight())
    with quant.use_kernels(True):
        assert not layer.rounds_activations(x)
        assert torch.equal(layer(x), ref)
        if cpu_gemv.available():
            assert layer.kernel_forward(x) is not None, "the C dequantizer did not run"
    with pytest.raises(ValueError, match="use_kernels\\('fast'\\)"):
        with quant.use_kernels("fast"):
            pass


@pytest.mark.parametrize("scheme", ["int4", "q8_0", "int8"])
def test_rows_are_rows_of_the_dequantized_weight(scheme):
    torch.manual_seed(3)
    layer = _layer(scheme, torch.randn(40, 64))
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(layer.rows(ids), layer.dequantized_weight()[ids])


def test_q8_0_kernel_needs_the_signed_high_digit():
    # q = 16·hi + lo holds for negative codes only with an arithmetic shift (hi in [-8, 7])
    w = torch.full((32, 64), -0.5)
    w[:, ::3] = 0.25
    layer = quant.Q8_0Linear(w)
    x = torch.ones(1, 64)
    with quant.use_kernels("torch"):
        y = layer(x)
    assert torch.allclose(y, x @ w.T, rtol=1e-2), (y[0, :3], (x @ w.T)[0, :3])


def test_shared_projection_serves_each_part_its_slice():
    torch.manual_seed(4)
    ws = [torch.randn(n, 64) for n in (32, 16, 16)]
    shared = quant.SharedProjection(quant.Int8Linear(torch.cat(ws)), [32, 16, 16])
    alone = [quant.Int8Linear(w) for w in ws]
    x = torch.randn(2, 3, 64)
    for i in (2, 0, 1):                                   # any order
        assert torch.equal(shared.parts[i](x), alone[i](x))
    assert shared._pending[:2] == [None, None]            # nothing kept once all are served
    x2 = torch.randn(2, 3, 64)
    assert torch.equal(shared.parts[1](x2), alone[1](x2))  # a new input is a new product
    assert not torch.equal(shared.parts[0](x), shared.parts[0](x2))
    with pytest.raises(ValueError, match="add up"):
        quant.SharedProjection(quant.Int8Linear(torch.cat(ws)), [32, 16])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_fused_projections_change_no_logit(tiny, scheme):
    fused, plain = llmlab.quantize(tiny, scheme), llmlab.quantize(tiny, scheme, fuse=False)
    assert isinstance(fused.layers[0].self_attn.q_proj, quant.ProjectionSlice)
    assert isinstance(plain.layers[0].self_attn.q_proj, quant.QuantizedLinear)
    assert quant.weight_nbytes(fused) == quant.weight_nbytes(plain)
    ids = torch.tensor([[1, 5, 9, 200, 3], [4, 4, 8, 2, 11]])
    with torch.inference_mode():
        assert torch.equal(fused(ids), plain(ids))
    keys = fused.state_dict().keys()
    assert not any(k.startswith("layers.0.self_attn.q_proj") for k in keys)   # stored once


# -- the quantized model ---------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["int8", "int4", "q4_1", "fp8"])
def test_quantize_returns_new_model_and_leaves_original(tiny, tok, scheme):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    q = llmlab.quantize(tiny, scheme)
    assert q is not tiny and isinstance(q.layers[0].mlp.down_proj, quant.QuantizedLinear)
    assert isinstance(q.layers[0].mlp.gate_up_proj.fused, quant.QuantizedLinear)
    assert isinstance(tiny.layers[0].mlp.up_proj, torch.nn.Linear)
    for k, v in tiny.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert quant.weight_nbytes(q) < quant.weight_nbytes(tiny) / (1.8 if scheme == "int8" else 2.5)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.inference_mode():
        lp_ref = torch.log_softmax(tiny(ids), -1)
        lp = torch.log_softmax(q(ids), -1)
    kld = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    assert kld < 0.05, f"{scheme}: KLD {kld}"
    out = llmlab.generate(q, tok, ["Hello", "A longer prompt here"], max_new_tokens=4,
                          kv_cache="contiguous", ignore_eos=True)
    assert [len(o.token_ids) for o in out] == [4, 4]


def test_quantized_model_runs_in_the_engine(tiny, tok):
    q = llmlab.quantize(tiny, "int4")
    ref = llmlab.generate(q, tok, ["Hello there"], max_new_tokens=6, kv_cache="contiguous",
                          ignore_eos=True, chat=False)[0].token_ids  # LLM takes raw prompts
    llm = llmlab.LLM(q, tok)
    out = llm.generate(["Hello there"], llmlab.SamplingParams(max_tokens=6, temperature=0,
                                                              ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref


def test_lm_head_choice(tiny):
    q8 = llmlab.quantize(tiny, "int4", lm_head="int8")
    q32 = llmlab.quantize(tiny, "int4", lm_head="fp32")
    default = llmlab.quantize(tiny, "int4").lm_head
    assert isinstance(default, quant.RefinedHead) and default.top == 64
    assert isinstance(default.head, quant.Q8_0Linear)                          # the default
    assert isinstance(llmlab.quantize(tiny, "int4", exact_top=0).lm_head, quant.Q8_0Linear)
    assert isinstance(q8.lm_head.head, quant.Int8Linear)
    assert q8.embed_tokens.table is q8.lm_head.head      # tied: stored once
    assert q32.lm_head.weight is tiny.lm_head.weight     # shared, not copied
    assert quant.weight_nbytes(q8) < quant.weight_nbytes(q32)
    qb = llmlab.quantize(tiny, "int4", lm_head="bf16")
    assert qb.embed_tokens.table is qb.lm_head.head and qb.lm_head.head.wbf16.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="exact_top=-1"):
        llmlab.quantize(tiny, "int4", exact_top=-1)
    ids = torch.tensor([[4, 8, 15, 16]])
    assert torch.allclose(qb.embed_tokens(ids), tiny.embed_tokens(ids), rtol=1e-2, atol=1e-6)
    assert quant.weight_nbytes(q8) < quant.weight_nbytes(qb) < quant.weight_nbytes(q32)


# -- evaluation ----------------------------------------------------------------------------

def test_eval_text_is_long_enough():
    tok = llmlab.load_tokenizer("smollm2-135m")
    assert len(qeval.eval_token_ids(tok)) >= 2000


def test_compare_logits_tells_models_apart(tiny):
    ids = list(range(3, 70))
    same = qeval.compare_logits(tiny, {"self": tiny}, ids, window=16)["self"]
    assert same.kld < 1e-6 and same.top1 == 1.0 and abs(same.ppl - same.ppl_ref) < 1e-3
    q2 = llmlab.quantize(tiny, "int4", group_size=64)
    with torch.no_grad():
        coarse = qeval.compare_logits(tiny, {"int4": q2}, ids, window=16)["int4"]
    assert coarse.kld > same.kld and coarse.tokens == len(ids) - 1


def test_greedy_agreement_counts_the_common_prefix():
    g = qeval.greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert g.matched == [2, 2] and g.identical == 1 and g.fraction == 4 / 6


# -- the widget callback ---------------------------------------------------------------------

def test_explore_bits_group_reports_the_chosen_cell():
    from llmlab.viz.quant import explore_bits_group
    cfg = llmlab.load_model("tiny-llama").config
    grid = {(b, g): {"kld": 1.0 / 4 ** b, "top1": 1 - 1.0 / 2 ** b,
                     "bytes": qeval.group_format_bytes(cfg, b, g)}
            for b in (2, 4, 8) for g in (16, 32, None)}
    c = explore_bits_group(grid, 4, 32, bandwidth=1e9)
    assert c.kld == grid[(4, 32)]["kld"] and c.modelled_tok_s == pytest.approx(1e9 / c.weight_bytes)
    assert c.figure is not None
    small = explore_bits_group(grid, 4, 16, 1e9, draw=False)
    assert small.weight_bytes > c.weight_bytes          # more groups, more scales
    assert explore_bits_group(grid, 8, None, 1e9, draw=False).weight_bytes > c.weight_bytes
    with pytest.raises(ValueError, match="bits=3"):
        explore_bits_group(grid, 3, 32, 1e9)
    import matplotlib.pyplot as plt
    plt.close("all")


def test_group_format_bytes_counts_codes_and_scales():
    cfg = llmlab.load_model("tiny-llama").config
    fp32 = qeval.group_format_bytes(cfg, 32, None, head_bytes=4.0)
    assert fp32 == pytest.approx(quant.weight_nbytes(llmlab.load_model("tiny-llama")), rel=0.01)
    q4 = qeval.group_format_bytes(cfg, 4, 32)
    assert quant.weight_nbytes(llmlab.quantize(llmlab.load_model("tiny-llama"), "q4_1")) == \
        pytest.approx(q4, rel=0.02)


def test_refined_head_recomputes_the_largest_logits_exactly():
    torch.manual_seed(7)
    head = quant.Q8_0Linear(torch.randn(512, 64) * 0.05)
    refined = quant.RefinedHead(head, top=10)
    x = torch.randn(3, 2, 64) * 4
    with torch.inference_mode(), quant.use_kernels("torch"):
        fast, got = head(x), refined(x)
        exact = x @ head.dequantized_weight().T
    top = fast.topk(10, dim=-1).indices
    assert (fast - exact).abs().max() > 1e-3            # the bfloat16 kernel is off...
    assert torch.allclose(got.gather(-1, top), exact.gather(-1, top), atol=1e-5)   # ...these are not
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.equal(got[rest], fast[rest])           # the others keep the kernel's values
    with torch.inference_mode(), quant.use_kernels(True):   # float32 kernels: nothing to fix
        if not head.rounds_activations(x):
            assert torch.equal(refined(x), head(x))
    with pytest.raises(ValueError, match="top=0"):
        quant.RefinedHead(head, top=0)
    with pytest.raises(ValueError, match="top=513"):
        quant.RefinedHead(head, top=513)


@pytest.mark.parametrize("n,k", [(49152, 64), (1024, 8), (1000, 5), (256, 4)])
def test_top_indices_finds_the_same_set_as_topk(n, k):
    from llmlab.quant.linear import top_indices
    g = torch.Generator().manual_seed(n + k)
    y = torch.randn(3, n, generator=g)
    y[1, :k] += 10                                   # the k largest crowded in one block
    got = top_indices(y, k)
    want = y.topk(k, dim=-1).indices
    for r in range(3):
        assert sorted(got[r].tolist()) == sorted(want[r].tolist())
