"""Build every Triton kernel of the workbook for A100 and H100, on any machine, and report
what the compiler made of each tile (shown in notebooks 03, 04 and 06).

    python -m llmlab.kernels.report [--arch sm_80 sm_90] [--kernel flash paged moe quant
                                     add_rmsnorm swiglu qkv_rope]
                                    [--dtype fp16 bf16 fp32] [--full] [--json] [--check]
    python -m llmlab.kernels.report --widget-table data/kernel_builds.json

Triton compiles for a GPU named by its compute capability, and its wheel ships ``ptxas``
and ``cuobjdump``, so a CPU-only machine can build a kernel down to the cubin an A100
(sm_80) or H100/H200 (sm_90) would run. Per build this reports the registers per thread,
the stack (register spills) per thread, the shared memory per block, the theoretical
occupancy, and the count of tensor-core instructions in the SASS (``HMMA``: warp-level
``mma.sync``, sm_80 and up; ``HGMMA``: warpgroup ``wgmma``, sm_90).

The builds are the tiles the wrappers and autotuners can pick: every autotune config of
``flash_attn`` (:func:`llmlab.kernels.flash_attn.tile_configs`) at head_dim 64 and 128,
the paged-attention kernel at each KV block size (unsplit, and split-KV with its merge),
and the grouped GEMM at each tile of
:func:`llmlab.kernels.moe_gemm.gpu_tiles`, and the fused elementwise kernels of
:mod:`llmlab.kernels.fused` (no dots, so no tensor cores) at SmolLM2's shapes, a larger
model's and the largest their wrappers accept, in float16, bfloat16 and float32. ``--full``
adds every mask variant (causal or not, key range, varlen) and head_dim 256.

``--widget-table`` builds every tile the notebook widgets offer (:data:`WIDGET_TILES`, some
of them tiles no autotuner would pick) and writes the committed table that
:func:`lookup` reads, so a widget shows a build in no time and without a compiler.

In a process where Triton was set up for its interpreter (``TRITON_INTERPRET=1``, as
``import llmlab`` sets on a machine without CUDA) nothing can be compiled, Triton's own
``@triton.jit`` library included, so the builds run in a child process with the
interpreter off. Builds are cached by Triton (``~/.triton/cache``): a second report is fast.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits of one GPU generation, for theoretical occupancy.

    Source: NVIDIA, CUDA C++ Programming Guide, "Compute Capabilities", table
    "Technical Specifications per Compute Capability" (compute capability 8.0 = A100,
    9.0 = H100/H200): 64 K 32-bit registers per SM, at most 255 per thread; at most 64
    resident warps and 32 resident blocks per SM; shared memory per SM 164 KB (8.0) and
    228 KB (9.0), of which one block may use at most 163 KB (8.0) and 227 KB (9.0). The
    allocation granularities (registers in units of 256 per warp, shared memory in units
    of 128 bytes, 1 KB of shared memory reserved by the system per block) are those of
    the CUDA Occupancy Calculator in Nsight Compute for these compute capabilities.
    """

    name: str
    gpu: str
    shared_per_sm: int
    shared_per_block: int
    tensor_core_op: str
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    register_unit: int = 256
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    shared_unit: int = 128
    shared_reserved_per_block: int = 1024

    @property
    def capability(self) -> int:
        return int(self.name[3:])


ARCHS = {
    "sm_80": ArchLimits("sm_80", "A100", shared_per_sm=164 * 1024, shared_per_block=163 * 1024,
                        tensor_core_op="HMMA"),
    "sm_90": ArchLimits("sm_90", "H100", shared_per_sm=228 * 1024, shared_per_block=227 * 1024,
                        tensor_core_op="HGMMA"),
}
DTYPES = ("fp16", "bf16", "fp32")
KERNELS = ("flash", "paged", "paged_split", "lse_merge", "moe", "quant", "add_rmsnorm",
           "swiglu", "qkv_rope")


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    fraction: float          # resident warps / the SM's maximum
    limiter: str             # "warps", "registers", "shared memory", "blocks", or why not at all


