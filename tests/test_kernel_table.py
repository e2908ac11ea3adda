"""The committed table of ahead-of-time builds that notebooks 03, 04 and 06 show
(data/kernel_builds.json, written by ``python -m llmlab.kernels.report --widget-table``).

It must hold every tile the widgets offer, agree with what the compiler makes of the
kernels today (a few entries are rebuilt and compared), and the widgets must draw it.
"""
import copy
import importlib.util

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from llmlab.device import has_triton  # noqa: E402
from llmlab.kernels import report as R  # noqa: E402

HAS_TRITON = has_triton() and importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_every_widget_tile_has_an_entry():
    entries = R.table_entries()
    assert len(entries) == sum(len(R.widget_tiles(k)) for k in R.WIDGET_TILES) \
        * len(R.ARCHS) * len(R.WIDGET_DTYPES)
    for kernel in R.WIDGET_TILES:
        for arch in R.ARCHS:
            for dtype in R.WIDGET_DTYPES:
                for tile in R.widget_tiles(kernel):
                    b = R.lookup(kernel, arch, dtype, **tile)
                    assert (b.kernel, b.arch, b.dtype) == (kernel, arch, dtype)
                    assert 0 < b.registers <= 255 and b.shared_bytes > 0, b
    from llmlab.profiling.hbm import CHIPS          # the chips notebook 03's widget offers
    assert set(CHIPS) <= set(R.CHIP_ARCH) and set(R.CHIP_ARCH.values()) == set(R.ARCHS)
    meta = R.table_meta()
    assert meta["widget_tiles"] == {k: {n: list(v) for n, v in t.items()}
                                    for k, t in R.WIDGET_TILES.items()}
    assert {"triton", "date", "archs", "command"} <= set(meta)


def test_lookup_matches_the_spec_and_refuses_what_it_lacks():
    b = R.lookup("flash", "H200", "fp16", block_m=64, block_n=32, head_dim=128)
    assert b.arch == "sm_90" and b.num_warps == 4                  # chip name; default warps
    assert b.config == R.flash_spec("sm_90", "fp16", 128, 64, 32, 4, 3).config
    assert b.tensor_core_instructions == sum(b.tensor_core_ops.values())
    occ = R.occupancy(b.arch, b.registers, b.shared_bytes, b.num_warps)
    assert (b.occupancy, b.blocks_per_sm) == (occ.fraction, occ.blocks_per_sm)
    with pytest.raises(R.MissingBuild, match=r"no flash build for .*'block_m': 256"):
        R.lookup("flash", "sm_90", "bf16", block_m=256, block_n=64, head_dim=64)
    with pytest.raises(R.MissingBuild, match="fp32"):
        R.lookup("moe", "sm_80", "fp32", block_m=32, block_n=64, block_k=32)
    with pytest.raises(ValueError, match=r"arch='sm_75'; allowed"):
        R.lookup("paged", "sm_75", block_size=16, head_dim=64)
    with pytest.raises(ValueError, match=r"kernel='conv'; allowed"):
        R.lookup("conv", "sm_90")
    with pytest.raises(ValueError, match=r"got \['block_q'\]"):
        R.lookup("flash", "sm_90", block_q=64, block_n=64, head_dim=64)


@pytest.mark.skipif(not HAS_TRITON, reason="the autotuner's tile list imports Triton")
def test_the_table_shows_why_a_large_tile_is_bad():
    from llmlab.kernels.flash_attn import tile_configs
    # 128 query rows x head_dim 128 on 4 warps: a 128x128 fp32 accumulator is 128 registers
    # per thread before Q, the score tile and addresses; the build spills
    bad = R.lookup("flash", "sm_90", "bf16", block_m=128, block_n=128, head_dim=128)
    assert bad.spills and bad.registers == 255
    assert bad.tensor_core_ops["HGMMA"] > 0
    # the autotuner's tiles at head_dim 128 (one of them at 4 warps) do not spill
    tuned = [R.lookup("flash", "sm_90", "bf16", block_m=bm, block_n=bn, head_dim=128,
                      num_warps=w) for bm, bn, w, s in tile_configs("sm_90", 128, "bf16")
             if s == 3 and bm in R.WIDGET_TILES["flash"]["block_m"]]
    assert tuned and not any(b.spills for b in tuned)
    assert all(b.occupancy > bad.occupancy for b in tuned)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="building needs Triton (Linux)")
