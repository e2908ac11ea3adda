"""Fused kernels (llmlab.kernels.fused) against their PyTorch references (llmlab.layers.fused),
the references against the model's own layers, and fuse_model on whole models.

Kernels run in the Triton interpreter on a CPU, compiled where there is CUDA. Tolerances:
float32 kernel outputs within 8 units of float32 round-off of the largest reference value
(the sum of squares and cos/sin are computed in another order or library; measured: 1-4
units); float16/bfloat16 outputs within one unit in the last place of each element (the
kernels round where PyTorch's ops round; measured: bit for bit in the interpreter). The
residual stream h, v and the references against the model's layers are bit for bit.
"""
import pytest
import torch

import llmlab
from llmlab.compile import graphs_compiled
from llmlab.kernels import fused as K
from llmlab.layers import MLP, RMSNorm, RotaryEmbedding
from llmlab.layers import fused as R
from llmlab.layers.rotary import inverse_frequencies

from .conftest import KERNEL_DEVICE

F32_ULPS = 8
PROMPTS = ["What is the capital of France?", "Hello"]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def on_kernel(*tensors):
    return [None if t is None else t.to(KERNEL_DEVICE) for t in tensors]


def assert_close(out, ref, dtype):
    """float32: max |out - ref| <= 8 eps · max |ref|; half: within one ulp of each element."""
    out, ref = out.double().cpu(), ref.double().cpu()
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32:
        bound = F32_ULPS * eps * ref.abs().max().item()
        assert (out - ref).abs().max().item() <= bound, (out - ref).abs().max().item()
    else:
        bound = eps * ref.abs() + torch.finfo(dtype).tiny
        assert bool(((out - ref).abs() <= bound).all()), (out - ref).abs().max().item()


# -- kernels against references ----------------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("hidden", [576, 100])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rmsnorm_kernel_matches_reference(tokens, hidden, residual):
    x = torch.randn(tokens, hidden, generator=gen(tokens)) * 3
    r = torch.randn(tokens, hidden, generator=gen(hidden)) if residual else None
    w = torch.randn(hidden, generator=gen(7))
    ref, ref_h = R.add_rmsnorm(x, r, w, 1e-5)
    out, h = K.add_rmsnorm(*on_kernel(x, r, w), 1e-5)
    assert out.shape == h.shape == (tokens, hidden)
    assert torch.equal(h.cpu(), ref_h)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("inter", [1536, 100])   # 1536: a full block of 1024 and a ragged one