def occupancy(arch: str, registers: int, shared_bytes: int, num_warps: int) -> Occupancy:
    """Theoretical occupancy of a block of ``num_warps`` warps using ``registers`` per thread
    and ``shared_bytes`` of shared memory, against the limits of :data:`ARCHS` [arch]."""
    lim = ARCHS[arch]
    if registers > lim.max_registers_per_thread:
        return Occupancy(0, 0.0, f"registers > {lim.max_registers_per_thread}")
    if shared_bytes > lim.shared_per_block:
        return Occupancy(0, 0.0, f"shared memory > {lim.shared_per_block // 1024} KiB")
    per_warp = math.ceil(max(registers, 1) * 32 / lim.register_unit) * lim.register_unit
    per_block_shared = math.ceil((shared_bytes + lim.shared_reserved_per_block) / lim.shared_unit) \
        * lim.shared_unit
    limits = {
        "warps": lim.max_warps_per_sm // num_warps,
        "registers": (lim.registers_per_sm // per_warp) // num_warps,
        "shared memory": lim.shared_per_sm // per_block_shared,
        "blocks": lim.max_blocks_per_sm,
    }
    limiter = min(limits, key=lambda k: limits[k])
    blocks = limits[limiter]
    return Occupancy(blocks, blocks * num_warps / lim.max_warps_per_sm, limiter)


# -- what to build --------------------------------------------------------------------

@dataclass(frozen=True)
class KernelSource:
    """How to type one kernel's arguments for an ahead-of-time build."""

    module: str                       # under llmlab.kernels
    function: str
    data_pointers: tuple[str, ...]    # tensors of the build's dtype
    int_pointers: tuple[str, ...] = ()
    floats: tuple[str, ...] = ()
    unit_strides: tuple[str, ...] = ()   # 1 for contiguous inputs: the JIT makes them constants
    # pointers whose type is not the build's dtype: constants -> {name: "*i8", ...}
    typed_pointers: object = None
    dots: bool = True                    # has tl.dot: half-precision builds need tensor cores


def _quant_pointers(consts: dict) -> dict:
    """The quantized GEMM's weight pointers: int4 packed uint8 codes with float16 d and m,
    or int8 codes with a float32 scale (read through d_ptr; m_ptr is unused)."""
    if consts["INT4"]:
        return {"w_ptr": "*u8", "d_ptr": "*fp16", "m_ptr": "*fp16"}
    return {"w_ptr": "*i8", "d_ptr": "*fp32", "m_ptr": "*fp32"}


SOURCES = {
    "flash": KernelSource("flash_attn", "_flash_fwd_kernel", ("Q", "K", "V", "O"),
                          ("CU_Q", "CU_K", "K_START", "K_END"), ("qk_scale",)),
    "paged": KernelSource("paged_attn", "_paged_attn_fwd", ("Q", "K", "V", "O"), ("BT", "SEQLENS"),
                          ("sm_scale",)),
    # split-KV decode: float32 partial outputs and log-sum-exps, then their merge
    "paged_split": KernelSource("paged_attn", "_paged_attn_split_fwd", ("Q", "K", "V"),
                                ("BT", "SEQLENS"), ("sm_scale",),
                                typed_pointers=lambda consts: {"O_PART": "*fp32", "LSE": "*fp32"}),
    "lse_merge": KernelSource("paged_attn", "_lse_merge", ("O",),
                              typed_pointers=lambda consts: {"O_PART": "*fp32", "LSE": "*fp32",
                                                             "LSE_OUT": "*fp32"},
                              dots=False),
    "moe": KernelSource("moe_gemm", "_grouped_gemm_kernel",
                        ("x_ptr", "w_ptr", "y_ptr", "scale_ptr"),
                        ("offsets_ptr", "tile_expert_ptr", "tile_row_ptr"), (),
                        ("stride_xk", "stride_wk", "stride_yn")),
    "quant": KernelSource("quant_gemm", "_quant_gemm_kernel", ("x_ptr", "y_ptr"), (), (),
                          ("stride_xk", "stride_wk", "stride_dg", "stride_yn"), _quant_pointers),
    "add_rmsnorm": KernelSource("fused", "_add_rmsnorm_kernel", ("X", "R", "W", "OUT", "H"), (),
                                ("eps",), dots=False),
    "swiglu": KernelSource("fused", "_swiglu_kernel", ("GU", "OUT"), dots=False),
    "qkv_rope": KernelSource("fused", "_qkv_rope_kernel", ("QKV", "Q", "K", "V"),
                             typed_pointers=lambda consts: {"POS": "*i64", "INV_FREQ": "*fp32"},
                             dots=False),
}


@dataclass(frozen=True)
class BuildSpec:
    """One build: a kernel, its compile-time constants, launch shape, target and dtype."""

    kernel: str
    arch: str
    dtype: str
    constants: tuple[tuple[str, object], ...]   # the kernel's constexpr arguments
    num_warps: int = 4
    num_stages: int = 3
    variant: str = ""                            # the mask / layout variant, for display

    @property
    def config(self) -> str:
        """The tile, as a short label: e.g. "128x64 d128 w8 s3"."""
        c = dict(self.constants)
        if self.kernel in ("moe", "quant"):
            tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
        elif self.kernel in ("paged", "paged_split"):
            tile = f"{c['BLOCK_M']}x{c['BLOCK_N']} kv{c['BLOCK_SIZE']} d{c['HEAD_DIM']}"
        elif self.kernel == "lse_merge":
            tile = f"{c['BLOCK_R']} rows d{c['HEAD_DIM']}"
        elif self.kernel in ("add_rmsnorm", "swiglu"):
            tile = f"block {c['BLOCK']}"
        elif self.kernel == "qkv_rope":
            tile = f"{c['BLOCK_H']}+{c['BLOCK_KV']} heads x {c['BLOCK_HALF']} d{c['HEAD_DIM']}"
        else:
            tile = f"{c['BLOCK_M']}x{c['BLOCK_N']} d{c['HEAD_DIM']}"
        return f"{tile} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class Build:
    """What the compiler made of one :class:`BuildSpec`."""

    kernel: str
    variant: str
    config: str
    arch: str
    dtype: str
    num_warps: int
    num_stages: int
    registers: int               # per thread
    spill_bytes: int             # stack per thread (spilled registers)
    shared_bytes: int            # per block: Triton's dynamic shared memory + static
    occupancy: float             # theoretical, 0..1
    blocks_per_sm: int
    occupancy_limiter: str
    tensor_core_instructions: int   # HMMA + HGMMA in the SASS
    tensor_core_ops: dict = field(default_factory=dict)   # {"HMMA": n, "HGMMA": n}
    compile_seconds: float = 0.0

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0

    @property
    def fits_shared_memory(self) -> bool:
        return self.shared_bytes <= ARCHS[self.arch].shared_per_block


def _precision(dtype: str) -> str:
    return "ieee" if dtype == "fp32" else "tf32"   # only float32 dots read it


def flash_spec(arch: str = "sm_90", dtype: str = "bf16", head_dim: int = 64, block_m: int = 128,
               block_n: int = 64, num_warps: int = 4, num_stages: int = 3, causal: bool = True,
               varlen: bool = False, key_range: bool = False) -> BuildSpec:
    """A build of the FlashAttention kernel (shapes in :mod:`llmlab.kernels.flash_attn`)."""
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                  VARLEN=varlen, HAS_K_RANGE=key_range, DOT_PRECISION=_precision(dtype),
                  UPCAST=False)
    variant = ("varlen" if varlen else "dense") + (" causal" if causal else "") + \
        (" key-range" if key_range else "")
    return BuildSpec("flash", arch, dtype, tuple(consts.items()), num_warps, num_stages, variant)


