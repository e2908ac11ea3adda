"""An analytic model of attention's main-memory (HBM) traffic and tile footprint (notebook 03).

These are *models*, not measurements: they count the bytes each algorithm must move
between HBM and the chip, assuming every operand is read and every result written at
the granularity the algorithm prescribes (the accounting behind Theorem 2 of the
FlashAttention paper: Dao, Fu, Ermon, Rudra, Ré, NeurIPS 2022, arXiv:2205.14135).

standard attention (:func:`standard_attention_hbm`)
    S = QKᵀ written to HBM, read back for the softmax, P written, read again for P·V:
    Θ(N·d + N²) bytes, quadratic in the sequence length whatever the chip.
FlashAttention-1 loop order (:func:`tiled_attention_hbm` with ``order="fa1"``)
    Algorithm 1 of the paper: the *outer* loop runs over blocks of Bc keys, each K/V
    block read once; for each, the inner loop reads every block of Q together with its
    partial output O and statistics ℓ, m, updates them on chip and writes O, ℓ, m back.
    Q is read and O read and written ⌈N/Bc⌉ times: Θ(N²·d / Bc). With the paper's block
    sizes for an on-chip memory of M elements, Bc = ⌈M/4d⌉ and Br = min(⌈M/4d⌉, d)
    (:func:`paper_block_sizes`), that is Θ(N²·d²/M): the traffic keeps falling as M grows
    (:func:`tiled_attention_hbm_for_sram`).
FlashAttention-2 loop order (``order="fa2"``, the default; Dao 2023, arXiv:2307.08691)
    the loops are swapped: the outer loop runs over blocks of Br queries, each read once
    with its output written once, and K and V stream through once per query block:
    Θ(N²·d / Br). Br is chosen for occupancy and registers (64 or 128 in practice), not
    from M. The swap buys parallelism over query blocks (one thread block each, even when
    batch × heads is small), no read-modify-write of a partial O in HBM, and a single
    division by ℓ at the end instead of one per key block.

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
# SRAM ~19 TB/s over ~20 MB: FlashAttention paper (Dao et al. 2022), Fig. 1.
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
    """Keys loaded by the FlashAttention-2 loop summed over all Q blocks (whole K blocks are
    loaded, also those the causal mask cuts through; blocks past the diagonal are skipped)."""
    total = 0
    for q_start in range(0, n, block_q):
        q_end = min(q_start + block_q, n)
        visible = q_end if causal else n
        total += min(n, math.ceil(visible / block_k) * block_k)
    return total


def q_rows_loaded(n: int, block_q: int, block_k: int, causal: bool) -> int:
    """Query rows the FlashAttention-1 loop loads, summed over all K/V blocks: for each block
    of keys, every Q block that has a row allowed to see one of them (whole Q blocks)."""
    total = 0
    for k_start in range(0, n, block_k):
        first_row = k_start if causal else 0      # rows above the diagonal see none of these keys
        first_block = (first_row // block_q) * block_q
        total += n - first_block
    return total


ORDERS = ("fa1", "fa2")


def tiled_attention_hbm(n: int, d: int, block_q: int, block_k: int, *, causal: bool = False,
                        order: str = "fa2", batch: int = 1, heads: int = 1,
                        bytes_per_el: int = 2) -> HBMTraffic:
    """HBM traffic of tiled (Flash) attention with Br = ``block_q``, Bc = ``block_k``.

    ``order="fa2"`` (FlashAttention-2: outer loop over Q blocks): Q read once, O written
    once, K and V read once per Q block: reads N·d + 2·d·Σ keys loaded (≈ 2·N²·d/Br without
    a mask, about half with one), writes N·d. Θ(N²·d/Br), independent of Bc.

    ``order="fa1"`` (FlashAttention-1, Algorithm 1: outer loop over K/V blocks): O, ℓ, m
    initialized in HBM (N·d + 2·N written); K and V read once (2·N·d); then for each K/V
    block every Q block is read with its O, ℓ, m, and O, ℓ, m written back:
    ≈ ⌈N/Bc⌉·(3·N·d + 4·N) elements. Θ(N²·d/Bc), independent of Br.

    No N² term in either: the scores never leave the chip.
    """
    _check_positive(n=n, d=d, block_q=block_q, block_k=block_k, batch=batch, heads=heads,
                    bytes_per_el=bytes_per_el)
    if order not in ORDERS:
        raise ValueError(f"order={order!r} is not one of {ORDERS}")
    k = batch * heads * bytes_per_el
    if order == "fa2":
        keys = kv_elements_loaded(n, block_q, block_k, causal)
        return HBMTraffic(read=k * (n * d + 2 * keys * d), write=k * n * d)
    rows = q_rows_loaded(n, block_q, block_k, causal)
    read = 2 * n * d + rows * (2 * d + 2)          # K, V once; Q, O, ℓ, m per pass
    write = (n * d + 2 * n) + rows * (d + 2)       # the initial O, ℓ, m; O, ℓ, m per pass
    return HBMTraffic(read=k * read, write=k * write)


def paper_block_sizes(d: int, sram_bytes: int, bytes_per_el: int = 2) -> tuple[int, int]:
    """The block sizes of FlashAttention's Algorithm 1 for on-chip memory of M elements
    (M = ``sram_bytes / bytes_per_el``): Bc = ⌈M / 4d⌉, Br = min(⌈M / 4d⌉, d) -> (Br, Bc).

    Bc = ⌈M/4d⌉ lets a K block, a V block, a Q block and an O block of about that many rows
    share the memory; Br is capped at d so the Br×Bc score tile fits too."""
    _check_positive(d=d, sram_bytes=sram_bytes, bytes_per_el=bytes_per_el)
    m = sram_bytes // bytes_per_el
    bc = max(1, math.ceil(m / (4 * d)))
    return min(bc, d), bc


def tiled_attention_hbm_for_sram(n: int, d: int, sram_bytes: int, *, batch: int = 1,
                                 heads: int = 1, bytes_per_el: int = 2) -> HBMTraffic:
    """FlashAttention-1 (Algorithm 1) with the paper's block sizes for ``sram_bytes`` of
    on-chip memory: Q, O, ℓ and m cross HBM once per block of Bc = ⌈M/4d⌉ keys, so the
    traffic is Θ(N²·d²/M) and keeps falling as M grows (until one block holds all N keys).

    The Br cap at d does not limit it: in this loop order the passes are counted in K/V
    blocks. (In FlashAttention-2's order the passes are counted in Q blocks instead:
    use :func:`tiled_attention_hbm` with the Br the kernel actually uses.)"""
    br, bc = paper_block_sizes(d, sram_bytes, bytes_per_el)
    return tiled_attention_hbm(n, d, br, bc, order="fa1", batch=batch, heads=heads,
                               bytes_per_el=bytes_per_el)


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

        (On a GPU the score tile and the accumulator live in registers, Q/K/V in shared
        memory; counting them all against shared memory is the conservative model.)"""
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


def roofline_seconds(traffic: HBMTraffic, flops: int, spec: ChipSpec) -> float:
    """Lower bound on time: the slower of moving the bytes and doing the FLOPs at peak."""
    return max(traffic.total / spec.hbm_bandwidth, flops / spec.peak_bf16_flops)
