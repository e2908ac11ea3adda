"""The analytic HBM-traffic model of notebook 03."""
import pytest

from llmlab.attention.flash import FULL_BLOCK, MASKED_BLOCK, block_schedule
from llmlab.profiling.flops import attention_bytes, attention_flops
from llmlab.profiling.hbm import (A100, CHIPS, H100, H200, chip, kv_elements_loaded,
                                  paper_block_sizes, q_rows_loaded, roofline_seconds,
                                  standard_attention_hbm,
                                  tile_footprint, tiled_attention_hbm,
                                  tiled_attention_hbm_for_sram)


def test_standard_counts_by_hand_and_agrees_with_flops_module():
    t = standard_attention_hbm(4, 2, bytes_per_el=1)
    assert (t.read, t.write) == (3 * 4 * 2 + 2 * 16, 2 * 16 + 4 * 2)
    for n, d in [(128, 64), (1000, 128)]:
        ours = standard_attention_hbm(n, d, batch=2, heads=3, bytes_per_el=2).total
        assert ours == attention_bytes(2, 3, 3, n, n, d, bytes_per_el=2)


def test_standard_is_quadratic_tiled_is_linear_in_blocks():
    a = standard_attention_hbm(4096, 64).total
    b = standard_attention_hbm(8192, 64).total
    assert 3.9 < b / a < 4.0            # N² dominates
    # tiled with Br=Bc=N: every block once -> just Q, K, V read and O written
    one = tiled_attention_hbm(256, 64, 256, 256)
    assert (one.read, one.write) == (3 * 256 * 64 * 2, 256 * 64 * 2)
    # halving Br doubles the K/V passes
    t128 = tiled_attention_hbm(8192, 64, 128, 64).read - 8192 * 64 * 2
    t64 = tiled_attention_hbm(8192, 64, 64, 64).read - 8192 * 64 * 2
    assert t64 == 2 * t128


def test_fa1_counts_by_hand():
    # N=4, d=2, Br=Bc=2: two K/V blocks, each pass reads all 4 rows of Q, O, ℓ, m
    t = tiled_attention_hbm(4, 2, 2, 2, order="fa1", bytes_per_el=1)
    assert t.read == 2 * 4 * 2 + 2 * 4 * (2 * 2 + 2)      # K, V once; Q, O, ℓ, m twice
    assert t.write == (4 * 2 + 2 * 4) + 2 * 4 * (2 + 2)   # initial O, ℓ, m; O, ℓ, m twice
    # FA1 passes are counted in K/V blocks (Bc), FA2 passes in Q blocks (Br)
    assert tiled_attention_hbm(512, 64, 16, 64, order="fa1") == \
        tiled_attention_hbm(512, 64, 128, 64, order="fa1")
    assert tiled_attention_hbm(512, 64, 64, 16) == tiled_attention_hbm(512, 64, 64, 128)
    with pytest.raises(ValueError, match=r"order='fa3' is not one of \('fa1', 'fa2'\)"):
        tiled_attention_hbm(16, 8, 4, 4, order="fa3")


def test_fa1_traffic_keeps_falling_as_sram_grows():
    """Theorem 2 of the FlashAttention paper: Θ(N²d²/M), falling for every M, also past
    M = 4d² where the paper's Br stops growing (Br = min(⌈M/4d⌉, d))."""
    n, d = 8192, 64
    std = standard_attention_hbm(n, d).total
    sizes_kib = [8, 16, 32, 48, 64, 128, 164, 228]
    traffic = [tiled_attention_hbm_for_sram(n, d, kib * 1024).total for kib in sizes_kib]
    assert all(a > b for a, b in zip(traffic, traffic[1:]))
    assert paper_block_sizes(d, 8 * 1024) == (16, 16)
    assert paper_block_sizes(d, 48 * 1024) == (64, 96)     # Br capped at d, Bc still grows
    # past the cap the traffic still falls: 32 KiB -> 64 KiB halves the passes
    io = 2 * n * d * 2 + (n * d + 2 * n) * 2               # K, V read once; O, ℓ, m initialized
    t32, t64 = (tiled_attention_hbm_for_sram(n, d, kib * 1024).total - io for kib in (32, 64))
    assert t32 == 2 * t64
    # ∝ 1/M: 4× the SRAM, 4× fewer passes
    t8, t32 = (tiled_attention_hbm_for_sram(n, d, kib * 1024).total - io for kib in (8, 32))
    assert t8 == 4 * t32
    # tiles smaller than the FA1 break-even move more than the naive algorithm
    assert traffic[0] > std > traffic[2]


def test_fa2_order_scales_with_block_q():
    n, d = 8192, 64
    std = standard_attention_hbm(n, d).total
    small = tiled_attention_hbm(n, d, 16, 64)
    big = tiled_attention_hbm(n, d, 128, 64)
    assert big.total < std < small.total
    io = 2 * n * d * 2
    assert (small.total - io) == 8 * (big.total - io)


def test_causal_loads_only_blocks_the_schedule_visits():
    n, bq, bk = 200, 32, 16
    grid = block_schedule(n, n, bq, bk, causal=True)
    visited_keys = 0
    for row in grid:
        for j, state in enumerate(row.tolist()):
            if state in (FULL_BLOCK, MASKED_BLOCK):
                visited_keys += min(bk, n - j * bk)
    assert kv_elements_loaded(n, bq, bk, causal=True) == visited_keys
    full = kv_elements_loaded(n, bq, bk, causal=False)
    assert full == 7 * n and visited_keys < 0.65 * full
    # FA1 order: per key block, the rows of every Q block with a visited tile
    visited_rows = sum(min(bq, n - i * bq) for i, row in enumerate(grid)
                       for state in row.tolist() if state in (FULL_BLOCK, MASKED_BLOCK))
    assert q_rows_loaded(n, bq, bk, causal=True) == visited_rows
    assert q_rows_loaded(n, bq, bk, causal=False) == 13 * n


def test_tile_footprint_and_fit():
    f = tile_footprint(128, 64, 128, bytes_per_el=2)
    assert f.q == 128 * 128 * 2 and f.kv == 2 * 64 * 128 * 2
    assert f.total == 32768 + 32768 + 32768 + 65536 + 1024
    assert f.fits(H100) and f.fits(A100)
    assert not tile_footprint(256, 256, 128, stages=3).fits(H100)


def test_presets_and_errors():
    assert set(CHIPS) == {"A100", "H100", "H200"} and chip("H200") is H200
    assert A100.sram_bandwidth == 19e12 and 19e6 < A100.sram_total < 22e6
    assert H200.hbm_bandwidth > H100.hbm_bandwidth > A100.hbm_bandwidth
    with pytest.raises(ValueError, match=r"unknown chip 'V100'; allowed: \['A100', 'H100', 'H200'\]"):
        chip("V100")
    with pytest.raises(ValueError, match=r"block_q=0 must be a positive int"):
        tiled_attention_hbm(10, 8, 0, 4)


def test_roofline_time():
    t = standard_attention_hbm(4096, 64, heads=16)
    f = attention_flops(1, 16, 4096, 4096, 64)
    assert roofline_seconds(t, f, H100) == pytest.approx(max(t.total / 3.35e12, f / 989e12))
    assert attention_flops(1, 1, 64, 64, 8, causal=True) == 4 * 8 * 64 * 65 // 2