def paged_spec(arch: str = "sm_90", dtype: str = "bf16", head_dim: int = 64, block_size: int = 16,
               group: int = 3, block_m: int | None = None, block_n: int | None = None,
               causal: bool = True, num_warps: int = 4, num_stages: int = 3) -> BuildSpec:
    """A build of the paged-attention kernel; ``block_size`` is the KV pool's block size and
    ``group`` the query heads per KV head (3 in SmolLM2); the tile defaults to the wrapper's."""
    import torch

    from . import paged_attn
    tile = paged_attn.default_tile({"fp16": torch.float16, "bf16": torch.bfloat16,
                                    "fp32": torch.float32}[dtype], head_dim)
    consts = dict(GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                  BLOCK_M=block_m or tile[0], BLOCK_N=block_n or tile[1],
                  CAUSAL=causal, PRECISION=_precision(dtype), UPCAST=False)
    return BuildSpec("paged", arch, dtype, tuple(consts.items()), num_warps, num_stages,
                     f"group {group}" + (" causal" if causal else ""))


def paged_split_spec(arch: str = "sm_90", dtype: str = "bf16", head_dim: int = 64,
                     block_size: int = 16, group: int = 3, causal: bool = True,
                     num_warps: int | None = None, num_stages: int = 3) -> BuildSpec:
    """A build of split-KV decode's first kernel (partials and their log-sum-exp), with the
    wrapper's tile and warps (:func:`llmlab.kernels.paged_attn.split_tile`,
    :func:`~llmlab.kernels.paged_attn.split_warps`); arguments as :func:`paged_spec`."""
    import torch

    from . import paged_attn
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tile = paged_attn.split_tile(torch_dtype, head_dim)
    num_warps = num_warps or paged_attn.split_warps(torch_dtype, head_dim)
    base = paged_spec(arch, dtype, head_dim, block_size, group, *tile, causal=causal,
                      num_warps=num_warps, num_stages=num_stages)
    return BuildSpec("paged_split", arch, dtype, base.constants, num_warps, num_stages,
                     base.variant)


def lse_merge_spec(arch: str = "sm_90", dtype: str = "bf16", head_dim: int = 64) -> BuildSpec:
    """A build of split-KV decode's merge (float32 partials in, ``dtype`` out), with the
    wrapper's rows per program."""
    from . import paged_attn
    consts = dict(HEAD_DIM=head_dim, BLOCK_R=paged_attn.MERGE_ROWS)
    return BuildSpec("lse_merge", arch, dtype, tuple(consts.items()), 4, 3, "")


def moe_spec(arch: str = "sm_90", dtype: str = "bf16", block_m: int = 32, block_n: int = 64,
             block_k: int = 32, num_warps: int = 4, num_stages: int = 3,
             has_scale: bool = True) -> BuildSpec:
    """A build of the grouped GEMM of MoE dispatch (layouts in :mod:`llmlab.kernels.moe_gemm`)."""
    consts = dict(HAS_SCALE=has_scale, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  PRECISION=_precision(dtype), UPCAST=False)
    return BuildSpec("moe", arch, dtype, tuple(consts.items()), num_warps, num_stages,
                     "scaled" if has_scale else "")


