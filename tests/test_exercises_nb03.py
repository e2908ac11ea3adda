"""Notebook 03's exercises beyond the generic registry test: the float64 reference and the
mistakes it imitates, the backend adapter, the memory-growth fit, the Triton skeleton, and
the path where Triton is not installed."""
import subprocess
import sys

import pytest
import torch

import llmlab.attention as A
from llmlab import exercises
from llmlab.device import has_triton
from llmlab.exercises import nb03

from .conftest import KERNEL_DEVICE


def _bshd(x):  # [b, h, n, d] -> the backends' [b, n, h, d]
    return x.transpose(1, 2)


@pytest.mark.parametrize("n_q,n_k,causal", [(9, 9, True), (5, 13, True), (9, 13, False)])
def test_reference_matches_naive_backend(n_q, n_k, causal):
    q, k, v = nb03._qkv(n_q, n_k, heads=6, kv_heads=2, d=8)
    want = A.get("naive").forward(_bshd(q), _bshd(k), _bshd(v), causal=causal)
    got = nb03.reference_attention(q, k, v, causal=causal)
    assert torch.allclose(_bshd(got).float(), want, atol=1e-5)


def test_reference_mistakes_differ_from_the_reference():
    q, k, v = nb03._qkv(5, 13, heads=4, kv_heads=2, d=8)
    right = nb03.reference_attention(q, k, v)
    for kw in ({"top_left": True}, {"keys": 8}, {"scale": 1.0}, {"head_of": "modulo"}):
        assert (nb03.reference_attention(q, k, v, **kw) - right).abs().max() > 1e-2, kw
    with pytest.raises(ValueError, match=r"head_of='x' is not one of"):
        nb03.reference_attention(q, k, v, head_of="x")


def test_as_backend_runs_the_solution_in_the_backend_layout():
    A.register("test_nb03_solution", nb03.as_backend(nb03._solution_flash_forward, 4, 8))
    q, k, v = nb03._qkv(11, 19, heads=6, kv_heads=3, d=8)
    got = A.get("test_nb03_solution").forward(_bshd(q), _bshd(k), _bshd(v), causal=True)
    want = A.get("naive").forward(_bshd(q), _bshd(k), _bshd(v), causal=True)
    assert torch.allclose(got, want, atol=1e-5)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[0, :3] = False
    with pytest.raises(ValueError, match="takes no padding"):
        A.get("test_nb03_solution").forward(_bshd(q), _bshd(k), _bshd(v), key_padding_mask=mask)
    with pytest.raises(ValueError, match="is not 1/√d"):
        A.get("test_nb03_solution").forward(_bshd(q), _bshd(k), _bshd(v), softmax_scale=1.0)


def test_peak_memory_exponent_separates_tiled_from_naive():
    tiled, peaks = nb03._peak_exponent(nb03._solution_flash_forward)
    naive, _ = nb03._peak_exponent(nb03._naive_forward)
    assert tiled < 1.2 < 1.8 < naive
    assert peaks[0] < peaks[1] < peaks[2]


def test_predict_uses_the_measurement_it_is_given():
    ex = exercises.get("nb03.predict_peak_memory")
    assert ex.check(20, measured=30.0).passed
    v = ex.check(100, measured=30.0)
    assert not v.passed and "3.3× the measurement" in v.message
    assert not ex.check(-1, measured=30.0).passed


@pytest.mark.skipif(not has_triton(), reason="Triton is not installed")
def test_triton_skeleton_with_the_solution_matches_reference_at_ragged_sizes():
    from llmlab.exercises.flash_triton_skeleton import flash_forward_with, _solution_inner_loop

    # compiled where there is CUDA, whose float32 dots may run in TF32 (as the checker allows)
    atol = 1e-4 if KERNEL_DEVICE.type == "cpu" else 5e-3
    for n_q, n_k, causal in [(20, 20, True), (3, 35, True), (33, 17, False)]:
        q, k, v = nb03._qkv(n_q, n_k, batch=1, heads=2, kv_heads=1, d=16, device=KERNEL_DEVICE)
        got = flash_forward_with(_solution_inner_loop, q, k, v, causal=causal).cpu()
        want = nb03.reference_attention(q.cpu(), k.cpu(), v.cpu(), causal=causal)
        assert (got.double() - want).abs().max() < atol
    q, k, v = nb03._qkv(8, 8, batch=1, heads=2, kv_heads=1, d=8)
    with pytest.raises(ValueError, match="head_dim=8 must be a power of two >= 16"):
        flash_forward_with(_solution_inner_loop, q, k, v)
    q, k, v = nb03._qkv(8, 8, batch=1, heads=2, kv_heads=1, d=16)
    with pytest.raises(ValueError, match="block_n=24 must be a power of two >= 16"):
        flash_forward_with(_solution_inner_loop, q, k, v, block_n=24)


@pytest.mark.slow
def test_without_triton_the_stretch_is_absent_and_the_cells_say_so():
    """Where `import triton` fails (macOS), notebook 03 still imports and runs: the stretch
    exercise is not registered, and the Triton cells print one line instead."""
    code = """
import sys
sys.modules["triton"] = None            # makes `import triton` raise ImportError
import llmlab
from llmlab import exercises
from llmlab.device import TRITON_MISSING, has_triton
from llmlab.exercises import nb03
from llmlab.viz.flash import flash_explorer
assert not has_triton()
mine = sorted(n for n in exercises._REGISTRY if n.startswith("nb03."))
assert "nb03.flash_triton_inner_loop" not in mine and "nb03.flash_forward" in mine, mine
r = flash_explorer(block_q=32, block_k=32, head_dim=64, n=256, measure=True)
assert r.measured_s is None and "Triton is not installed" in r.measured_what
print(TRITON_MISSING)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("skipped: Triton is not installed")