def test_swiglu_kernel_matches_reference(tokens, inter):
    gu = torch.randn(tokens, 2 * inter, generator=gen(inter)) * 4
    out = K.swiglu(*on_kernel(gu))
    assert out.shape == (tokens, inter)
    assert_close(out, R.swiglu(gu), torch.float32)


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (5, 1, 24)])
def test_qkv_rope_kernel_matches_reference(tokens, heads, kv_heads, head_dim):
    # (5, 1, 24): head counts and a half head_dim (12) that are not powers of two
    qkv = torch.randn(2, tokens, (heads + 2 * kv_heads) * head_dim, generator=gen(tokens))
    pos = torch.randint(0, 8000, (2, tokens), generator=gen(1))
    inv = inverse_frequencies(head_dim, 1e5)
    ref = R.qkv_rope(qkv, pos, inv, heads, kv_heads, head_dim)
    out = K.qkv_rope(*on_kernel(qkv, pos, inv), heads, kv_heads, head_dim)
    assert [t.shape for t in out] == [(2, tokens, heads, head_dim),
                                      (2, tokens, kv_heads, head_dim),
                                      (2, tokens, kv_heads, head_dim)]
    assert_close(out[0], ref[0], torch.float32)
    assert_close(out[1], ref[1], torch.float32)
    assert torch.equal(out[2].cpu(), ref[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_in_half_precision(dtype):
    # the interpreter truncates float32 -> bfloat16; the kernels round on the bits there
    x, r = (torch.randn(17, 100, generator=gen(i)).to(dtype) for i in (1, 2))
    w = torch.randn(100, generator=gen(3)).to(dtype)
    ref, ref_h = R.add_rmsnorm(x, r, w, 1e-5)
    out, h = K.add_rmsnorm(*on_kernel(x, r, w), 1e-5)
    assert out.dtype == h.dtype == dtype
    assert torch.equal(h.cpu(), ref_h)
    assert_close(out, ref, dtype)
    gu = (torch.randn(3, 200, generator=gen(4)) * 4).to(dtype)
    assert_close(K.swiglu(*on_kernel(gu)), R.swiglu(gu), dtype)
    qkv = torch.randn(17, 15 * 64, generator=gen(5)).to(dtype)
    pos = torch.randint(0, 2000, (17,), generator=gen(6))
    inv = inverse_frequencies(64, 1e5)
    ref = R.qkv_rope(qkv, pos, inv, 9, 3, 64)
    out = K.qkv_rope(*on_kernel(qkv, pos, inv), 9, 3, 64)
    for o, e in zip(out, ref):
        assert o.dtype == dtype
        assert_close(o, e, dtype)


def test_kernels_take_strided_rows_and_empty_inputs():
    x = torch.randn(4, 2 * 100, generator=gen(1))[:, :100]        # row stride 200
    w = torch.randn(100, generator=gen(2))
    out, _ = K.add_rmsnorm(*on_kernel(x, None, w), 1e-5)
    assert_close(out, R.add_rmsnorm(x, None, w, 1e-5)[0], torch.float32)
    empty = torch.zeros(0, 100, device=KERNEL_DEVICE)
    out, h = K.add_rmsnorm(empty, empty, w.to(KERNEL_DEVICE), 1e-5)
    assert out.shape == h.shape == (0, 100)
    assert K.swiglu(torch.zeros(0, 8, device=KERNEL_DEVICE)).shape == (0, 4)


# -- references against the model's layers ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_reference_is_the_models_norm(dtype):
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=gen(1)))
    x, r = (torch.randn(3, 5, 576, generator=gen(i)).to(dtype) for i in (2, 3))
    out, h = R.add_rmsnorm(x, r, norm.weight, norm.eps)
    assert torch.equal(h, r + x)
    assert torch.equal(out, norm(r + x))


