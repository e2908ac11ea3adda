"""llmlab.quant.gptq: GPTQ rounding for the int8 scheme (same scales as round-to-nearest,
codes chosen to keep each layer's outputs close on calibration inputs)."""
from __future__ import annotations

import pytest
import torch

import llmlab
from llmlab import quant
from llmlab.quant import eval as qeval
from llmlab.quant import gptq

CAL_TOKENS = 512       # small calibration: keeps the end-to-end test well under a minute


@pytest.fixture(scope="module")
def cal_ids(tokenizer):
    return gptq.calibration_token_ids(tokenizer, CAL_TOKENS)


@pytest.fixture(scope="module")
def hessians(smollm2, cal_ids):
    return gptq.collect_hessians(smollm2, cal_ids)


def _output_error(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, H: torch.Tensor) -> float:
    """‖X Wᵀ − X Ŵᵀ‖ / √n over the inputs X whose second moment is H = XᵀX / n:
    ‖X Δᵀ‖² / n = Σ_rows δ H δᵀ."""
    d = w.double() - quant.int8_dequantize(q, s).double()
    return ((d @ H.double()) * d).sum().sqrt().item()


# Measured with 512 calibration tokens (the shipped calibration text): GPTQ's output error
# on the calibration inputs is 3.2–5.9x below round-to-nearest's on these layers; required: 2x.
LAYERS = [(0, "self_attn.q_proj"), (3, "self_attn.v_proj"), (7, "mlp.down_proj"),
          (15, "self_attn.o_proj"), (20, "mlp.gate_proj")]
FACTOR = 2.0