def quant_spec(arch: str = "sm_90", dtype: str = "bf16", block_m: int = 16, block_n: int = 64,
               block_k: int = 32, num_warps: int = 4, num_stages: int = 3, int4: bool = True,
               group_size: int = 32) -> BuildSpec:
    """A build of the weight-only quantized GEMM (layouts in :mod:`llmlab.kernels.quant_gemm`):
    int4 with ``group_size`` (float16 d, m) or int8 (float32 per-channel scale)."""
    consts = dict(INT4=int4, GROUP=group_size if int4 else 1, BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(dtype), UPCAST=False)
    return BuildSpec("quant", arch, dtype, tuple(consts.items()), num_warps, num_stages,
                     f"int4 g{group_size}" if int4 else "int8")


def add_rmsnorm_spec(arch: str = "sm_90", dtype: str = "bf16", hidden: int = 576,
                     residual: bool = True) -> BuildSpec:
    """A build of the fused residual add + RMSNorm (:mod:`llmlab.kernels.fused`) for rows
    of ``hidden`` (one power-of-two block per row, the wrapper's warps)."""
    from . import fused
    block = fused.next_power_of_two(hidden)
    consts = dict(HAS_RESIDUAL=residual, BLOCK=block, BF16_BITS=False)
    return BuildSpec("add_rmsnorm", arch, dtype, tuple(consts.items()),
                     fused.rmsnorm_warps(block), 3,
                     f"hidden {hidden}" + (" + residual" if residual else ""))


def swiglu_spec(arch: str = "sm_90", dtype: str = "bf16") -> BuildSpec:
    """A build of the fused silu(gate) · up (:mod:`llmlab.kernels.fused`): the wrapper's
    block of columns, whatever the intermediate size."""
    from . import fused
    consts = dict(BLOCK=fused.SWIGLU_BLOCK, BF16_BITS=False)
    return BuildSpec("swiglu", arch, dtype, tuple(consts.items()), 4, 3, "")


