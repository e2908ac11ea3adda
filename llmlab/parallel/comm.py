"""Communication in tensor parallelism: what is sent, what it costs here, what it would cost there.

* :func:`allreduce_per_token`: bytes all-reduced per layer and per token (analytic,
  exact for this implementation: two all-reduces of one hidden vector per layer, one for
  the embedding, one all-gather of the logits). The TP runs record the real calls with
  ``count_collectives``, so the two can be compared.
* :func:`time_allreduce`: measured all-reduce time against message size on the current
  process group (gloo on CPU here), run on every rank under ``launch``.
* :func:`tp_decode_model`: a **model**, not a measurement, of one decode step of a big
  model (Llama-2-70B shaped) on ``tp`` GPUs: per-rank weight and KV-cache reads at HBM
  bandwidth (or FLOPs at peak, whichever is slower) plus ring all-reduces over the
  interconnect with a per-hop latency. Decode is memory-bound, so splitting the weights
  over more GPUs divides the memory time, while the all-reduces add a cost that does
  not shrink with tp. Taught in notebook 07.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..profiling.flops import model_flops_per_token, weight_bytes

# Llama-2-70B's shape (Touvron et al. 2023, "Llama 2", table 1 and the released config).
LLAMA2_70B = ModelConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                         num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                         max_position_embeddings=4096, model_type="llama")


@dataclass(frozen=True)
class AllReducePerToken:
    """Per decoded token, for one sequence (multiply by batch for a batch)."""
    tp: int
    message_bytes: int            # one all-reduce's message: one hidden vector
    allreduces_per_layer: int     # 2: after attention's o_proj and after the MLP's down_proj
    per_layer_bytes: int          # bytes all-reduced per layer
    allreduces_per_token: int     # 2 per layer + 1 for the vocab-parallel embedding
    per_token_bytes: int          # total all-reduced bytes (message sizes, summed)
    ring_sent_bytes_per_rank: int  # what a ring all-reduce makes each rank send: 2(tp-1)/tp · message
    logits_gather_bytes: int      # the all-gathered logits (vocab entries)


def allreduce_per_token(config: ModelConfig, tp: int, bytes_per_el: int = 4) -> AllReducePerToken:
    """Analytic communication of one decoded token through the TP model."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    msg = config.hidden_size * bytes_per_el
    n = 2 * config.num_layers + 1
    ring = int(round(2 * (tp - 1) / tp * msg * n))
    return AllReducePerToken(tp=tp, message_bytes=msg, allreduces_per_layer=2,
                             per_layer_bytes=2 * msg, allreduces_per_token=n,
                             per_token_bytes=n * msg, ring_sent_bytes_per_rank=ring,
                             logits_gather_bytes=config.vocab_size * bytes_per_el)


