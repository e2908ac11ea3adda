"""llmlab.kernels.cpu_gemv: the C decode kernels against the dequantize-then-matmul reference,
at ragged sizes, several row counts and thread counts; a wrong layout is caught."""
from __future__ import annotations

import platform

import pytest
import torch

from llmlab.kernels import cpu_gemv
from llmlab.quant import formats

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler: "
                                "the layers keep PyTorch's kernels")

ROWS = [1, 2, 3, 4, 5, 8, 9]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def test_the_build_says_what_runs_here():
    line = cpu_gemv.describe()
    assert "AVX2" in line or "plain C" in line, line


# the formats with one code per weight: (quantize, dequantize, kernel), and the shapes to try
# (q8_0 needs K % 32 == 0; the others take ragged K)
SCALED = {"int8": (formats.int8_quantize, formats.int8_dequantize, cpu_gemv.int8_gemv),
          "q8_0": (formats.q8_0_quantize, formats.q8_0_dequantize, cpu_gemv.q8_0_gemv),
          "fp8": (formats.fp8_quantize, formats.fp8_dequantize, cpu_gemv.fp8_gemv)}
SHAPES = {"int8": [(37, 40), (64, 576), (17, 7), (130, 1536)],
          "q8_0": [(33, 64), (100, 576)], "fp8": [(37, 40), (64, 576)]}


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("fmt, n, k", [(f, n, k) for f, shapes in SHAPES.items() for n, k in shapes])
def test_scaled_formats_match_the_dequantized_matmul(fmt, n, k, m, threads):
    quantize, dequantize, kernel = SCALED[fmt]
    g = torch.Generator().manual_seed(n * k + m)
    w = torch.randn(n, k, generator=g)
    w[0, :6] = torch.tensor([1e-9, -1e-9, 3e-3, 0.0, 5.0, -5.0])[:k]  # fp8: subnormal codes
    q, s = quantize(w)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ dequantize(q, s).double().T
    y = kernel(x, q, s)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert _rel(y.double(), ref) < 1e-5, f"max rel error {_rel(y.double(), ref):.1e}"


def test_int8_is_exact_on_integers():
    # small integers: every product and partial sum is exact in float32, so any order of the
    # additions gives the same bits; a kernel that drops the tail (K % 16) or a row is off
    q = torch.randint(-127, 128, (23, 45), dtype=torch.int8)
    scale = torch.ones(23)
    x = torch.randint(-3, 4, (5, 45)).float()
    assert torch.equal(cpu_gemv.int8_gemv(x, q, scale), x @ q.float().T)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("group, k", [(32, 320), (64, 320), (128, 384), (32, 32 * 70)])
@pytest.mark.parametrize("n", [19, 96])
def test_q4_matches_the_dequantized_matmul(m, group, k, n, threads):
    # several groups, K % 128 != 0; 70 groups: more than the kernel widens d for at once
    g = torch.Generator().manual_seed(group + n + m)
    w = torch.randn(n, k, generator=g)
    codes, d, mn = formats.group_quantize(w, bits=4, group_size=group)
    d, mn = d.half(), mn.half()
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    x = torch.randn(m, k, generator=g)
    ref = x.double() @ formats.group_dequantize(codes, d, mn).double().T
    y = cpu_gemv.q4_gemv(x, packed, d, mn, group)
    assert _rel(y.double(), ref) < 1e-5, f"max rel error {_rel(y.double(), ref):.1e}"


def test_q4_nibble_order_is_checked():
    # the same codes packed high-nibble-first (a plausible wrong layout) must not match
    k, n = 64, 8
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d, mn = torch.full((n, 2), 0.5).half(), torch.zeros(n, 2).half()
    x = torch.randn(1, k)
    ref = x @ formats.group_dequantize(codes, d, mn).T
    right = codes[:, 0::2] | (codes[:, 1::2] << 4)
    wrong = codes[:, 1::2] | (codes[:, 0::2] << 4)
    assert torch.allclose(cpu_gemv.q4_gemv(x, right, d, mn, 32), ref, atol=1e-4)
    assert not torch.allclose(cpu_gemv.q4_gemv(x, wrong, d, mn, 32), ref, atol=1e-2)


