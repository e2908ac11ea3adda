"""Every Triton kernel built ahead of time for A100 (sm_80) and H100 (sm_90), no GPU needed.

The default run builds a representative subset (the head_dim-128 autotune tiles of the
FlashAttention kernel, where registers are tightest, on both targets; its largest
head_dim-64 tile; the paged and MoE kernels' default tiles; split-KV's partials and merge;
the quantized GEMM's decode tile, int4 and int8; the fused norm, SwiGLU and q/k/v + RoPE
kernels at their largest accepted shapes, one build each per target). ``LLMLAB_COMPILE=full``
(``make gpu-compile``) builds the whole matrix of ``python -m llmlab.kernels.report
--full``: every kernel, tile, mask variant and dtype on both targets.
"""
import json
import os
import subprocess
import sys

import pytest

from llmlab.kernels import flash_attn, moe_gemm
from llmlab.kernels import report as R

FULL = os.environ.get("LLMLAB_COMPILE") == "full"
# the minimal FlashAttention-2 forward (plain pointers, an off-band and an on-band loop)
# built by the same Triton for sm_90 has three spill-free tiles at head_dim 128
MINIMAL_FA2_SPILL_FREE_D128 = 3


def _subset() -> list[R.BuildSpec]:
    out = []
    for arch in R.ARCHS:
        out += [R.flash_spec(arch, "bf16", 128, *t)
                for t in flash_attn.tile_configs(arch, 128, "bf16")]
        largest = max(flash_attn.tile_configs(arch, 64, "fp16"), key=lambda t: t[0] * t[1] * t[2])
        out.append(R.flash_spec(arch, "fp16", 64, *largest, key_range=True))
        out.append(R.paged_spec(arch, "bf16", 64, 16))
        # split-KV decode: its half-precision tile, the float32 head_dim-128 tile where
        # registers are tightest, and the merge
        out += [R.paged_split_spec(arch, "bf16", 64, 16),
                R.paged_split_spec(arch, "fp32", 128, 16), R.lse_merge_spec(arch, "bf16", 128)]
        out.append(R.moe_spec(arch, "bf16"))
        out += [R.quant_spec(arch, "bf16", int4=True), R.quant_spec(arch, "bf16", int4=False)]
        # the fused elementwise kernels where registers are tightest (no dots: cheap builds)
        out += [R.add_rmsnorm_spec(arch, "bf16", max(R.RMSNORM_HIDDEN)),
                R.swiglu_spec(arch, "bf16"),
                R.qkv_rope_spec(arch, "fp32", *R.QKV_ROPE_HEADS[-1])]
    return out


# float32 paged attention at head_dim 128 with 64 keys per step: float32 dots keep their
# operands in registers (no tensor cores), more than 255 per thread (the wrapper uses 32
# keys there). Built with the others; the report must see its spill.
SPILLING = R.paged_spec("sm_90", "fp32", 128, 16, block_n=64)


@pytest.fixture(scope="module")
def all_builds():
    todo = R.specs(full=True) if FULL else _subset()
    return R.build_all(todo + [SPILLING], jobs=None if FULL else 2)


@pytest.fixture(scope="module")
def builds(all_builds):
    return all_builds[:-1]


@pytest.mark.slow
def test_every_kernel_builds_for_both_targets(builds):
    assert {(b.kernel, b.arch) for b in builds} == {(k, a) for k in R.KERNELS for a in R.ARCHS}
    for b in builds:
        assert 0 < b.registers <= 255, b
        if R.SOURCES[b.kernel].dots:              # tiles staged in shared memory
            assert b.shared_bytes > 0, b


@pytest.mark.slow  # builds with ptxas (the module's fixture)
def test_no_build_spills_registers(builds):
    spilling = [f"{b.kernel} {b.variant} {b.config} {b.arch} {b.dtype}: {b.spill_bytes} B"
                for b in builds if b.spills]
    assert not spilling, spilling


@pytest.mark.slow  # builds with ptxas (the module's fixture)
def test_shared_memory_fits_each_target(builds):
    over = [(b.kernel, b.config, b.arch, b.shared_bytes) for b in builds
            if not b.fits_shared_memory]
    assert not over, over


@pytest.mark.slow  # builds with ptxas (the module's fixture)
def test_half_precision_builds_use_tensor_cores(builds):
    for b in builds:
        if b.dtype == "fp32" or not R.SOURCES[b.kernel].dots:
            continue
        assert b.tensor_core_instructions > 0, b
        if b.arch == "sm_80":
            assert b.tensor_core_ops["HGMMA"] == 0, b          # wgmma is sm_90 only
    # 64 or more query rows per tile take the warpgroup (wgmma) path on H100
    wide = [b for b in builds if b.kernel == "flash" and b.arch == "sm_90" and b.dtype != "fp32"
            and int(b.config.split("x")[0]) >= 64]
    assert wide and all(b.tensor_core_ops["HGMMA"] > 0 for b in wide)