def qkv_rope_spec(arch: str = "sm_90", dtype: str = "bf16", num_heads: int = 9,
                  num_kv_heads: int = 3, head_dim: int = 64) -> BuildSpec:
    """A build of the fused q/k/v split + RoPE (:mod:`llmlab.kernels.fused`) for one head
    layout (SmolLM2's by default: 9 query heads, 3 KV heads of 64)."""
    from . import fused
    consts = dict(HEAD_DIM=head_dim, BLOCK_HALF=fused.next_power_of_two(head_dim // 2),
                  BLOCK_H=fused.next_power_of_two(num_heads),
                  BLOCK_KV=fused.next_power_of_two(num_kv_heads), BF16_BITS=False)
    return BuildSpec("qkv_rope", arch, dtype, tuple(consts.items()), 4, 3,
                     f"{num_heads}/{num_kv_heads} heads")


PAGED_BLOCK_SIZES = (16, 32, 64, 128)
# the fused kernels' shapes: SmolLM2's, Llama-3-8B's, and the largest the wrappers accept
RMSNORM_HIDDEN = (576, 4096, 8192)
QKV_ROPE_HEADS = ((9, 3, 64), (32, 8, 128), (64, 8, 128))


def specs(kernels=KERNELS, archs=tuple(ARCHS), dtypes=DTYPES,
          full: bool = False) -> list[BuildSpec]:
    """Every build of the report: each tile the wrappers and autotuners can pick.

    Default: flash dense causal at head_dim 64 and 128 for every autotune tile; paged
    causal at every KV block size of :data:`PAGED_BLOCK_SIZES`, head_dim 64 and 128, and
    so the split-KV partials kernel, with its merge at each head_dim; the
    grouped GEMM at every tile of ``gpu_tiles`` (scaled output); the quantized GEMM at every
    tile of its ``gpu_tiles``, int4 (group 32) and int8; the fused elementwise kernels at
    :data:`RMSNORM_HIDDEN` (with the residual) and :data:`QKV_ROPE_HEADS`. ``full`` adds
    the other mask and layout variants, head_dim 256 and the norm without a residual.
    """
    from . import flash_attn, moe_gemm, quant_gemm
    for name, values, allowed in (("kernel", kernels, KERNELS), ("arch", archs, tuple(ARCHS)),
                                  ("dtype", dtypes, DTYPES)):
        bad = [x for x in values if x not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad}; allowed: {list(allowed)}")
    head_dims = (64, 128, 256) if full else (64, 128)
    flash_variants = [dict(causal=True)]
    if full:
        flash_variants += [dict(causal=False), dict(causal=True, key_range=True),
                           dict(causal=False, key_range=True), dict(causal=True, varlen=True),
                           dict(causal=False, varlen=True)]
    out: list[BuildSpec] = []
    for arch in archs:
        for dtype in dtypes:
            if "flash" in kernels:
                for d in head_dims:
                    for bm, bn, w, s in flash_attn.tile_configs(arch, d, dtype):
                        for var in flash_variants:
                            out.append(flash_spec(arch, dtype, d, bm, bn, w, s, **var))
            if "paged" in kernels:
                for d in head_dims:
                    for bs in PAGED_BLOCK_SIZES:
                        for causal in ((True, False) if full else (True,)):
                            out.append(paged_spec(arch, dtype, d, bs, causal=causal))
            if "paged_split" in kernels:
                for d in head_dims:
                    for bs in PAGED_BLOCK_SIZES:
                        out.append(paged_split_spec(arch, dtype, d, bs))
            if "lse_merge" in kernels:
                for d in head_dims:
                    out.append(lse_merge_spec(arch, dtype, d))
            if "moe" in kernels:
                for bm, bn, bk, w, s in moe_gemm.gpu_tiles(dtype):
                    for scaled in ((True, False) if full else (True,)):
                        out.append(moe_spec(arch, dtype, bm, bn, bk, w, s, has_scale=scaled))
            if "quant" in kernels:
                for bm, bn, bk, w, s in quant_gemm.gpu_tiles(dtype):
                    for int4 in (True, False):
                        out.append(quant_spec(arch, dtype, bm, bn, bk, w, s, int4=int4))
            if "add_rmsnorm" in kernels:
                for hidden in RMSNORM_HIDDEN:
                    for residual in ((True, False) if full else (True,)):
                        out.append(add_rmsnorm_spec(arch, dtype, hidden, residual))
            if "swiglu" in kernels:
                out.append(swiglu_spec(arch, dtype))
            if "qkv_rope" in kernels:
                for heads in QKV_ROPE_HEADS:
                    out.append(qkv_rope_spec(arch, dtype, *heads))
    return out


# -- building -------------------------------------------------------------------------

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernel_function(kernel: str):
    src = SOURCES[kernel]
    return getattr(importlib.import_module(f"{__package__}.{src.module}"), src.function)


def _compilable_here() -> bool:
    """False where Triton was set up for its interpreter: then the @triton.jit functions,
    Triton's own library included, are interpreter wrappers that cannot be compiled."""
    from triton.runtime.jit import JITFunction
    return not _interpreting() and all(isinstance(_kernel_function(k), JITFunction)
                                       for k in SOURCES)


def _signature(spec: BuildSpec, fn):
    src = SOURCES[spec.kernel]
    consts = dict(spec.constants)
    sig, constexprs, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        elif name in src.unit_strides:
            sig[name] = "constexpr"
            constexprs[(i,)] = 1
        elif src.typed_pointers and name in src.typed_pointers(consts):
            sig[name], attrs[(i,)] = src.typed_pointers(consts)[name], aligned
        elif name in src.data_pointers:
            sig[name], attrs[(i,)] = "*" + spec.dtype, aligned
        elif name in src.int_pointers:
            sig[name], attrs[(i,)] = "*i32", aligned
        elif name in src.floats:
            sig[name] = "fp32"
        else:
            # sizes and strides: the JIT marks values divisible by 16 so, as realistic
            # shapes (head_dim 64 or 128) make every stride
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = aligned
    missing = set(consts) - set(fn.arg_names)
    if missing:
        raise ValueError(f"{spec.kernel} has no constexpr {sorted(missing)}")
    return sig, constexprs, attrs


def _tool(name: str) -> str:
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if path.exists():
        return str(path)
    from triton import knobs
    return knobs.nvidia.cuobjdump.path if name == "cuobjdump" else name


def _inspect_cubin(cubin: bytes) -> tuple[int, int, int, dict]:
    """(registers, stack bytes, static shared bytes, {tensor-core opcode: count}) of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        cuobjdump = _tool("cuobjdump")
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", str(path)], check=True, capture_output=True,
                              text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"cannot read cuobjdump's resource usage:\n{usage}")
    ops = {op: len(re.findall(rf"\b{op}\.", sass)) for op in ("HMMA", "HGMMA")}
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), ops


def build(spec: BuildSpec) -> Build:
    """Compile one spec to a cubin for its arch (no GPU needed) and read what it uses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if spec.arch not in ARCHS:
        raise ValueError(f"arch={spec.arch!r}; allowed: {list(ARCHS)}")
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype={spec.dtype!r}; allowed: {list(DTYPES)}")
    if not _compilable_here():
        return build_all([spec], jobs=1)[0]
    fn = _kernel_function(spec.kernel)
    sig, constexprs, attrs = _signature(spec, fn)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", ARCHS[spec.arch].capability, 32),
                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    regs, stack, static_shared, ops = _inspect_cubin(compiled.asm["cubin"])
    seconds = time.perf_counter() - start
    return _result(spec, regs, stack, compiled.metadata.shared + static_shared, ops, seconds)


def _result(spec: BuildSpec, registers: int, stack: int, shared: int, ops: dict,
            seconds: float = 0.0) -> Build:
    """The :class:`Build` of ``spec`` from what the cubin uses (occupancy from :data:`ARCHS`)."""
    occ = occupancy(spec.arch, registers, shared, spec.num_warps)
    return Build(spec.kernel, spec.variant, spec.config, spec.arch, spec.dtype, spec.num_warps,
                 spec.num_stages, registers, stack, shared, occ.fraction, occ.blocks_per_sm,
                 occ.limiter, sum(ops.values()), ops, round(seconds, 2))


def build_all(todo: list[BuildSpec], jobs: int | None = None) -> list[Build]:
    """Build every spec, in order, on ``jobs`` processes (default: the CPU count).

    In a process that interprets Triton kernels, the builds run in a child Python with
    ``TRITON_INTERPRET=0`` (``python -m llmlab.kernels.report --stdin``).
    """
    if not todo:
        return []
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if not _compilable_here():
        return _build_in_child(todo, jobs)
    if jobs == 1:
        return [build(s) for s in todo]
    import multiprocessing
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(build, todo))