def _check_better_than_rtn(w, q, s, H):
    q_rtn, s_rtn = quant.int8_quantize(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    assert torch.equal(s, s_rtn), "the scales must be round-to-nearest's, exactly"
    rtn, got = _output_error(w, q_rtn, s_rtn, H), _output_error(w, q, s, H)
    assert got * FACTOR < rtn, f"output error {got:.3e} not {FACTOR}x below RTN's {rtn:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("layer,name", LAYERS)
def test_gptq_lowers_the_layer_output_error(smollm2, hessians, layer, name):
    w = smollm2.layers[layer].get_submodule(name).weight.detach()
    H = hessians[(layer, name)]
    _check_better_than_rtn(w, *gptq.gptq_int8(w, H), H)


def test_the_check_rejects_rounding_without_error_compensation(smollm2, hessians):
    w = smollm2.layers[15].self_attn.o_proj.weight.detach()
    H = hessians[(15, "self_attn.o_proj")]
    with pytest.raises(AssertionError, match="not 2.0x below"):        # plain RTN codes
        _check_better_than_rtn(w, *quant.int8_quantize(w), H)
    # GPTQ with H = I sees uncorrelated inputs: nothing to compensate, it is RTN again
    q_eye, s_eye = gptq.gptq_int8(w, torch.eye(w.shape[1]))
    assert torch.equal(q_eye, quant.int8_quantize(w)[0])
    with pytest.raises(AssertionError, match="not 2.0x below"):
        _check_better_than_rtn(w, q_eye, s_eye, H)
    # codes of the permuted order put back in the wrong place (act_order not undone)
    q, s = gptq.gptq_int8(w, H)
    perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    with pytest.raises(AssertionError, match="not 2.0x below"):
        _check_better_than_rtn(w, q[:, perm], s, H)


def test_act_order_off_and_blocks_still_help(smollm2, hessians):
    w = smollm2.layers[3].self_attn.v_proj.weight.detach()
    H = hessians[(3, "self_attn.v_proj")]
    a = gptq.gptq_int8(w, H, block=128)
    b = gptq.gptq_int8(w, H, block=7)   # lazy blocks change the order of float32 sums only:
    assert (a[0] != b[0]).float().mean() < 1e-2          # a few codes near a tie flip
    assert _output_error(w, *b, H) == pytest.approx(_output_error(w, *a, H), rel=0.02)
    q, s = gptq.gptq_int8(w, H, act_order=False)
    assert _output_error(w, q, s, H) < _output_error(w, *quant.int8_quantize(w), H)


@pytest.mark.slow
def test_hessians_are_shared_by_layers_with_one_input(smollm2, hessians, cal_ids):
    cfg = smollm2.config
    assert len(hessians) == 7 * cfg.num_layers
    for i in (0, cfg.num_layers - 1):
        q, k, v = (hessians[(i, f"self_attn.{n}_proj")] for n in "qkv")
        assert q is k is v
        assert hessians[(i, "mlp.gate_proj")] is hessians[(i, "mlp.up_proj")]
        assert hessians[(i, "self_attn.o_proj")] is not q
        assert hessians[(i, "mlp.down_proj")].shape == (cfg.intermediate_size,) * 2
        assert q.dtype == torch.float32 and torch.allclose(q, q.T)
    # H = XᵀX / n, against the inputs captured directly (two windows of 256 tokens)
    seen = []
    h = smollm2.layers[2].mlp.down_proj.register_forward_hook(
        lambda m, inp, out: seen.append(inp[0].reshape(-1, inp[0].shape[-1]).double()))
    try:
        got = gptq.collect_hessians(smollm2, cal_ids, window=256)
    finally:
        h.remove()
    X = torch.cat(seen)
    assert X.shape[0] == len(cal_ids)
    ref = (X.T @ X / X.shape[0]).float()
    assert torch.allclose(got[(2, "mlp.down_proj")], ref, rtol=1e-5, atol=1e-6)
    # windows are fresh contexts: another window size sees other inputs
    assert not torch.allclose(got[(2, "mlp.down_proj")], hessians[(2, "mlp.down_proj")],
                              rtol=1e-3, atol=1e-5)


def test_dead_inputs_get_round_to_nearest_codes():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.05
    w[5] = 0                                                   # an all-zero row, as RTN's
    X = torch.randn(256, 64) @ torch.randn(64, 64) * 0.3       # correlated inputs
    dead = torch.tensor([3, 17, 40, 63])
    X[:, dead] = 0
    H = X.T @ X / X.shape[0]
    q, s = gptq.gptq_int8(w, H)
    q_rtn, s_rtn = quant.int8_quantize(w)
    assert torch.equal(s, s_rtn) and torch.equal(q[5], torch.zeros_like(q[5]))
    assert torch.equal(q[:, dead], q_rtn[:, dead])
    assert (q[:, :3] != q_rtn[:, :3]).any()                    # the live inputs: GPTQ's codes
    assert _output_error(w, q, s, H) < 0.9 * _output_error(w, q_rtn, s_rtn, H)
    # no live input at all: nothing to compensate
    q0, _ = gptq.gptq_int8(w, torch.zeros(64, 64))
    assert torch.equal(q0, q_rtn)


def test_bad_arguments_name_the_value():
    w, H = torch.randn(8, 16), torch.eye(16)
    with pytest.raises(ValueError, match=r"w must be .*got \(16,\)"):
        gptq.gptq_int8(torch.randn(16), H)
    with pytest.raises(ValueError, match=r"\[16, 16\].*got \(8, 8\)"):
        gptq.gptq_int8(w, torch.eye(8))
    for damp in (0, -0.1, 2.0, "0.01", True):
        with pytest.raises(ValueError, match=f"damp={damp!r}"):
            gptq.gptq_int8(w, H, damp=damp)
    with pytest.raises(ValueError, match="block=0"):
        gptq.gptq_int8(w, H, block=0)
    with pytest.raises(ValueError, match="act_order='yes'"):
        gptq.gptq_int8(w, H, act_order="yes")
    bad = torch.eye(16)
    bad[0, 1] = bad[1, 0] = 3.0                                 # not positive semi-definite
    with pytest.raises(ValueError, match="not positive definite"):
        gptq.gptq_int8(w, bad)
    with pytest.raises(ValueError, match="finite"):
        gptq.gptq_int8(w, torch.full((16, 16), float("nan")))


def test_quantize_options_are_checked(tiny, tiny_tok):
    with pytest.raises(ValueError, match="rounding='best'.*allowed.*'rtn', 'gptq'"):
        llmlab.quantize(tiny, "int8", rounding="best")
    with pytest.raises(ValueError, match="'int8' only.*'int4' allowed: \\['rtn'\\]"):
        llmlab.quantize(tiny, "int4", rounding="gptq", calibration=[1, 2, 3])
    with pytest.raises(ValueError, match="calibration token ids for model 'tiny-llama'"):
        llmlab.quantize(tiny, "int8", rounding="gptq")
    with pytest.raises(ValueError, match="rounding='gptq' or equalize=True only"):
        llmlab.quantize(tiny, "int8", calibration=[1, 2, 3])
    with pytest.raises(ValueError, match="token"):
        llmlab.quantize(tiny, "int8", rounding="gptq", calibration=[1, -4])
    with pytest.raises(ValueError, match="max_tokens=0"):
        gptq.calibration_token_ids(tiny_tok, 0)
    with pytest.raises(ValueError, match="equalize=True is implemented for scheme 'int8' only"):
        llmlab.quantize(tiny, "int4", equalize=True, calibration=[1, 2, 3])
    with pytest.raises(ValueError, match="equalize=1 must be True or False"):
        llmlab.quantize(tiny, "int8", equalize=1, calibration=[1, 2, 3])


def test_from_codes_stores_the_codes_as_given():
    torch.manual_seed(2)
    w = torch.randn(40, 64)
    q, s = quant.int8_quantize(w)
    a, b = quant.Int8Linear(w), quant.Int8Linear.from_codes(q, s)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scale, b.scale)
    x = torch.randn(3, 64)
    for kernels in (True, False):
        with quant.use_kernels(kernels):
            assert torch.equal(a(x), b(x))
    q2 = q.clone()
    q2[0, 0] = 127 if q[0, 0] != 127 else -127                 # any code, not re-quantized
    assert quant.Int8Linear.from_codes(q2, s).qweight[0, 0] == q2[0, 0]
    with pytest.raises(ValueError, match="q must be an int8 matrix"):
        quant.Int8Linear.from_codes(q.float(), s)
    with pytest.raises(ValueError, match=r"scale must be .*\[40\]"):
        quant.Int8Linear.from_codes(q, s[:-1])