@pytest.mark.slow  # builds with ptxas (the module's fixture)
def test_every_autotune_tile_was_built(builds):
    built = {(b.arch, b.dtype, b.config) for b in builds if b.kernel == "flash"}
    for arch in R.ARCHS:
        for d in (64, 128) if FULL else (128,):
            for dtype in ("fp16", "bf16", "fp32") if FULL else ("bf16",):
                for t in flash_attn.tile_configs(arch, d, dtype):
                    assert (arch, dtype, R.flash_spec(arch, dtype, d, *t).config) in built


@pytest.mark.parametrize("arch", list(R.ARCHS))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_enough_spill_free_tiles_per_head_dim(arch, dtype):
    # the lists themselves; the builds above prove each one spill-free
    for d in (64, 128):
        assert len(flash_attn.tile_configs(arch, d, dtype)) >= 2
    assert len(flash_attn.tile_configs("sm_90", 128, dtype)) >= MINIMAL_FA2_SPILL_FREE_D128


@pytest.mark.slow  # builds with ptxas (the module's fixture)
def test_a_tile_too_large_for_the_register_file_is_reported_as_spilling(all_builds):
    bad = all_builds[-1]
    assert (bad.kernel, bad.config, bad.dtype) == ("paged", SPILLING.config, "fp32")
    assert bad.spills and bad.registers == 255
    assert R.problems([bad]) and "spills" in R.problems([bad])[0]
    assert R.paged_spec("sm_90", "fp32", 128, 16).config.startswith("16x32 ")   # the wrapper's


def test_occupancy_against_the_arch_limits():
    # 255 registers -> 8192 per warp (units of 256) -> 8 warps per SM -> one 8-warp block
    occ = R.occupancy("sm_90", 255, 1024, 8)
    assert (occ.blocks_per_sm, occ.fraction, occ.limiter) == (1, 8 / 64, "registers")
    # 64 registers, 4 warps: registers allow 32 warps = 8 blocks; 20 KiB + 1 KiB reserved
    # shared memory allows 164 // 21 = 7 blocks on A100 and 228 // 21 = 10 on H100
    assert R.occupancy("sm_80", 64, 20 * 1024, 4).blocks_per_sm == 7
    assert R.occupancy("sm_90", 64, 20 * 1024, 4).blocks_per_sm == 8
    assert R.occupancy("sm_90", 32, 0, 1).blocks_per_sm == 32            # the block limit
    assert R.occupancy("sm_80", 100, 164 * 1024, 4).blocks_per_sm == 0   # over 163 KiB per block
    assert R.occupancy("sm_90", 100, 164 * 1024, 4).blocks_per_sm == 1


@pytest.mark.slow
def test_report_command_prints_one_json_object_per_build():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "llmlab.kernels.report", "--kernel", "moe",
                          "--arch", "sm_80", "--dtype", "bf16", "--json", "--jobs", "1"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == len(moe_gemm.gpu_tiles("bf16"))
    for row in rows:
        assert row["kernel"] == "moe" and row["arch"] == "sm_80" and row["dtype"] == "bf16"
        assert {"registers", "spill_bytes", "shared_bytes", "occupancy",
                "tensor_core_instructions"} <= set(row)
        assert row["tensor_core_ops"]["HMMA"] > 0
    # the same builds (cached now) as the human-readable table and its summary
    res = subprocess.run([sys.executable, "-m", "llmlab.kernels.report", "--kernel", "moe",
                          "--arch", "sm_80", "--dtype", "bf16", "--jobs", "1"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "spill_free" in res.stdout and f"moe     {len(rows)}" in res.stdout


def test_fused_kernels_spec_the_wrappers_limits():
    from llmlab.kernels import fused
    assert max(R.RMSNORM_HIDDEN) == fused.MAX_HIDDEN
    h, kv, d = R.QKV_ROPE_HEADS[-1]
    c = dict(R.qkv_rope_spec("sm_90", "fp32", h, kv, d).constants)
    assert c["BLOCK_H"] * c["BLOCK_HALF"] == fused.MAX_HEAD_TILE
    c = dict(R.add_rmsnorm_spec("sm_90", "bf16", 576).constants)
    assert c["BLOCK"] == 1024 and not c["BF16_BITS"]
    no_dots = [R._result(R.swiglu_spec("sm_80", "bf16"), 28, 0, 0, {"HMMA": 0, "HGMMA": 0})]
    assert R.problems(no_dots) == []              # no dots: no tensor cores expected
    assert R.summary(no_dots)[0]["fp16/bf16 with tensor cores"] == "no dots"


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown arch \['sm_75'\]; allowed"):
        R.specs(archs=("sm_75",))
    with pytest.raises(ValueError, match="dtype='fp8'"):
        flash_attn.tile_configs("sm_90", 64, "fp8")
    with pytest.raises(ValueError, match="head_dim=96"):
        flash_attn.tile_configs("sm_90", 96, "bf16")
