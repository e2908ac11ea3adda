"""Split-KV decode (flash-decoding): attention over one sequence's keys split into ranges,
each range's partial output with its log-sum-exp, and the exact merge.

Softmax attention over keys ``0..n-1`` split into ranges ``R_1 … R_S``::

    o_s   = Σ_{j∈R_s} exp(x_j − lse_s) v_j          lse_s = log Σ_{j∈R_s} exp(x_j)
    out   = Σ_s exp(lse_s − L) · o_s                 L     = log Σ_s exp(lse_s)

(x_j = q·k_j · scale). Each o_s is normalized over its own range only, so merging needs
every range's lse: the weights ``exp(lse_s − L)`` are each range's share of the whole
softmax sum. Averaging the o_s, or weighting by ``exp(max_s)`` instead of ``exp(lse_s)``,
is wrong whenever the ranges hold different amounts of probability mass. A range that
sees no key has lse −inf and weight 0.

Why split: a decode step of one long sequence gives the unsplit kernel one program per
(sequence, KV head); a GPU with 132 SMs then runs 3 programs for SmolLM2 at batch 1.
Splitting the keys multiplies the programs by S, and the merge costs one small pass over
S · heads · head_dim floats. :func:`choose_num_splits` picks S from the work and the
chip's SM count, as FlashAttention-2's ``num_splits_heuristic`` does
(``csrc/flash_attn/flash_api.cpp``, https://github.com/Dao-AILab/flash-attention);
:func:`split_occupancy` is a model of how full the chip is for each S.

Backends (with-KV-cache form, see :mod:`llmlab.attention.paged`):

``paged_split``
    the PyTorch reference: :func:`split_kv_partials` then :func:`merge_partials`.
``paged_triton_split``
    the Triton kernels (:func:`llmlab.kernels.paged_attn.paged_attention_split`), with
    S from :func:`choose_num_splits` for the device (1 in the interpreter, where there are
    no SMs to fill, unless ``num_splits`` is given).

Taught in notebook 14.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import register
from .paged import _grouped_mask, check_paged_args, gather_kv, paged_mask
from .reference import group_queries, ungroup_queries

# FlashAttention-2's rule: split only when the unsplit grid fills less than 80% of the
# chip's slots, then take the fewest splits that reach 85% of the best wave efficiency
FILL_THRESHOLD = 0.8
EFFICIENCY_SHARE = 0.85
MAX_SPLITS = 128


def split_bounds(length: int, num_splits: int, tile: int = 1) -> list[tuple[int, int]]:
    """The key range ``[lo, hi)`` of each split of a sequence of ``length`` keys.

    The keys are dealt out in runs of whole tiles of ``tile`` keys: each split gets
    ``ceil(ceil(length / tile) / num_splits)`` tiles, the last ones fewer or none (then
    ``lo == hi``). The Triton kernel uses this rule with ``tile = BLOCK_N``.
    """
    for name, value, low in (("length", length, 0), ("num_splits", num_splits, 1),
                             ("tile", tile, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    per_split = -(-(-(-length // tile)) // num_splits) * tile
    return [(min(s * per_split, length), min((s + 1) * per_split, length))
            for s in range(num_splits)]


def split_kv_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cache_seqlens: torch.Tensor, block_table: torch.Tensor, num_splits: int,
                      *, softmax_scale: float | None = None, causal: bool = True,
                      tile: int = 1, max_seqlen_k: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's partial attention, in float32, from the paged pool.

    Shapes as :mod:`llmlab.attention.paged`. Returns ``(o, lse)``: ``o [num_splits, batch,
    seq_q, heads, head_dim]``, the softmax over the split's keys only (zeros where a row
    sees none of them), and ``lse [num_splits, batch, seq_q, heads]``, the natural
    log-sum-exp of the row's scaled scores over those keys (-inf where it sees none).
    Splits follow :func:`split_bounds` per sequence with ``tile`` keys per tile.
    """
    longest = check_paged_args(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k)
    batch, seq_q, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    length = max(longest, 1)
    k = gather_kv(k_cache, block_table, length).transpose(1, 2).float()   # [b, kv, L, d]
    v = gather_kv(v_cache, block_table, length).transpose(1, 2).float()
    qg = group_queries(q.float(), kv_heads)                                # [b, kv, g*sq, d]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale                # [b, kv, g*sq, L]
    allowed = paged_mask(cache_seqlens.to(q.device), seq_q, length, causal)   # [b, sq, L]
    key_pos = torch.arange(length, device=q.device)
    outs, lses = [], []
    bounds = [split_bounds(int(n), num_splits, tile) for n in cache_seqlens.tolist()]
    for s in range(num_splits):
        lo = torch.tensor([b[s][0] for b in bounds], device=q.device)
        hi = torch.tensor([b[s][1] for b in bounds], device=q.device)
        in_split = (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] < hi[:, None])
        mask = _grouped_mask(allowed & in_split[:, None, :], heads // kv_heads)
        x = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(x, dim=-1)                                  # [b, kv, g*sq]
        p = torch.exp(x - lse.nan_to_num(0.0, neginf=0.0)[..., None])     # all -inf -> 0
        outs.append(ungroup_queries(torch.matmul(p, v), seq_q))
        lses.append(ungroup_queries(lse[..., None], seq_q)[..., 0])
    return torch.stack(outs), torch.stack(lses)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge: ``o [splits, ..., head_dim]``, ``lse [splits, ...]`` -> (out [...,
    head_dim], L [...]) with ``out = Σ_s exp(lse_s − L) o_s`` and ``L = log Σ_s exp(lse_s)``.

    Subtracts the largest lse first so no exp overflows; rows where every split is -inf
    (no key at all) give zeros and L = -inf.
    """
    if o.shape[:-1] != lse.shape:
        raise ValueError(f"o {tuple(o.shape)} must be lse {tuple(lse.shape)} plus head_dim")
    top = lse.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)                                              # [splits, ...]
    total = w.sum(dim=0)
    out = (w[..., None] * o).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    return out, top + torch.log(total)


def paged_attention_split_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                    v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                                    block_table: torch.Tensor, *, num_splits: int = 4,
                                    softmax_scale: float | None = None, causal: bool = True,
                                    max_seqlen_k: int | None = None) -> torch.Tensor:
    """Split-KV attention in PyTorch: :func:`split_kv_partials` + :func:`merge_partials`."""
    o, lse = split_kv_partials(q, k_cache, v_cache, cache_seqlens, block_table, num_splits,
                               softmax_scale=softmax_scale, causal=causal,
                               max_seqlen_k=max_seqlen_k)
    return merge_partials(o, lse)[0].to(q.dtype)


# ---- how many splits ---------------------------------------------------------------------------

def choose_num_splits(programs: int, num_key_tiles: int, num_sms: int,
                      blocks_per_sm: int = 1, max_splits: int = MAX_SPLITS) -> int:
    """The number of splits for a grid of ``programs`` unsplit programs (batch · kv_heads ·
    query tiles), each walking ``num_key_tiles`` key tiles, on ``num_sms`` SMs that each
    hold ``blocks_per_sm`` programs at once.

    FlashAttention-2's rule: no split when the grid already fills 80% of the slots
    (``num_sms · blocks_per_sm``); otherwise, for each S up to ``min(max_splits, slots,
    num_key_tiles)``, the wave efficiency ``w / ceil(w)`` with ``w = programs · S / slots``
    (S that give the same tiles per split as S − 1 are skipped), and the smallest S within
    85% of the best: more splits than needed only add partials to write and merge.
    """
    for name, value in (("programs", programs), ("num_key_tiles", num_key_tiles),
                        ("num_sms", num_sms), ("blocks_per_sm", blocks_per_sm),
                        ("max_splits", max_splits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    slots = num_sms * blocks_per_sm
    if programs >= FILL_THRESHOLD * slots:
        return 1
    top = min(max_splits, slots, num_key_tiles)
    efficiency = {}
    for s in range(1, top + 1):
        if s > 1 and -(-num_key_tiles // s) == -(-num_key_tiles // (s - 1)):
            continue                                  # the same tiles per split as s - 1
        waves = programs * s / slots
        efficiency[s] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= EFFICIENCY_SHARE * best)


@dataclass(frozen=True)
class SplitOccupancy:
    """What a model says about one split count (see :func:`split_occupancy`)."""

    num_splits: int
    programs: int          # programs of the split kernel
    waves: int             # rounds of programs the chip runs, slots at a time
    sm_busy: float         # mean share of the chip's slots busy over those waves
    step_time: float       # modeled time, in units of one program walking every key tile
    merge_share: float     # modeled share of step_time spent on the merge


def split_occupancy(batch: int, kv_heads: int, context: int, num_splits: int,
                    num_sms: int = 132, blocks_per_sm: int = 1, block_n: int = 64,
                    query_tiles: int = 1, launch: float = 0.005,
                    partial_tiles: float = 0.1) -> SplitOccupancy:
    """A model of a split-KV decode step on a GPU with ``num_sms`` SMs (132: H100 SXM).

    ``batch · kv_heads · query_tiles`` programs per split, each walking ``ceil(tiles /
    num_splits)`` of the ``ceil(context / block_n)`` key tiles, run in waves of ``num_sms
    · blocks_per_sm`` (``blocks_per_sm`` from the compile report's occupancy). Time is in
    units of one program walking every tile: a wave lasts as long as its programs' walk.
    With more than one split, the merge adds a second launch (``launch``) and, per split,
    the partials' bytes written and read again, ``partial_tiles`` key tiles' worth (a
    [group, head_dim] float32 partial is ~1/20 of a 64-key bfloat16 K+V tile, twice).
    A model, not a measurement: it ignores that HBM bandwidth, not programs, limits a
    full chip, which only makes more splits than one wave worth even less.
    """
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("context", context),
                        ("num_splits", num_splits), ("num_sms", num_sms),
                        ("blocks_per_sm", blocks_per_sm), ("block_n", block_n),
                        ("query_tiles", query_tiles)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    tiles = -(-context // block_n)
    per_split = -(-tiles // num_splits)
    used = -(-tiles // per_split)                 # splits that get any key
    programs = batch * kv_heads * query_tiles * used
    slots = num_sms * blocks_per_sm
    waves = -(-programs // slots)
    walk = waves * per_split / tiles
    merge = (launch + num_splits * partial_tiles / tiles) if num_splits > 1 else 0.0
    return SplitOccupancy(num_splits, programs, waves, programs / (waves * slots),
                          walk + merge, merge / (walk + merge))


# ---- the backends ---------------------------------------------------------------------------

def device_sms(device: torch.device | str) -> int | None:
    """The SM count of a CUDA device, None elsewhere (the interpreter has no SMs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_split_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
                                 softmax_scale: float | None = None, causal: bool = True,
                                 max_seqlen_k: int | None = None,
                                 num_splits: int | None = None) -> torch.Tensor:
    """The Triton split-KV kernels; ``num_splits`` None picks it with
    :func:`choose_num_splits` for the device's SMs (1 where there are none to fill)."""
    longest = check_paged_args(q, k_cache, v_cache, cache_seqlens, block_table, max_seqlen_k)
    from ..kernels.paged_attn import BLOCK_M, paged_attention_split, split_tile

    if num_splits is None:
        sms = device_sms(q.device)
        batch, seq_q, heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        block_n = split_tile(q.dtype, head_dim)[1]
        m_tiles = -(-(seq_q * heads // kv_heads) // BLOCK_M)
        num_splits = 1 if sms is None else choose_num_splits(
            batch * kv_heads * m_tiles, max(-(-longest // block_n), 1), sms)
    return paged_attention_split(q, k_cache, v_cache, cache_seqlens, block_table, num_splits,
                                 softmax_scale=softmax_scale, causal=causal)


def _needs_paged_cache(name: str):
    def forward(q, k, v, *, causal=True, softmax_scale=None, key_padding_mask=None):
        raise ValueError(f"attention backend {name!r} reads K/V through a block table and needs "
                         "a paged KV cache (llmlab.cache.paged.PagedKVCache); for dense "
                         "attention use 'naive' or 'sdpa'")
    forward.__name__ = f"{name}_forward"
    return forward


register("paged_split", _needs_paged_cache("paged_split"),
         with_kvcache=paged_attention_split_reference,
         description="PyTorch reference of split-KV decode: 4 partials with their "
                     "log-sum-exp, merged exactly")
register("paged_triton_split", _needs_paged_cache("paged_triton_split"),
         with_kvcache=paged_attention_split_triton,
         description="Triton split-KV (flash-decoding): splits chosen from the SM count, "
                     "partials merged by a second kernel")

__all__ = ["split_bounds", "split_kv_partials", "merge_partials",
           "paged_attention_split_reference", "paged_attention_split_triton",
           "choose_num_splits", "split_occupancy", "SplitOccupancy", "device_sms"]
