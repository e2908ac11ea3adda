"""Functions that run on every rank under :func:`llmlab.parallel.launch` (or torchrun).

Each loads this rank's shard, does its part in lockstep with the other ranks, and
returns something small to rank 0: logits for a parity check, generated tokens with
time per token, and what each rank holds in memory. They live in a module (not in a
notebook) because spawned ranks import them by name. Taught in notebook 07.
"""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..layers.linear import ColumnParallelLinear, RowParallelLinear, count_collectives
from .generate import greedy_generate
from .group import current
from ..config import ModelConfig
from ..models.fetch import resolve
from .loader import load_tp_model, read_shards
from .model import parameter_bytes


@dataclass
class RankMemory:
    """One rank's memory: its parameters, what it read from the checkpoint, its process peak."""
    rank: int
    param_bytes: int
    bytes_read: int
    peak_bytes: int          # process peak RSS (VmHWM) on CPU; CUDA max_memory_allocated on GPU
    heads: int               # query heads on this rank
    kv_heads: int


@dataclass
class TPRun:
    """What rank 0 sends back from :func:`generate_on_ranks` / :func:`parity_on_ranks`."""
    tp: int
    tokens: list[int]
    prefill_s: float
    s_per_token: float
    load_s: float
    memory: list[RankMemory] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [batch, seq, vocab] for the parity prompt
    device: str = "cpu"
    collectives: list[tuple[str, int]] = field(default_factory=list)  # one decode step's (op, bytes)
    decode_s: list[float] = field(default_factory=list)  # every decode step's time (rank 0's clock)