def test_rebuilt_entries_equal_the_table():
    import triton
    wanted = [("flash", "sm_90", "bf16", dict(block_m=128, block_n=128, head_dim=128,
                                              num_warps=4)),
              ("paged", "sm_80", "fp16", dict(block_size=16, head_dim=64)),
              ("moe", "sm_90", "bf16", dict(block_m=32, block_n=64, block_k=32))]
    entries = [e for w in wanted for e in R.table_entries()
               if (e["spec"]["kernel"], e["spec"]["arch"], e["spec"]["dtype"], e["tile"]) == w]
    assert len(entries) == len(wanted)
    rebuilt = R.build_all([R._spec_from_json(e["spec"]) for e in entries], jobs=2)
    stale = R.stale_entries(entries, rebuilt)
    # a Triton upgrade that changes the builds makes the table stale: it fails here, with
    # the command that rebuilds it, instead of skipping
    assert stale == [], (f"the table was built with Triton {R.table_meta()['triton']}, this is "
                         f"{triton.__version__}; regenerate it with `make kernel-table`: {stale}")
    # the comparison sees a wrong table
    wrong = copy.deepcopy(entries)
    wrong[0]["result"]["registers"] -= 8
    wrong[2]["result"]["tensor_core_ops"]["HGMMA"] += 1
    stale = R.stale_entries(wrong, rebuilt)
    assert len(stale) == 2 and "registers is" in stale[0] and "tensor_core_ops" in stale[1]


def test_paged_widget_draws_the_build_of_the_chosen_block_size():
    from llmlab.cache import waste
    from llmlab.viz import paged as pviz
    reqs = [waste.TraceRequest(20, 30), waste.TraceRequest(50, 10)]
    sweep = waste.block_size_sweep(reqs, 512, block_sizes=(4, 16, 64))
    fig = pviz.plot_block_size_tradeoff(16, sweep, {4: 2.0, 16: 1.0, 64: 0.8}, "cpu", chip="A100")
    panel = fig.axes[2]
    b = R.lookup("paged", "sm_80", "bf16", block_size=16, head_dim=64)
    assert "compiled for A100 (sm_80)" in panel.get_title() and b.config in panel.get_title()
    bars = [p.get_width() for p in panel.patches]
    assert bars[0] == pytest.approx(b.registers / 255)
    assert bars[1] == pytest.approx(b.shared_bytes / R.ARCHS["sm_80"].shared_per_block)
    assert bars[2] == pytest.approx(b.occupancy)
    assert len(pviz.plot_block_size_tradeoff(16, sweep, {16: 1.0}, "cpu").axes) == 2


def test_moe_tile_explorer_counts_padding_and_shows_the_build():
    from llmlab.viz.moe import gemm_tile_explorer
    r = gemm_tile_explorer(64, 128, 32, chip="H100", tokens=40, measure=HAS_TRITON)
    assert r.rows == 80 and r.padded_rows % 64 == 0 and r.padded_rows >= r.rows
    small = gemm_tile_explorer(16, 128, 32, tokens=40, measure=False)
    assert r.padded_rows - r.rows >= small.padded_rows - small.rows
    assert r.build == R.lookup("moe", "sm_90", "bf16", block_m=64, block_n=128, block_k=32)
    assert "SPILLS" not in r.figure.axes[0].get_xlabel() or r.build.spills
    if HAS_TRITON:
        assert r.measured_spread[0] <= r.measured_s <= r.measured_spread[1]
    with pytest.raises(ValueError, match="block_k=24"):
        gemm_tile_explorer(32, 64, 24, measure=False)