def test_swiglu_reference_is_the_models_mlp():
    mlp = MLP(64, 96)
    x = torch.randn(2, 5, 64, generator=gen(1))
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    assert torch.equal(mlp.down_proj(R.swiglu(gate_up)), mlp(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_reference_is_the_models_rotary(dtype):
    heads, kv_heads, d = 9, 3, 64
    rotary = RotaryEmbedding(d, 1e5)
    q = torch.randn(2, 7, heads, d, generator=gen(1)).to(dtype)
    k, v = (torch.randn(2, 7, kv_heads, d, generator=gen(i)).to(dtype) for i in (2, 3))
    pos = torch.arange(30, 37).expand(2, 7)
    ref_q, ref_k = rotary(q, k, pos)
    qkv = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
    out_q, out_k, out_v = R.qkv_rope(qkv, pos, rotary.inv_freq, heads, kv_heads, d)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k) and torch.equal(out_v, v)


# -- whole models -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_greedy(tiny, tiny_tok):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 13), generator=gen(0))
    gens = llmlab.generate(tiny, tiny_tok, PROMPTS, max_new_tokens=16, kv_cache="contiguous",
                           ignore_eos=True)
    return ids, tiny(ids), [g.token_ids for g in gens]


def fused_tiny(backend):
    model = llmlab.load_model("tiny-llama", attention="sdpa")
    return R.fuse_model(on_kernel_model(model, backend), backend)


def on_kernel_model(model, backend):
    return model.to(KERNEL_DEVICE) if backend == "triton" else model


# the Triton model runs in the interpreter on a CPU: seconds, so `make test-fast` skips it
@pytest.mark.parametrize("backend,max_err", [("torch", 1e-5),
                                             pytest.param("triton", 1e-4, marks=pytest.mark.slow)])
def test_fused_tiny_llama_gives_the_same_logits_and_greedy_tokens(backend, max_err, tiny_tok,
                                                                  tiny_greedy):
    ids, ref_logits, ref_tokens = tiny_greedy
    model = fused_tiny(backend)
    layer = model.layers[0]
    assert isinstance(layer, R.FusedDecoderLayer) and model.fused == backend
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert layer.self_attn.qkv_proj.weight.shape == ((8 + 2 * 4) * 16, 64)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert layer.mlp.swiglu is (K.swiglu if backend == "triton" else R.swiglu)
    logits = model(ids.to(model.device)).cpu()
    err = (logits - ref_logits).abs().max().item()
    print(f"{backend}: logits max error {err:.2e}")
    assert err < max_err
    # the Triton kernels in the interpreter: one cache is enough (both serve the same layers)
    for kv_cache in ("contiguous", "static") if backend == "torch" else ("contiguous",):
        gens = llmlab.generate(model, tiny_tok, PROMPTS, max_new_tokens=16, kv_cache=kv_cache,
                               ignore_eos=True)
        assert [g.token_ids for g in gens] == ref_tokens, kv_cache


def test_fused_model_keeps_the_attention_knob(tiny_greedy):
    ids, ref_logits, _ = tiny_greedy
    model = fused_tiny("torch").set_attention("naive")
    assert model.layers[1].self_attn.backend is llmlab.attention.get("naive")
    assert (model(ids) - ref_logits).abs().max().item() < 1e-5


def test_fused_quantized_model_uses_its_shared_projections(tiny_tok):
    from llmlab.quant import quantize

    def load():
        return quantize(llmlab.load_model("tiny-llama", attention="sdpa"), "int8")

    ref = llmlab.generate(load(), tiny_tok, PROMPTS, max_new_tokens=8, kv_cache="contiguous",
                          ignore_eos=True)
    model = R.fuse_model(load())
    assert type(model.layers[0].self_attn.qkv_proj).__name__ == "Int8Linear"
    gens = llmlab.generate(model, tiny_tok, PROMPTS, max_new_tokens=8, kv_cache="contiguous",
                           ignore_eos=True)
    assert [g.token_ids for g in gens] == [g.token_ids for g in ref]


@pytest.mark.slow   # compiles a graph: ~10 s
def test_fused_model_compiles_without_recompiles(tiny_tok, tiny_greedy):
    _, _, ref_tokens = tiny_greedy
    model = fused_tiny("torch")
    gens = llmlab.generate(model, tiny_tok, PROMPTS, max_new_tokens=16, kv_cache="static",
                           ignore_eos=True, compile=True)
    assert [g.token_ids for g in gens] == ref_tokens
    before = graphs_compiled()
    llmlab.generate(model, tiny_tok, PROMPTS, max_new_tokens=40, kv_cache="static",
                    ignore_eos=True, compile=True)
    assert graphs_compiled() == before


def test_fused_smollm2_gives_the_same_tokens(smollm2, tokenizer):   # slow: loads SmolLM2
    ids = tokenizer(["The capital of France is"], return_tensors="pt").input_ids
    fused = R.fuse_model(llmlab.load_model("smollm2-135m", device="cpu"))
    err = (fused(ids) - smollm2(ids)).abs().max().item()
    print(f"SmolLM2 fused (torch): logits max error {err:.2e}")
    assert err < 1e-3
    kw = dict(max_new_tokens=16, kv_cache="contiguous", ignore_eos=True)
    ref = llmlab.generate(smollm2, tokenizer, PROMPTS, **kw)
    out = llmlab.generate(fused, tokenizer, PROMPTS, **kw)
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]