def _peak_rss() -> int:
    """This process's resident-set high-water mark in bytes.

    /proc's VmHWM belongs to the process's own address space; getrusage's maxrss survives
    exec on Linux, so a rank spawned from a large notebook kernel would report the kernel's.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _memory(model, load_bytes: int) -> RankMemory:
    ctx = current()
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device)
    else:
        peak = _peak_rss()
    attn = model.layers[0].self_attn
    return RankMemory(ctx.rank, parameter_bytes(model), load_bytes, peak,
                      attn.num_heads, attn.num_kv_heads)


def _gather(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def generate_on_ranks(model_name: str, prompt_ids: list[int], max_new_tokens: int,
                      attention: str = "naive", dtype: str = "float32",
                      logits_for: torch.Tensor | None = None,
                      eos_token_id: int | None = None) -> TPRun:
    """Load this rank's shard, optionally compute full logits for ``logits_for`` [batch, seq],
    then generate greedily from ``prompt_ids``. Every rank returns the same TPRun."""
    ctx = current()
    t0 = time.perf_counter()
    model = load_tp_model(model_name, attention=attention, device=ctx.device, dtype=dtype)
    load_s = time.perf_counter() - t0
    logits = None
    if logits_for is not None:
        with torch.inference_mode():
            logits = model(logits_for.to(ctx.device)).float().cpu()
    gen = greedy_generate(model, list(prompt_ids), max_new_tokens, eos_token_id)
    with torch.inference_mode(), count_collectives() as log:  # what one token's pass sends
        model(torch.tensor([[prompt_ids[0]]], device=ctx.device))
    memory = _gather(_memory(model, model.tp_bytes_read))
    return TPRun(tp=ctx.world_size, tokens=gen.tokens, prefill_s=gen.prefill_s,
                 s_per_token=gen.s_per_token, load_s=load_s, memory=memory, logits=logits,
                 device=str(ctx.device), collectives=log.calls, decode_s=list(gen.decode_s))


def parity_on_ranks(model_name: str, input_ids: torch.Tensor, new_tokens: int,
                    eos_token_id: int | None = None) -> TPRun:
    """Logits for ``input_ids`` [batch, seq] and up to ``new_tokens`` greedy tokens after its
    first row (stopping after ``eos_token_id``)."""
    return generate_on_ranks(model_name, input_ids[0].tolist(), new_tokens,
                             logits_for=input_ids, eos_token_id=eos_token_id)



def mlp_backward_on_ranks(hidden: int, intermediate: int, tokens: int, seed: int = 0) -> dict:
    """Forward and backward of a column->row parallel MLP pair against the same seeded
    full weights; returns the output, the input gradient and the gathered weight gradients.

    This exercises both conjugate operators: the all-reduce in the forward pass (after
    the row-parallel layer) and the all-reduce of the input gradient (before the
    column-parallel layer).
    """
    ctx = current()
    g = torch.Generator().manual_seed(seed)
    w_up = torch.randn(intermediate, hidden, generator=g) / hidden ** 0.5
    w_down = torch.randn(hidden, intermediate, generator=g) / intermediate ** 0.5
    x = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    up = ColumnParallelLinear(hidden, intermediate)
    down = RowParallelLinear(intermediate, hidden)
    (a, b), (c, d) = up.shard_range(), down.shard_range()
    with torch.no_grad():
        up.weight.copy_(w_up[a:b])
        down.weight.copy_(w_down[:, c:d])
    y = down(torch.nn.functional.silu(up(x)))
    y.pow(2).sum().backward()
    grads_up = _gather(up.weight.grad)
    grads_down = _gather(down.weight.grad)
    return {"tp": ctx.world_size, "y": y.detach(), "x_grad": x.grad,
            "w_up_grad": torch.cat(grads_up, dim=0), "w_down_grad": torch.cat(grads_down, dim=1)}


def run_sequence(calls: list[tuple]) -> list:
    """Run several workers in one launch (spawning ranks costs seconds): calls = [(fn, args), ...]."""
    return [fn(*args) for fn, args in calls]


@dataclass
class StepAccount:
    """One rank's decode step, timed whole and taken apart (from :func:`decode_account_on_ranks`).

    ``step_s`` and ``collective_s``: every timed step's wall time and the part of it spent
    inside collectives (all-reduces, the logits all-gather), from the same unprofiled runs.
    ``matmul_s``: median time inside the matrix multiplies, from profiled runs of the same
    step. ``ops``: operator calls in one step (Python → dispatcher crossings, collectives
    included); ``op_overhead_s``: what one tiny operator costs on this rank, measured while
    the other ranks measure theirs (:func:`llmlab.profiling.overhead.measure_op_overhead`).
    ``matmul_runs``: the matmul time of each profiled run (``matmul_s`` is their median).
    ``arrival_wait_s``: per timed step, the part of ``collective_s`` this rank spent before
    the last rank reached the same call (the ranks' start times compared on one clock).
    """
    tp: int
    rank: int
    threads: int
    step_s: list[float]
    collective_s: list[float]
    collectives: int          # collective calls per step
    matmul_s: float
    ops: int                  # operator calls per step, collectives and matmuls included
    matmul_ops: int
    op_overhead_s: float
    matmul_runs: list[float] = field(default_factory=list)  # each profiled run's matmul time
    arrival_wait_s: list[float] = field(default_factory=list)  # per step: before the last rank came

    @property
    def arrival_wait_median_s(self) -> float:
        """Median over the steps of the time inside collectives before the last rank arrived."""
        return _median(self.arrival_wait_s) if self.arrival_wait_s else 0.0

    @property
    def median_s(self) -> float:
        return _median(self.step_s)

    @property
    def inside_collectives_s(self) -> float:
        return _median(self.collective_s)

    @property
    def other_s(self) -> float:
        """The rest of the median step: operators other than matmuls, Python, the dispatcher."""
        return self.median_s - self.inside_collectives_s - self.matmul_s

    @property
    def other_ops(self) -> int:
        """Operator calls that are neither matmuls nor collectives (norms, RoPE, attention,
        cache writes, elementwise, views)."""
        return self.ops - self.collectives - self.matmul_ops


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2 if s else float("nan")


class _CollectiveClock:
    """Times every ``torch.distributed`` all-reduce and all-gather this process makes (the
    parallel layers call them through the module, so patching its attributes catches them).
    ``entered`` holds each call's start (``time.perf_counter``, one clock for every process
    on the machine), so that the ranks' arrivals can be compared afterwards."""

    NAMES = ("all_reduce", "all_gather")

    def __init__(self):
        self.seconds, self.calls, self.entered, self._saved = 0.0, 0, [], {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name)
            self._saved[name] = fn

            def timed(*args, _fn=fn, **kwargs):
                t = time.perf_counter()
                self.entered.append(t)
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t
                    self.calls += 1
            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False

    def reset(self) -> None:
        self.seconds, self.calls, self.entered = 0.0, 0, []


def _arrival_waits(entered: list[list[float]]) -> list[float]:
    """Per step, the time this rank spent in its collectives before the last rank arrived:
    the sum over calls of (the last rank's start - this rank's start). ``entered``: this
    rank's call starts, one list per step; every rank passes its own, on every rank."""
    ranks = _gather(entered)
    me = current().rank
    return [sum(max(r[i][j] for r in ranks) - ranks[me][i][j] for j in range(len(ranks[me][i])))
            for i in range(len(entered))]


