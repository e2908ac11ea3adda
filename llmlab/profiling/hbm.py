"""An analytic model of attention's main-memory (HBM) traffic and tile footprint (notebook 03).

These are *models*, not measurements: they count the bytes each algorithm must move
between HBM and the chip, assuming every operand is read and every result written at
the granularity the algorithm prescribes (the accounting of the FlashAttention paper,
Dao et al. 2022, Theorem 2):

standard attention
    S = QKᵀ written to HBM, read back for the softmax, P written, read again for P·V:
    Θ(N·d + N²) bytes — quadratic in the sequence length whatever the chip.
tiled attention (FlashAttention-2 loop order)
    each [Br, d] block of Q is read once and its output written once; K and V stream
    through once per Q block, so they are read ⌈N/Br⌉ times: Θ(N²·d / Br). With the
    largest tile the on-chip memory M allows (Br ≈ M / 4d), that is Θ(N²·d² / M).

Chip presets carry the numbers the notebook quotes; each is cited where it is defined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

KiB = 1024
GB = 10**9


@dataclass(frozen=True)
class ChipSpec:
    """Memory hierarchy and peak compute of one accelerator (vendor figures, not measured)."""

    name: str
    sms: int                      # streaming multiprocessors
    smem_per_sm: int              # bytes of shared memory one thread block may use per SM
    sram_per_sm: int              # bytes of on-chip L1 + shared memory per SM
    hbm_bytes: int                # HBM capacity
    hbm_bandwidth: float          # bytes / s
    peak_bf16_flops: float        # dense tensor-core FLOP/s (no sparsity)
    sram_bandwidth: float | None = None   # bytes / s, aggregate, where a source states one
    source: str = ""

    @property
    def sram_total(self) -> int:
        return self.sms * self.sram_per_sm

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity at which HBM bandwidth and peak compute balance (roofline)."""
        return self.peak_bf16_flops / self.hbm_bandwidth


# A100 SXM4 40 GB. HBM2 1,555 GB/s, 312 TFLOP/s dense BF16, 108 SMs: NVIDIA A100 Tensor
# Core GPU datasheet. 192 KB L1/shared per SM, of which up to 164 KB shared: NVIDIA A100
# architecture whitepaper and CUDA C++ Programming Guide (compute capability 8.0).
# SRAM ~19 TB/s over ~20 MB: FlashAttention paper, Fig. 1 (also the seed article on
# FlashAttention, which quotes SRAM 19 TB/s / 20 MB and HBM 1.5 TB/s / 40 GB).
A100 = ChipSpec("A100-SXM4-40GB", sms=108, smem_per_sm=164 * KiB, sram_per_sm=192 * KiB,
                hbm_bytes=40 * GB, hbm_bandwidth=1.555e12, peak_bf16_flops=312e12,
                sram_bandwidth=19e12,
                source="NVIDIA A100 datasheet; FlashAttention paper Fig. 1")
# H100 SXM5 80 GB. HBM3 3.35 TB/s, 989 TFLOP/s dense BF16 (1,979 with sparsity), 132 SMs:
# NVIDIA H100 Tensor Core GPU datasheet. 256 KB L1/shared per SM, up to 228 KB shared:
# NVIDIA H100 (Hopper) architecture whitepaper, CUDA C++ Programming Guide (cc 9.0).
H100 = ChipSpec("H100-SXM5-80GB", sms=132, smem_per_sm=228 * KiB, sram_per_sm=256 * KiB,
                hbm_bytes=80 * GB, hbm_bandwidth=3.35e12, peak_bf16_flops=989e12,
                source="NVIDIA H100 datasheet; Hopper whitepaper")
# H200 SXM 141 GB. HBM3e 4.8 TB/s, same Hopper SM as H100 (989 TFLOP/s dense BF16,
# 132 SMs, 228 KB shared per SM): NVIDIA H200 Tensor Core GPU datasheet.
H200 = ChipSpec("H200-SXM-141GB", sms=132, smem_per_sm=228 * KiB, sram_per_sm=256 * KiB,
                hbm_bytes=141 * GB, hbm_bandwidth=4.8e12, peak_bf16_flops=989e12,
                source="NVIDIA H200 datasheet")

CHIPS: dict[str, ChipSpec] = {"A100": A100, "H100": H100, "H200": H200}


def chip(name: str) -> ChipSpec:
    """A preset by name ("A100", "H100", "H200")."""
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name!r}; allowed: {list(CHIPS)}")
    return CHIPS[name]


@dataclass(frozen=True)
class HBMTraffic:
    """Bytes read from and written to HBM by one attention forward (a model)."""

    read: int
    write: int

    @property
    def total(self) -> int:
        return self.read + self.write

    def seconds(self, spec: ChipSpec) -> float:
        """Time to move these bytes at the chip's peak HBM bandwidth."""
        return self.total / spec.hbm_bandwidth


def _check_positive(**kw) -> None:
    for name, value in kw.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