def test_bad_shapes_are_refused_with_the_values():
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        cpu_gemv.int8_gemv(torch.zeros(1, 32), q, torch.ones(4))
    packed = torch.zeros(4, 48, dtype=torch.uint8)                       # K = 96
    d = torch.zeros(4, 2).half()
    with pytest.raises(ValueError, match="group_size=48"):
        cpu_gemv.q4_gemv(torch.zeros(1, 96), packed, d, d, 48)
    with pytest.raises(ValueError, match="K % 32"):
        cpu_gemv.q8_0_gemv(torch.zeros(1, 40), torch.zeros(4, 40, dtype=torch.int8),
                           torch.zeros(4, 1).half())


def _every_format(w: torch.Tensor):
    """w in each stored layout: (int8 q, scale), (q4 packed, codes, d, m), (q8_0 q, d), (fp8, scale)."""
    codes, d, mn = formats.group_quantize(w, bits=4, group_size=32)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return (formats.int8_quantize(w), (packed, codes, d.half(), mn.half()),
            formats.q8_0_quantize(w), formats.fp8_quantize(w))


def test_the_plain_c_loops_agree_with_the_vector_path(tmp_path, monkeypatch):
    # the portable build (no -march=native: no AVX2 on x86-64) is what runs on other CPUs
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path))
    lib = cpu_gemv._open(cpu_gemv._build(cpu_gemv._compiler(), native=False))
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(21, 96, generator=g), torch.randn(3, 96, generator=g)
    (q, scale), (packed, codes, d, mn), (q8, d8), (w8, s8) = _every_format(w)
    refs = [x @ formats.int8_dequantize(q, scale).T, x @ formats.group_dequantize(codes, d, mn).T,
            x @ formats.q8_0_dequantize(q8, d8).T, x @ formats.fp8_dequantize(w8, s8).T]

    def run():
        return [cpu_gemv.int8_gemv(x, q, scale), cpu_gemv.q4_gemv(x, packed, d, mn, 32),
                cpu_gemv.q8_0_gemv(x, q8, d8), cpu_gemv.fp8_gemv(x, w8, s8)]

    fast = run()
    monkeypatch.setitem(cpu_gemv._LIB, "lib", lib)
    if platform.machine() == "x86_64":
        assert lib.llmlab_vector_width() == 1, "the portable build took the AVX2 path"
    plain = run()
    for name, ref, a, b in zip(["int8", "q4", "q8_0", "fp8"], refs, fast, plain):
        assert _rel(a, ref) < 1e-5 and _rel(b, ref) < 1e-5, name
    assert torch.equal(cpu_gemv.dequantize("q4", packed, 96, d=d, m=mn, group_size=32),
                       formats.group_dequantize(codes, d, mn))
    assert torch.equal(cpu_gemv.dequantize("fp8", w8, 96, scale=s8), formats.fp8_dequantize(w8, s8))
    assert torch.equal(cpu_gemv.dequantize("q8_0", q8, 96, d=d8), formats.q8_0_dequantize(q8, d8))


def test_fp8_decodes_every_finite_code_exactly():
    # one row per code: x = e_k picks column k, so y is the decoded weight itself
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                         # e4m3fn's NaNs
    w8 = codes.view(torch.float8_e4m3fn).reshape(1, -1).contiguous()
    x = torch.eye(w8.shape[1])
    y = cpu_gemv.fp8_gemv(x, w8, torch.ones(1))[:, 0]
    assert torch.equal(y, w8.float()[0]), (y - w8.float()[0]).abs().max()


def test_dequantize_is_bit_for_bit_the_pytorch_formats():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(23, 96, generator=g)
    w[0, :4] = torch.tensor([1e-9, -3e-7, 0.0, 4.0])
    (q, scale), (packed, codes, d, mn), (q8, d8), (w8, s8) = _every_format(w)
    pairs = {
        "int8": (cpu_gemv.dequantize("int8", q, 96, scale=scale), formats.int8_dequantize(q, scale)),
        "q4": (cpu_gemv.dequantize("q4", packed, 96, d=d, m=mn, group_size=32),
               formats.group_dequantize(codes, d, mn)),
        "q8_0": (cpu_gemv.dequantize("q8_0", q8, 96, d=d8), formats.q8_0_dequantize(q8, d8)),
        "fp8": (cpu_gemv.dequantize("fp8", w8, 96, scale=s8), formats.fp8_dequantize(w8, s8)),
    }
    for name, (got, want) in pairs.items():
        assert torch.equal(got, want), f"{name}: max |diff| {(got - want).abs().max():.1e}"
    # int8 with K not a multiple of 16 (the scalar tail)
    q7, s7 = formats.int8_quantize(torch.randn(5, 21, generator=g))
    assert torch.equal(cpu_gemv.dequantize("int8", q7, 21, scale=s7), formats.int8_dequantize(q7, s7))
