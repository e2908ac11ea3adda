"""The grouped-GEMM kernel for MoE dispatch against its PyTorch reference (Triton interpreter on CPU)."""
import pytest
import torch

import llmlab  # noqa: F401  (TRITON_INTERPRET before the kernel is defined)
from llmlab.kernels.moe_gemm import (grouped_gemm, grouped_gemm_torch, grouped_gemm_triton,
                                     tile_table)

from .conftest import KERNEL_DEVICE


def naive(x, w, counts, scale=None):
    """Row by row: the definition the grouped GEMM must reproduce."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    y = torch.stack([w[e] @ x[i] for i, e in enumerate(owner.tolist())]) if len(owner) else \
        torch.zeros(0, w.shape[1], device=x.device)
    return y * scale[:, None] if scale is not None else y


def case(counts, k, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, k, generator=g).to(KERNEL_DEVICE, dtype)
    w = torch.randn(len(counts), n, k, generator=g).to(KERNEL_DEVICE, dtype)
    offsets = torch.tensor([0] + counts).cumsum(0).to(KERNEL_DEVICE)
    scale = torch.rand(m, generator=g).to(KERNEL_DEVICE)
    return x, w, offsets, scale


# ragged groups (not multiples of BLOCK_M=32), empty experts first, middle and last,
# K and N not multiples of BLOCK_K / BLOCK_N
@pytest.mark.parametrize("counts,k,n", [
    ([0, 37, 5, 0, 70, 1, 0], 40, 72),
    ([33], 16, 16),
    ([1, 1, 1, 1], 24, 100),
    ([0, 0, 65], 33, 17),
])
def test_triton_matches_reference_on_ragged_groups(counts, k, n):
    x, w, offsets, scale = case(counts, k, n)
    ref = naive(x, w, counts, scale)
    torch_y = grouped_gemm_torch(x, w, offsets, scale)
    tri_y = grouped_gemm_triton(x, w, offsets, scale)
    assert (torch_y - ref).abs().max() <= 1e-4
    assert (tri_y - ref).abs().max() <= 1e-4
    assert (grouped_gemm_triton(x, w, offsets) - naive(x, w, counts)).abs().max() <= 1e-4


def test_triton_handles_shared_expert_storage_and_strided_rows():
    # stride-0 expert dimension (identical experts, as upcycling builds them) and a strided x
    g = torch.Generator().manual_seed(3)
    base = torch.randn(48, 40, generator=g).to(KERNEL_DEVICE)
    w = base.unsqueeze(0).expand(5, -1, -1)
    x = torch.randn(80, 2 * 40, generator=g).to(KERNEL_DEVICE)[:, ::2]
    counts = [20, 0, 31, 29, 0]
    offsets = torch.tensor([0] + counts).cumsum(0).to(KERNEL_DEVICE)
    assert w.stride(0) == 0 and not x.is_contiguous()
    assert (grouped_gemm_triton(x, w, offsets) - x @ base.t()).abs().max() <= 1e-4


def test_all_rows_in_one_tiny_expert_and_no_rows():
    x, w, offsets, _ = case([0, 0, 3], 16, 16)
    assert (grouped_gemm_triton(x, w, offsets) - x @ w[2].t()).abs().max() <= 1e-4
    x0, w0, off0, _ = case([0, 0], 16, 16)
    assert grouped_gemm_triton(x0, w0, off0).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    # bfloat16 tiles are upcast before tl.dot in the interpreter (which would multiply their
    # raw bit patterns); compiled, both dtypes run on tensor cores
    x, w, offsets, _ = case([9, 0, 23], 64, 32, dtype=dtype)
    y = grouped_gemm_triton(x, w, offsets)
    assert y.dtype == dtype
    ref = naive(x.float(), w.float(), [9, 0, 23])
    # float32 accumulation leaves only the output's rounding: at most half an ulp, eps/2
    eps = torch.finfo(dtype).eps
    assert ((y.float() - ref).abs() <= eps * ref.abs() + 1e-4).all()


def test_tile_table_covers_every_row_once():
    counts = [0, 37, 5, 0, 70, 1, 0]
    offsets = torch.tensor([0] + counts).cumsum(0)
    experts, rows = tile_table(offsets, sum(counts), 32)
    assert experts.numel() == -(-sum(counts) // 32) + len(counts)
    covered = []
    for e, r in zip(experts.tolist(), rows.tolist()):
        if e < 0:
            continue
        covered += list(range(r, min(r + 32, int(offsets[e + 1]))))
    assert sorted(covered) == list(range(sum(counts)))
    assert (experts >= 0).sum() == sum(-(-c // 32) for c in counts)  # 0 tiles for empty experts


def test_bad_arguments_are_named():
    x, w, offsets, _ = case([3, 4], 16, 16)
    with pytest.raises(ValueError, match="offsets must be"):
        grouped_gemm_torch(x, w, offsets[:-1])
    with pytest.raises(ValueError, match="x has K=16 columns but w has K=8"):
        grouped_gemm_torch(x, w[:, :, :8], offsets)
    with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
        grouped_gemm_triton(x, w, offsets, block_m=24)
    with pytest.raises(ValueError, match="block_k=8 must be a power of two >= 16"):
        grouped_gemm_triton(x, w, offsets, block_k=8)
    with pytest.raises(ValueError, match=r"x and w must share one dtype.*x torch.float32, "
                                         r"w torch.bfloat16"):
        grouped_gemm_triton(x, w.bfloat16(), offsets)
    with pytest.raises(ValueError, match=r"unknown grouped_gemm impl 'cuda'; allowed: \['auto'"):
        grouped_gemm(x, w, offsets, impl="cuda")


@pytest.mark.gpu
def test_triton_compiled_at_realistic_size():
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [0, 1000, 3, 517, 2049, 0, 77, 450]
    m, k, n = sum(counts), 4096, 14336 // 8
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(8, n, k, device="cuda", generator=g) / k ** 0.5
    offsets = torch.tensor([0] + counts, device="cuda").cumsum(0)
    scale = torch.rand(m, device="cuda", generator=g)
    ref = grouped_gemm_torch(x.double(), w.double(), offsets, scale.double())
    assert (grouped_gemm_triton(x, w, offsets, scale).double() - ref).abs().max() <= 1e-3
    xb, wb = x.bfloat16(), w.bfloat16()
    yb = grouped_gemm_triton(xb, wb, offsets, scale)
    assert (yb.float() - grouped_gemm_torch(xb, wb, offsets, scale).float()).abs().max() <= 5e-2


def test_grouped_dispatch_works_without_triton():
    """Where `import triton` fails (macOS, Windows) the grouped dispatch still runs on its
    PyTorch path, and asking for the kernel says why it cannot."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["triton"] = None            # makes `import triton` raise ImportError
import torch
from llmlab.kernels.moe_gemm import grouped_gemm_triton, grouped_swiglu
from llmlab.layers.moe import dispatch_dense, dispatch_grouped
g = torch.Generator().manual_seed(0)
x = torch.randn(6, 8, generator=g)
wg, wu, wd = (torch.randn(4, 16, 8, generator=g), torch.randn(4, 16, 8, generator=g),
              torch.randn(4, 8, 16, generator=g))
weights = torch.softmax(torch.randn(6, 2, generator=g), -1)
experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
err = (dispatch_grouped(x, weights, experts, wg, wu, wd)
       - dispatch_dense(x, weights, experts, wg, wu, wd)).abs().max().item()
assert err < 1e-5, err
try:
    grouped_gemm_triton(x, wg, torch.tensor([0, 2, 4, 6, 6]))
except RuntimeError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs Triton, which is not installed" in out.stdout