def standard_attention_hbm(n: int, d: int, *, batch: int = 1, heads: int = 1,
                           bytes_per_el: int = 2) -> HBMTraffic:
    """Standard attention: read Q, K (write S), read S (write P), read P, V (write O).

    Reads 3·N·d + 2·N², writes 2·N² + N·d elements per (batch, head): Θ(N·d + N²).
    The score matrix is materialized in full even when a causal mask hides half of it.
    """
    _check_positive(n=n, d=d, batch=batch, heads=heads, bytes_per_el=bytes_per_el)
    per_head_read = 3 * n * d + 2 * n * n
    per_head_write = 2 * n * n + n * d
    k = batch * heads * bytes_per_el
    return HBMTraffic(read=k * per_head_read, write=k * per_head_write)


def kv_elements_loaded(n: int, block_q: int, block_k: int, causal: bool) -> int:
    """Keys loaded by the tiled loop summed over all Q blocks (whole K blocks are loaded,
    also those the causal mask cuts through; blocks past the diagonal are skipped)."""
    total = 0
    for q_start in range(0, n, block_q):
        q_end = min(q_start + block_q, n)
        visible = q_end if causal else n
        total += min(n, math.ceil(visible / block_k) * block_k)
    return total


def tiled_attention_hbm(n: int, d: int, block_q: int, block_k: int, *, causal: bool = False,
                        batch: int = 1, heads: int = 1, bytes_per_el: int = 2) -> HBMTraffic:
    """FlashAttention-2 loop order: Q and O once, K and V once per Q block.

    Reads N·d (Q) + 2·d·Σ keys loaded per Q block (≈ 2·N²·d / Br without a mask, about
    half with one); writes N·d (O). No N² term: the scores never leave the chip.
    """
    _check_positive(n=n, d=d, block_q=block_q, block_k=block_k, batch=batch, heads=heads,
                    bytes_per_el=bytes_per_el)
    keys = kv_elements_loaded(n, block_q, block_k, causal)
    k = batch * heads * bytes_per_el
    return HBMTraffic(read=k * (n * d + 2 * keys * d), write=k * n * d)


def paper_block_sizes(d: int, sram_bytes: int, bytes_per_el: int = 2) -> tuple[int, int]:
    """The block sizes of FlashAttention's Algorithm 1 for on-chip memory of M elements:
    Bc = ⌈M / 4d⌉, Br = min(⌈M / 4d⌉, d) -> (Br, Bc)."""
    _check_positive(d=d, sram_bytes=sram_bytes, bytes_per_el=bytes_per_el)
    m = sram_bytes // bytes_per_el
    bc = max(1, math.ceil(m / (4 * d)))
    return min(bc, d), bc


def tiled_attention_hbm_for_sram(n: int, d: int, sram_bytes: int, *, batch: int = 1,
                                 heads: int = 1, bytes_per_el: int = 2) -> HBMTraffic:
    """Tiled traffic with the paper's block sizes for ``sram_bytes`` of on-chip memory:
    Θ(N²·d²/M) — bigger SRAM, bigger Q blocks, fewer passes over K and V."""
    br, bc = paper_block_sizes(d, sram_bytes, bytes_per_el)
    return tiled_attention_hbm(n, d, br, bc, batch=batch, heads=heads, bytes_per_el=bytes_per_el)


@dataclass(frozen=True)
class TileFootprint:
    """On-chip bytes one program of the tiled kernel holds for a (Br, Bc, d) tile."""

    q: int        # [Br, d] query block, input dtype
    kv: int       # [Bc, d] key block + [Bc, d] value block, input dtype, per pipeline stage
    scores: int   # [Br, Bc] scores / probabilities, float32
    acc: int      # [Br, d] output accumulator, float32
    stats: int    # running max and sum, [Br] float32 each
    stages: int = 1

    @property
    def total(self) -> int:
        return self.q + self.stages * self.kv + self.scores + self.acc + self.stats

    def fits(self, spec: ChipSpec) -> bool:
        """Whether the tile fits the shared memory one SM offers a thread block.

        (On a GPU the scores and accumulator live in registers and Q/K/V in shared memory;
        counting them all against shared memory is the conservative model.)"""
        return self.total <= spec.smem_per_sm


def tile_footprint(block_q: int, block_k: int, d: int, bytes_per_el: int = 2,
                   stages: int = 1) -> TileFootprint:
    """Bytes of one (Br, Bc, d) tile: Q block, K and V blocks (× pipeline ``stages``),
    the Br×Bc score tile and the Br×d accumulator in float32, and the softmax statistics."""
    _check_positive(block_q=block_q, block_k=block_k, d=d, bytes_per_el=bytes_per_el,
                    stages=stages)
    return TileFootprint(q=block_q * d * bytes_per_el, kv=2 * block_k * d * bytes_per_el,
                         scores=4 * block_q * block_k, acc=4 * block_q * d, stats=2 * 4 * block_q,
                         stages=stages)


def attention_flops(n: int, d: int, *, batch: int = 1, heads: int = 1,
                    causal: bool = False) -> int:
    """2 GEMMs of 2·N·N·d FLOPs each per head (half with a causal mask, the convention
    FlashAttention's benchmarks use)."""
    f = 4 * batch * heads * n * n * d
    return f // 2 if causal else f


def roofline_seconds(traffic: HBMTraffic, flops: int, spec: ChipSpec) -> float:
    """Lower bound on time: the slower of moving the bytes and doing the FLOPs at peak."""
    return max(traffic.total / spec.hbm_bandwidth, flops / spec.peak_bf16_flops)