# -- bad input ------------------------------------------------------------------------------

BOTH = [pytest.param(R, id="torch"), pytest.param(K, id="triton")]


@pytest.mark.parametrize("impl", BOTH)
def test_bad_norm_arguments_are_named(impl):
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"weight must be \[hidden\] = \[8\]; got \(7,\)"):
        impl.add_rmsnorm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match=r"residual has shape \(3, 9\)"):
        impl.add_rmsnorm(x, torch.randn(3, 9), w, 1e-5)
    with pytest.raises(ValueError, match="residual has dtype torch.bfloat16"):
        impl.add_rmsnorm(x, x.bfloat16(), w, 1e-5)
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        impl.add_rmsnorm(torch.ones(3, 8, dtype=torch.long), None, w, 1e-5)
    with pytest.raises(ValueError, match="eps=0"):
        impl.add_rmsnorm(x, None, w, 0)


@pytest.mark.parametrize("impl", BOTH)
def test_bad_swiglu_and_qkv_arguments_are_named(impl):
    with pytest.raises(ValueError, match="last dim 7 must be even"):
        impl.swiglu(torch.randn(2, 7))
    inv = inverse_frequencies(16, 1e4)
    pos = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="num_heads=5 is not a multiple of num_kv_heads=2"):
        impl.qkv_rope(torch.randn(3, 9 * 16), pos, inv, 5, 2, 16)
    with pytest.raises(ValueError, match=r"\[\.\.\., 128\]; got shape \(3, 127\)"):
        impl.qkv_rope(torch.randn(3, 127), pos, inv, 4, 2, 16)
    with pytest.raises(ValueError, match="head_dim=15 must be even"):
        impl.qkv_rope(torch.randn(3, 60), pos, inv, 2, 1, 15)
    with pytest.raises(ValueError, match=r"positions has shape \(4,\)"):
        impl.qkv_rope(torch.randn(3, 128), torch.zeros(4, dtype=torch.long), inv, 4, 2, 16)
    with pytest.raises(ValueError, match="positions must be an integer tensor; got torch.float32"):
        impl.qkv_rope(torch.randn(3, 128), pos.float(), inv, 4, 2, 16)
    with pytest.raises(ValueError, match=r"inv_freq must be \[head_dim / 2\] = \[8\]"):
        impl.qkv_rope(torch.randn(3, 128), pos, inv[:4], 4, 2, 16)
    with pytest.raises(ValueError, match="num_kv_heads=0 must be a positive int"):
        impl.qkv_rope(torch.randn(3, 128), pos, inv, 4, 0, 16)


def test_kernel_limits_are_named():
    x = torch.randn(1, K.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match=f"hidden={K.MAX_HIDDEN + 1} is over {K.MAX_HIDDEN}"):
        K.add_rmsnorm(x, None, torch.ones(K.MAX_HIDDEN + 1), 1e-5)
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16, x torch.float32"):
        K.add_rmsnorm(torch.randn(2, 8), None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    inv = inverse_frequencies(256, 1e4)
    with pytest.raises(ValueError, match="num_heads=65 with head_dim=256 is a tile of 128 x 128"):
        K.qkv_rope(torch.randn(1, 67 * 256), torch.zeros(1, dtype=torch.long), inv, 65, 1, 256)


def test_fuse_model_refusals(tiny):
    with pytest.raises(ValueError, match="backend='cuda'; allowed"):
        R.fuse_model(tiny, "cuda")
    model = R.fuse_model(llmlab.load_model("tiny-llama", attention="sdpa"))
    with pytest.raises(ValueError, match="already fused"):
        R.fuse_model(model)
    with pytest.raises(ValueError, match="needs an llmlab CausalLM; got Linear"):
        R.fuse_model(torch.nn.Linear(2, 2))