def _spec_from_json(d: dict) -> BuildSpec:
    return BuildSpec(d["kernel"], d["arch"], d["dtype"], tuple((k, v) for k, v in d["constants"]),
                     d["num_warps"], d["num_stages"], d["variant"])


def _build_in_child(todo: list[BuildSpec], jobs: int) -> list[Build]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    payload = "\n".join(json.dumps(asdict(s)) for s in todo)
    res = subprocess.run([sys.executable, "-m", f"{__package__}.report", "--stdin", "--json",
                          "--jobs", str(jobs)], input=payload, env=env, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the ahead-of-time build failed:\n{res.stderr[-4000:]}")
    return [Build(**json.loads(line)) for line in res.stdout.splitlines() if line.startswith("{")]


# -- the table the notebook widgets read ---------------------------------------------------

# Every tile the widgets of notebooks 03 (flash), 04 (paged) and 06 (moe) let a student
# choose, as keyword arguments of flash_spec / paged_spec / moe_spec. Tiles the autotuner
# would never pick are included on purpose (e.g. flash 128x128 at head_dim 128 on 4 warps):
# the widget shows what the compiler makes of them. Triton launches a kernel with 4 warps
# and 3 pipeline stages unless told otherwise, as the widgets' kernel calls do.
WIDGET_TILES = {
    "flash": {"block_m": (16, 32, 64, 128), "block_n": (16, 32, 64, 128),
              "head_dim": (64, 128, 256), "num_warps": (4, 8)},
    "paged": {"block_size": (1, 2, 4, 8, 16, 32, 64, 128, 256), "head_dim": (64,)},
    "paged_split": {"block_size": (16,), "head_dim": (64, 128)},     # notebook 14's model
    "moe": {"block_m": (16, 32, 64, 128), "block_n": (64, 128, 256), "block_k": (32, 64)},
}
WIDGET_DTYPES = ("bf16", "fp16")
WIDGET_TABLE = Path(__file__).resolve().parents[2] / "data" / "kernel_builds.json"
CHIP_ARCH = {"A100": "sm_80", "H100": "sm_90", "H200": "sm_90"}   # llmlab.profiling.hbm.CHIPS
_SPEC_FUNCTIONS = {"flash": flash_spec, "paged": paged_spec, "paged_split": paged_split_spec,
                   "moe": moe_spec}


class MissingBuild(KeyError):
    """A tile that the committed table of builds does not hold."""

    def __str__(self) -> str:
        return self.args[0]


def widget_tiles(kernel: str) -> list[dict]:
    """Every combination of :data:`WIDGET_TILES` [kernel], as keyword dicts."""
    import itertools
    if kernel not in WIDGET_TILES:
        raise ValueError(f"kernel={kernel!r}; allowed: {list(WIDGET_TILES)}")
    names = list(WIDGET_TILES[kernel])
    return [dict(zip(names, values))
            for values in itertools.product(*(WIDGET_TILES[kernel][n] for n in names))]


def widget_specs(archs=tuple(ARCHS), dtypes=WIDGET_DTYPES,
                 kernels=tuple(WIDGET_TILES)) -> list[tuple[dict, BuildSpec]]:
    """(tile, spec) for every widget tile of ``kernels``, on each arch and dtype."""
    return [(tile, _SPEC_FUNCTIONS[kernel](arch, dtype, **tile))
            for kernel in kernels for arch in archs for dtype in dtypes
            for tile in widget_tiles(kernel)]


def write_widget_table(path: str | Path = WIDGET_TABLE, jobs: int | None = None,
                       kernels: list[str] | None = None) -> dict:
    """Build every widget tile (:func:`widget_specs`) and write the table the notebooks read:
    metadata, then per build its tile, its spec and what the cubin uses. Returns the table.

    ``kernels``: rebuild only these kernels' tiles and keep the other entries of the table
    at ``path`` (a kernel added to :data:`WIDGET_TILES` without rebuilding the rest)."""
    import triton
    unknown = [k for k in kernels or () if k not in WIDGET_TILES]
    if unknown:
        raise ValueError(f"kernels {unknown}; allowed: {list(WIDGET_TILES)}")
    todo = widget_specs(kernels=tuple(kernels or WIDGET_TILES))
    order = sorted(range(len(todo)), key=lambda i: -_build_cost(todo[i][1]))   # slow ones first
    built = dict(zip(order, build_all([todo[i][1] for i in order], jobs)))
    entries = [{"tile": tile, "spec": asdict(spec),
                "result": {"registers": b.registers, "spill_bytes": b.spill_bytes,
                           "shared_bytes": b.shared_bytes, "tensor_core_ops": b.tensor_core_ops,
                           "compile_seconds": b.compile_seconds}}
               for i, (tile, spec) in enumerate(todo) for b in [built[i]]]
    old = json.loads(Path(path).read_text()) if kernels else None
    if old is not None:
        if old["meta"]["triton"] != triton.__version__:
            raise ValueError(f"the table was built with Triton {old['meta']['triton']}, this is "
                             f"{triton.__version__}: rebuild all of it (no kernels=)")
        kept = [e for e in old["builds"] if e["spec"]["kernel"] not in kernels]
        entries = [e for k in WIDGET_TILES
                   for e in kept + entries if e["spec"]["kernel"] == k]
    table = {"meta": {"what": "Triton kernels compiled ahead of time on a CPU-only machine for "
                              "A100 (sm_80) and H100 (sm_90); never run on a GPU",
                      "command": "python -m llmlab.kernels.report --widget-table "
                                 "data/kernel_builds.json",
                      "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                      "archs": {a: ARCHS[a].gpu for a in ARCHS}, "widget_tiles": WIDGET_TILES},
             "builds": entries}
    if old is not None:        # the rest of the table keeps its date; say what was added when
        table["meta"]["date"] = old["meta"]["date"]
        table["meta"]["rebuilt"] = {**old["meta"].get("rebuilt", {}),
                                    **{k: time.strftime("%Y-%m-%d") for k in kernels}}
    text = json.dumps(table, indent=None, separators=(",", ":"))
    Path(path).write_text(text.replace(',{"tile"', ',\n{"tile"') + "\n")
    _load_table.cache_clear()
    return table


def _build_cost(spec: BuildSpec) -> int:
    c = dict(spec.constants)
    return c.get("BLOCK_M", 1) * c.get("BLOCK_N", 1) * c.get("HEAD_DIM", c.get("BLOCK_K", 1))


@functools.lru_cache(maxsize=4)
def _load_table(path: str) -> dict:
    return json.loads(Path(path).read_text())


def table_meta(path: str | Path = WIDGET_TABLE) -> dict:
    """The metadata of the committed table (Triton version, date, archs, the command)."""
    return _load_table(str(path))["meta"]


def lookup(kernel: str, arch: str = "sm_90", dtype: str = "bf16",
           path: str | Path = WIDGET_TABLE, **tile) -> Build:
    """The committed build of one widget tile, e.g. ``lookup("flash", "sm_90", "bf16",
    block_m=128, block_n=128, head_dim=128)``; ``arch`` may be a chip name of
    :data:`CHIP_ARCH`. flash's num_warps defaults to 4. Raises :class:`MissingBuild` (a
    KeyError) naming the tile when the table does not hold it: :func:`build` compiles any
    tile (seconds to a minute each, in a child process)."""
    arch = CHIP_ARCH.get(arch, arch)
    if kernel not in WIDGET_TILES:
        raise ValueError(f"kernel={kernel!r}; allowed: {list(WIDGET_TILES)}")
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}; allowed: {list(ARCHS)} or {list(CHIP_ARCH)}")
    if kernel == "flash":
        tile.setdefault("num_warps", 4)
    unknown = set(tile) - set(WIDGET_TILES[kernel])
    if unknown:
        raise ValueError(f"{kernel} tiles are given by {list(WIDGET_TILES[kernel])}; "
                         f"got {sorted(unknown)}")
    for e in _load_table(str(path))["builds"]:
        s = e["spec"]
        if (s["kernel"], s["arch"], s["dtype"]) == (kernel, arch, dtype) and e["tile"] == tile:
            r = e["result"]
            return _result(_spec_from_json(s), r["registers"], r["spill_bytes"],
                           r["shared_bytes"], r["tensor_core_ops"], r["compile_seconds"])
    raise MissingBuild(f"no {kernel} build for {tile} on {arch} {dtype} in {Path(path).name}; "
                       f"it holds the tiles of llmlab.kernels.report.WIDGET_TILES in "
                       f"{list(WIDGET_DTYPES)}")


def table_entries(path: str | Path = WIDGET_TABLE) -> list[dict]:
    """The committed table's entries: {"tile", "spec", "result"} each."""
    return _load_table(str(path))["builds"]


def stale_entries(entries: list[dict], rebuilt: list[Build]) -> list[str]:
    """Where a fresh build of each entry's spec (``rebuilt``, in order) differs from the
    table: registers, stack (spill) bytes, shared memory, tensor-core instruction counts."""
    out = []
    for e, b in zip(entries, rebuilt, strict=True):
        fresh = {"registers": b.registers, "spill_bytes": b.spill_bytes,
                 "shared_bytes": b.shared_bytes, "tensor_core_ops": b.tensor_core_ops}
        for key, value in fresh.items():
            if e["result"][key] != value:
                s = e["spec"]
                out.append(f"{s['kernel']} {e['tile']} {s['arch']} {s['dtype']}: {key} is "
                           f"{e['result'][key]} in the table, {value} when built now")
    return out


# -- checks and printing -----------------------------------------------------------------

def problems(builds: list[Build]) -> list[str]:
    """What is wrong with these builds: spills, shared memory over the arch's per-block
    limit, and float16/bfloat16 builds of a kernel with dots without tensor-core instructions."""
    out = []
    for b in builds:
        where = f"{b.kernel} {b.variant} {b.config} {b.arch} {b.dtype}"
        if b.spills:
            out.append(f"{where}: spills {b.spill_bytes} bytes per thread "
                       f"({b.registers} registers)")
        if not b.fits_shared_memory:
            out.append(f"{where}: {b.shared_bytes} bytes of shared memory, over "
                       f"{ARCHS[b.arch].shared_per_block} per block")
        if b.dtype != "fp32" and SOURCES[b.kernel].dots and b.tensor_core_instructions == 0:
            out.append(f"{where}: no tensor-core instruction in the SASS")
    return out


def summary(builds: list[Build]) -> list[dict]:
    """Per kernel: builds, spill-free builds, and half-precision builds using tensor cores."""
    rows = []
    for kernel in dict.fromkeys(b.kernel for b in builds):
        mine = [b for b in builds if b.kernel == kernel]
        half = [b for b in mine if b.dtype != "fp32"]
        with_tc = sum(b.tensor_core_instructions > 0 for b in half)
        rows.append({"kernel": kernel, "builds": len(mine),
                     "spill_free": sum(not b.spills for b in mine),
                     "fit_shared": sum(b.fits_shared_memory for b in mine),
                     "fp16/bf16 with tensor cores": (f"{with_tc}/{len(half)}"
                                                     if SOURCES[kernel].dots else "no dots")})
    return rows


def _table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [keys] + [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table(builds: list[Build]) -> str:
    """The builds as an aligned text table."""
    rows = [{"kernel": b.kernel, "variant": b.variant, "config": b.config, "arch": b.arch,
             "dtype": b.dtype, "regs": b.registers, "spill B": b.spill_bytes,
             "smem KiB": f"{b.shared_bytes / 1024:.0f}", "occupancy": f"{b.occupancy:.0%}",
             "blocks/SM": b.blocks_per_sm, "limit": b.occupancy_limiter,
             "tensor-core instr": (" ".join(f"{k} {v}" for k, v in b.tensor_core_ops.items() if v)
                                   or "0")}
            for b in builds]
    return _table(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.kernels.report",
                                description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--kernel", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--full", action="store_true", help="every mask/layout variant and head_dim 256")
    p.add_argument("--json", action="store_true", help="one JSON object per build, one per line")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if a build spills, overflows shared memory or (fp16/bf16) "
                        "has no tensor-core instruction")
    p.add_argument("--jobs", type=int, default=None, help="parallel builds (default: CPU count)")
    p.add_argument("--widget-table", metavar="PATH",
                   help="build every tile the notebook widgets offer (WIDGET_TILES) and write "
                        "the table they read (data/kernel_builds.json)")
    p.add_argument("--widget-kernels", nargs="+", choices=list(WIDGET_TILES), default=None,
                   help="with --widget-table: rebuild only these kernels' tiles, keep the rest")
    p.add_argument("--stdin", action="store_true", help=argparse.SUPPRESS)  # specs as JSON lines
    args = p.parse_args(argv)
    if args.widget_table:
        start = time.perf_counter()
        written = write_widget_table(args.widget_table, args.jobs, args.widget_kernels)
        print(f"{len(written['builds'])} builds in {time.perf_counter() - start:.0f} s -> "
              f"{args.widget_table}")
        return 0
    if args.stdin:
        todo = [_spec_from_json(json.loads(line)) for line in sys.stdin if line.strip()]
    else:
        todo = specs(args.kernel, args.arch, args.dtype, args.full)
    start = time.perf_counter()
    builds = build_all(todo, args.jobs)
    if args.json:
        for b in builds:
            print(json.dumps(asdict(b)))
    else:
        import triton
        print(f"Triton {triton.__version__}: {len(builds)} builds in "
              f"{time.perf_counter() - start:.0f} s (no GPU used; limits in "
              f"llmlab.kernels.report.ArchLimits)\n")
        print(table(builds))
        print()
        print(_table(summary(builds)))
    bad = problems(builds)
    if args.check and bad:
        print(f"\n{len(bad)} problem(s):", *bad, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