def time_allreduce(sizes_bytes: list[int], repeats: int = 20, warmup: int = 3) -> list[dict]:
    """All-reduce time per message size on the current group; call on every rank.

    Each timed run counts as its slowest rank's time (an all-reduce finishes for everyone
    only when the last rank arrives). Returns rows {bytes, us (median over runs), us_q1,
    us_q3 (quartiles), us_min, us_max, algbw_GBps}: algbw = message bytes / median time
    (nccl-tests' name).
    """
    if not dist.is_initialized():
        raise RuntimeError("time_allreduce needs a process group; run it under llmlab.parallel.launch")
    if repeats < 5:
        raise ValueError(f"repeats={repeats}: a median needs at least 5 runs")
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    rows = []
    for size in sizes_bytes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32, device=dev)
        times = []
        for i in range(warmup + repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            if dev != "cpu":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # run by run, the slowest rank's time
        us = slowest * 1e6
        q1, med, q3 = (float(v) for v in torch.quantile(us, torch.tensor([0.25, 0.5, 0.75],
                                                                          dtype=torch.float64)))
        rows.append({"bytes": x.numel() * 4, "us": med, "us_q1": q1, "us_q3": q3,
                     "us_min": float(us.min()), "us_max": float(us.max()),
                     "algbw_GBps": x.numel() * 4 / (med * 1e-6) / 1e9})
    return rows


def fit_latency_bandwidth(rows: list[dict]) -> tuple[float, float]:
    """Least-squares fit of median time = latency + bytes / bandwidth over ``rows`` (from
    :func:`time_allreduce`); returns (latency in µs, bandwidth in GB/s). The bandwidth is
    ``math.inf`` when the time does not grow with the message size (within the noise, all
    of it is latency)."""
    if len(rows) < 2:
        raise ValueError(f"need at least 2 message sizes to fit, got {len(rows)}")
    b = torch.tensor([float(r["bytes"]) for r in rows], dtype=torch.float64)
    t = torch.tensor([r["us"] for r in rows], dtype=torch.float64)
    a = torch.stack([torch.ones_like(b), b], dim=1)
    latency, per_byte = torch.linalg.lstsq(a, t[:, None]).solution[:, 0].tolist()
    if per_byte <= 0:  # µs per byte: no growth with size
        return float(t.mean()), math.inf
    return latency, 1e-3 / per_byte  # bytes per µs are MB/s; / 1e3 gives GB/s


@dataclass(frozen=True)
class Hardware:
    """Numbers for the scaling model; ``link_GBps`` is one direction of one GPU's link."""
    name: str
    hbm_GBps: float
    peak_TFLOPs: float
    memory_GB: float
    link_GBps: float
    hop_latency_us: float


# Datasheet figures (NVIDIA A100 80GB SXM: 2039 GB/s HBM2e, 312 TFLOP/s dense bf16,
# NVLink 3 at 600 GB/s total = 300 GB/s each way). The per-hop latency is an assumption.
A100_NVLINK = Hardware("A100-80GB SXM, NVLink", 2039.0, 312.0, 80.0, 300.0, 2.0)
A100_PCIE = Hardware("A100-80GB, PCIe 4.0 x16", 2039.0, 312.0, 80.0, 25.0, 5.0)


@dataclass(frozen=True)
class TPStepEstimate:
    """One decode step on ``tp`` GPUs, modelled (seconds)."""
    tp: int
    memory_s: float      # per-rank weight + KV reads at HBM bandwidth
    compute_s: float     # per-rank FLOPs at peak
    comm_s: float        # all-reduces (2 per layer + embedding) and the logits all-gather
    fits: bool           # do the weights + KV cache fit in one GPU's memory?

    @property
    def device_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def total_s(self) -> float:
        return self.device_s + self.comm_s  # decode waits for each all-reduce: no overlap


def ring_allreduce_s(message_bytes: float, tp: int, link_GBps: float, hop_latency_us: float) -> float:
    """Ring all-reduce model: 2(tp-1) steps, each moving message/tp bytes over one link."""
    if tp == 1:
        return 0.0
    steps = 2 * (tp - 1)
    return steps * (message_bytes / tp / (link_GBps * 1e9) + hop_latency_us * 1e-6)


def tp_decode_model(tp: int, hw: Hardware = A100_NVLINK, config: ModelConfig = LLAMA2_70B,
                    batch: int = 1, context: int = 1024, bytes_per_el: int = 2) -> TPStepEstimate:
    """Model one decode step (``batch`` sequences, ``context`` tokens cached) on ``tp`` GPUs."""
    kv_ok = config.num_kv_heads % tp == 0 or tp % config.num_kv_heads == 0
    if tp < 1 or config.num_heads % tp or not kv_ok:
        raise ValueError(f"tp={tp} does not split {config.num_heads} heads / "
                         f"{config.num_kv_heads} KV heads")
    w = weight_bytes(config, bytes_per_el) / tp
    kv_heads_per_rank = max(1, config.num_kv_heads // tp)  # beyond num_kv_heads, KV heads are copied
    kv = (batch * context * config.num_layers * 2 * kv_heads_per_rank * config.head_dim
          * bytes_per_el)
    memory_s = (w + kv) / (hw.hbm_GBps * 1e9)
    compute_s = batch * model_flops_per_token(config, context) / tp / (hw.peak_TFLOPs * 1e12)
    msg = batch * config.hidden_size * bytes_per_el
    n = 2 * config.num_layers + 1
    comm_s = n * ring_allreduce_s(msg, tp, hw.link_GBps, hw.hop_latency_us)
    if tp > 1:  # all-gather of the logits: (tp-1) steps of vocab/tp entries
        comm_s += (tp - 1) * (batch * config.vocab_size * bytes_per_el / tp / (hw.link_GBps * 1e9)
                              + hw.hop_latency_us * 1e-6)
    fits = w + kv <= hw.memory_GB * 1e9
    return TPStepEstimate(tp, memory_s, compute_s, comm_s, fits)
