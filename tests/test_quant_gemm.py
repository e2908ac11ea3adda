"""The dequantize-in-GEMM Triton kernel (int8 and int4 weights) against dequantize-then-matmul
(Triton interpreter on CPU, compiled on CUDA)."""
import pytest
import torch

import llmlab  # noqa: F401  (TRITON_INTERPRET before the kernel is defined)
from llmlab.kernels.quant_gemm import int4_gemm, int8_gemm
from llmlab.quant import formats
from llmlab.quant.linear import GroupLinear, Int8Linear

from .conftest import KERNEL_DEVICE

# N and K are not multiples of the block sizes used (BLOCK_N 32 or 64, BLOCK_K 16, 32, 64)
N, K = 72, 96


def weight(n=N, k=K, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def activations(m, k=K, dtype=torch.float32, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(KERNEL_DEVICE, dtype)


def int4_parts(w, group_size):
    codes, d, m = formats.group_quantize(w, bits=4, group_size=group_size)
    d, m = d.half(), m.half()
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)          # code 2j low nibble, 2j+1 high
    dense = formats.group_dequantize(codes, d, m)
    return [t.to(KERNEL_DEVICE) for t in (packed, d, m)], dense


def check(y, x, dense, dtype):
    """|y - x @ denseᵀ| elementwise within the output's rounding (one ulp: the interpreter's
    float32 -> bfloat16 cast truncates) plus, compiled, the weight tile's rounding to the
    activations' dtype (half an ulp of each product) and float32 accumulation."""
    assert y.dtype == dtype and y.shape == (x.shape[0], dense.shape[0])
    xd, wd = x.double().cpu(), dense.double()
    ref = xd @ wd.t()
    err = (y.double().cpu() - ref).abs()
    if dtype == torch.float32:
        bound = 1e-5 * (xd.abs() @ wd.abs().t()) + 1e-6
    else:
        eps = torch.finfo(dtype).eps
        bound = eps * ref.abs() + (eps / 2 + 1e-5) * (xd.abs() @ wd.abs().t())
    worst = (err / bound).max().item()
    assert worst <= 1, (f"max error {err.max().item():.3g} is {worst:.2f}x the bound "
                        f"(max |ref| {ref.abs().max().item():.3g})")


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_dequantize_then_matmul(m, dtype):
    q, scale = formats.int8_quantize(weight(k=88))       # K=88: no block size divides it
    x = activations(m, k=88, dtype=dtype)
    y = int8_gemm(x, q.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE))
    check(y, x, formats.int8_dequantize(q, scale), dtype)


# block_k 16: each K tile lies in one group of 32 (one d, m per column); block_k 64: a tile
# holds two groups (d, m gathered per input), and K=96 leaves a ragged last tile
@pytest.mark.parametrize("m,block_k", [(1, 64), (3, 16), (17, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_dequantize_then_matmul(m, block_k, dtype):
    (packed, d, mins), dense = int4_parts(weight(), 32)
    x = activations(m, dtype=dtype)
    y = int4_gemm(x, packed, d, mins, 32, block_k=block_k)
    check(y, x, dense, dtype)


def test_float16_and_other_group_sizes():
    (packed, d, mins), dense = int4_parts(weight(), 48)        # block_k defaults to 16
    x = activations(3, dtype=torch.float16)
    check(int4_gemm(x, packed, d, mins, 48), x, dense, torch.float16)
    (packed, d, mins), dense = int4_parts(weight(), 16)        # block_k 32: two groups
    x = activations(2)
    check(int4_gemm(x, packed, d, mins, 16, block_m=16, block_n=16), x, dense, torch.float32)


def test_the_layers_stored_tensors_are_the_kernels_layout():
    """What QuantizedLinear's CUDA branch passes: the layer's own buffers, leading dims kept."""
    w = weight(40, 64, seed=3)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    for layer in (Int8Linear(w), GroupLinear(w, group_size=32), GroupLinear(w, q4_1=True)):
        ref = layer.reference_forward(x)
        layer = layer.to(KERNEL_DEVICE)
        xk = x.to(KERNEL_DEVICE)
        if isinstance(layer, Int8Linear):
            y = int8_gemm(xk, layer.qweight, layer.scale)
        else:
            y = int4_gemm(xk, layer.packed_codes, layer.d, layer.m, layer.group_size)
        assert y.shape == (2, 3, 40)
        err = (y.cpu() - ref).abs().max().item()
        assert err <= 1e-4, f"{layer.scheme}: max error {err:.3g} against reference_forward"


def test_no_rows_gives_an_empty_result():
    q, scale = formats.int8_quantize(weight())
    assert int8_gemm(activations(0), q.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE)).shape == (0, N)


def test_bad_arguments_are_named():
    q, scale = (t.to(KERNEL_DEVICE) for t in formats.int8_quantize(weight()))
    (packed, d, mins), _ = int4_parts(weight(), 32)
    x = activations(2)
    with pytest.raises(ValueError, match="block_n=48 must be a power of two >= 16"):
        int8_gemm(x, q, scale, block_n=48)
    with pytest.raises(ValueError, match="block_m=8 must be a power of two >= 16"):
        int4_gemm(x, packed, d, mins, block_m=8)
    with pytest.raises(ValueError, match=r"x must be a float32, float16 or bfloat16.*torch.int32"):
        int8_gemm(x.int(), q, scale)
    with pytest.raises(ValueError, match=r"weight codes must be a 2-D torch.int8.*torch.uint8"):
        int8_gemm(x, packed, scale)
    with pytest.raises(ValueError, match=r"x has K=80 columns.*expected \[N, 80\]"):
        int8_gemm(x[:, :80], q, scale)
    with pytest.raises(ValueError, match=r"scale must be \[N\] = \[72\]"):
        int8_gemm(x, q, scale[:10])
    with pytest.raises(ValueError, match="codes must be contiguous"):
        int8_gemm(x, q.t().contiguous().t(), scale)
    with pytest.raises(ValueError, match="group_size=40 must be an int >= 2 dividing K=96"):
        int4_gemm(x, packed, d, mins, 40)
    with pytest.raises(ValueError, match=r"d and m must be \[N, K/group_size\] = \[72, 2\]"):
        int4_gemm(x, packed, d, mins, 48)
    (packed48, d48, mins48), _ = int4_parts(weight(), 48)
    with pytest.raises(ValueError, match="group_size=48 and block_k=32: one must be a multiple"):
        int4_gemm(x, packed48, d48, mins48, 48, block_k=32)
    with pytest.raises(ValueError, match="int4 needs an even K"):
        int4_gemm(x[:, :95], packed, d, mins)