def test_fused_and_separate_projections_get_the_same_codes(tiny):
    ids = list(range(3, 300))
    fused = llmlab.quantize(tiny, "int8", rounding="gptq", calibration=ids)
    plain = llmlab.quantize(tiny, "int8", rounding="gptq", calibration=ids, fuse=False)
    for i in range(tiny.config.num_layers):
        for role, (fname, names) in quant.FUSED.items():
            block_f, block_p = getattr(fused.layers[i], role), getattr(plain.layers[i], role)
            parts = getattr(block_f, fname).fused.qweight.split(
                [getattr(block_p, n).out_features for n in names])
            for n, q in zip(names, parts):
                diff = (q != getattr(block_p, n).qweight).float().mean().item()
                assert diff < 1e-3, f"layer {i} {n}: {diff:.1%} of codes differ"
    rtn = llmlab.quantize(tiny, "int8")
    assert not torch.equal(fused.layers[0].mlp.down_proj.qweight,
                           rtn.layers[0].mlp.down_proj.qweight)


@pytest.fixture(scope="module")
def gptq_model(smollm2, cal_ids):
    return llmlab.quantize(smollm2, "int8", rounding="gptq", calibration=cal_ids)


@pytest.mark.slow
def test_gptq_model_generates_and_is_closer_to_float32(smollm2, tokenizer, gptq_model):
    assert gptq_model.quant_options["rounding"] == "gptq"
    rtn = llmlab.quantize(smollm2, "int8")
    assert rtn.quant_options["rounding"] == "rtn"
    g_fused = gptq_model.layers[4].self_attn.qkv_proj.fused
    r_fused = rtn.layers[4].self_attn.qkv_proj.fused
    assert torch.equal(g_fused.scale, r_fused.scale)
    assert not torch.equal(g_fused.qweight, r_fused.qweight)
    assert quant.weight_nbytes(gptq_model) == quant.weight_nbytes(rtn)
    out = llmlab.generate(gptq_model, tokenizer, ["What is the capital of France?"],
                          max_new_tokens=8, kv_cache="contiguous")
    assert len(out[0].token_ids) >= 1 and out[0].text.strip()
    ids = qeval.eval_token_ids(tokenizer, 512)
    with torch.inference_mode(), quant.use_kernels(False):
        q = qeval.compare_logits(smollm2, {"rtn": rtn, "gptq": gptq_model}, ids, window=512)
    # measured (512 calibration tokens, reference path): RTN 3.1e-3, GPTQ 2.1e-3 (0.69x)
    assert q["gptq"].kld < 0.85 * q["rtn"].kld, (q["gptq"].kld, q["rtn"].kld)