def _account(step, repeats: int, warmup: int, profiled: int) -> StepAccount:
    """Time ``step`` on this rank and take it apart (see :func:`decode_account_on_ranks`)."""
    from ..profiling.overhead import MIN_REPEATS, _count, _matmul_seconds, _profiled
    from ..profiling.overhead import measure_op_overhead

    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats={repeats} must be >= {MIN_REPEATS} (a median of at least five)")
    ctx = current()
    sync = dist.barrier if ctx.world_size > 1 else (lambda: None)
    profile_at = {round(i * repeats / profiled) for i in range(profiled)}
    step_s, coll_s, entered, matmul, counted, calls = [], [], [], [], None, 0
    with _CollectiveClock() as clock:
        for i in range(warmup + repeats):
            sync()
            clock.reset()
            t = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - t)
            coll_s.append(clock.seconds)
            entered.append(list(clock.entered))   # before a profiled run adds to it
            calls = clock.calls
            if i - warmup not in profile_at:
                continue
            sync()
            with _profiled() as prof:
                step()
            events = prof.events()
            matmul.append(_matmul_seconds(events, ctx.device.type == "cuda"))
            counted = counted or _count(events)
    sync()
    waits = _arrival_waits(entered[warmup:])
    t_op = measure_op_overhead(calls=2000, rounds=5, device=ctx.device)
    return StepAccount(ctx.world_size, ctx.rank, torch.get_num_threads(), step_s[warmup:],
                       coll_s[warmup:], calls, _median(matmul), counted.total,
                       sum(counted.matmul.values()), t_op, list(matmul), waits)


def decode_account_on_ranks(model_name: str, context: int, repeats: int = 9, warmup: int = 2,
                            profiled: int = 3, attention: str = "naive",
                            dtype: str = "float32") -> list[StepAccount]:
    """Time this rank's decode step (one token after ``context`` cached ones) and take it
    apart: matmuls, everything else, time inside collectives. Every rank returns the list
    of all ranks' :class:`StepAccount`, in rank order.

    Each step starts after a barrier (outside its time), as a decode step starts after the
    previous step's logits all-gather. The ``repeats`` timed steps run unprofiled; the
    ``profiled`` ones (interleaved) give the matmul time and the operator count.
    """
    from ..profiling.overhead import make_decode_step

    ctx = current()
    model = load_tp_model(model_name, attention=attention, device=ctx.device, dtype=dtype)
    step = make_decode_step(model, batch=1, context=context, steps=warmup + repeats + profiled + 1)
    return _gather(_account(step, repeats, warmup, profiled))


def mlp_stack_on_ranks(model_name: str, repeats: int = 9, warmup: int = 2, profiled: int = 5,
                       seed: int = 0) -> list[StepAccount]:
    """The MLP half of every decoder layer of ``model_name``, for one decode token, split
    over the ranks by features, timed and taken apart as :func:`decode_account_on_ranks`
    does. Every rank returns the list of all ranks' :class:`StepAccount`, in rank order.

    Each rank reads only its slices of the checkpoint's ``gate_proj`` and ``up_proj`` (rows:
    column-parallel) and ``down_proj`` (columns: row-parallel); per layer it computes
    ``x + down(silu(gate(n)) * up(n))`` with ``n`` the RMS-normed ``x``, and the
    row-parallel ``down`` ends in one all-reduce of one hidden vector. The MLP features split
    evenly over any degree dividing them, so this runs where the heads do not split (SmolLM2
    at tp = 2); attention is left out.
    """
    from ..layers.linear import column_parallel_forward, row_parallel_forward

    ctx = current()
    path = resolve(model_name)
    cfg = ModelConfig.from_file(path)
    plan = {}
    for i in range(cfg.num_layers):
        plan[f"layers.{i}.post_attention_layernorm.weight"] = None
        plan[f"layers.{i}.mlp.gate_proj.weight"] = 0
        plan[f"layers.{i}.mlp.up_proj.weight"] = 0
        plan[f"layers.{i}.mlp.down_proj.weight"] = 1
    w, _ = read_shards(path, plan, ctx.rank, ctx.world_size)
    w = {k: v.to(device=ctx.device, dtype=torch.float32) for k, v in w.items()}
    x0 = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    x0 = x0.to(ctx.device)
    eps = cfg.rms_norm_eps

    @torch.inference_mode()
    def step() -> torch.Tensor:
        x = x0
        for i in range(cfg.num_layers):
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            n = n * w[f"layers.{i}.post_attention_layernorm.weight"]
            h = F.silu(column_parallel_forward(n, w[f"layers.{i}.mlp.gate_proj.weight"]))
            h = h * column_parallel_forward(n, w[f"layers.{i}.mlp.up_proj.weight"])
            x = x + row_parallel_forward(h, w[f"layers.{i}.mlp.down_proj.weight"])
        return x

    return _gather(_account(step, repeats, warmup, profiled))
