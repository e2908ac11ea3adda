"""Overhead: how many operators one step calls, what each call costs, and the time outside
the matrix multiplies. Taught in notebook 11.

A float32 decode step of a small model moves its weights once (a memory-roof time) but
also makes hundreds of eager operator calls, each paying Python, the dispatcher and an
allocation whatever its size. The *overhead roofline* adds the second cost to the first::

    step time ≈ max(bytes / bandwidth, FLOPs / peak) + ops · t_op

with the two roofs measured by :func:`llmlab.profiling.roofline.measure_ceilings`, ``ops``
counted by :func:`count_ops` and ``t_op`` (the cost of one tiny eager op) measured by
:func:`measure_op_overhead`. The formula is a *model*; :func:`step_breakdown` measures.

What the counter sees. :func:`count_ops` runs the function once under ``torch.profiler``
(the dispatcher's RecordFunction hook) and counts the *top-level* operator calls: each
``aten::``/``llmlab::``/... op entered from Python or from compiled wrapper code, not the
ops an operator calls inside its own kernel (``aten::linear`` counts once, not also its
``aten::t`` and ``aten::mm``). That is the number of times a step crosses from Python
into the dispatcher. A ``TorchDispatchMode`` would not do: an active one makes
``torch.compile`` fall back to eager, and outside ``inference_mode`` it decomposes
composite ops (SDPA into its math form), changing what it measures. For a function
compiled by Inductor the profiler sees what actually crosses the dispatcher at run time:
the extern kernels (``aten::mm``/``aten::addmm``, custom ops such as ``llmlab::...``) and
allocations (``aten::empty_strided``); the fused C++/Triton kernels Inductor generates are
called directly and are not operators, so a fused graph counts few ops. The C decode
kernels of the quantized layers are operators (``llmlab::int8_gemv``, ...): in eager mode
the layers call them through the dispatcher whenever the profiler runs, so they count as
matmuls here (unprofiled eager runs skip the dispatcher for them, about 1.8 µs a call).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import ModelConfig
from ..device import default_device, sync
from .compare import FASTER, MIN_RUNS, SLOWER, Comparison, compare
from .roofline import Ceilings, decode_cost, measure_ceilings
from .timer import Timer, time_fn

#: Operators whose time counts as "inside the matrix multiplies" (names without namespace;
#: every op of the ``llmlab`` namespace counts too: the C decode kernels as custom ops).
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "baddbmm",
                        "_weight_int8pack_mm", "_weight_int4pack_mm",
                        "_weight_int4pack_mm_for_cpu"})
#: llmlab's own matmul-like operators: the CPU GEMVs (``llmlab::q4_gemv``, ...) and the
#: dequantize before a prefill GEMM; ``llmlab::static_attend`` is attention, not one of them.
LLMLAB_MATMULS = ("gemv", "dequantize")
#: Namespaces of operators (profiler events named ``namespace::name``).
OP_NAMESPACES = frozenset({"aten", "prims", "llmlab", "quantized", "_c10d_functional",
                           "c10d", "inductor"})


def is_op(name: str) -> bool:
    """True when a profiler event name is an operator (``aten::add``, ``llmlab::gemv``)."""
    ns, sep, op = name.partition("::")
    return bool(sep) and ns in OP_NAMESPACES and bool(op)


def is_matmul(name: str) -> bool:
    """True for a matmul-like operator name (``aten::mm``, ``aten::linear``,
    ``llmlab::*_gemv``, ``llmlab::dequantize``)."""
    ns, sep, op = name.partition("::")
    if not sep:
        return False
    if ns == "llmlab":
        return op.endswith(LLMLAB_MATMULS)
    return ns == "aten" and op in MATMUL_OPS


@dataclass
class OpCount:
    """The operator calls of one run of a function.

    ``total``: top-level operator calls (Python → dispatcher crossings); ``by_name``: the
    same calls by operator name (``"aten::add"``); ``matmul``: the matmul-like subset by
    name; ``nested_total``: every operator call, those made inside other operators too.
    """
    total: int
    by_name: Counter = field(default_factory=Counter)
    matmul: Counter = field(default_factory=Counter)
    nested_total: int = 0

    @property
    def matmul_calls(self) -> int:
        """Top-level matmul-like calls."""
        return sum(self.matmul.values())

    @property
    def other_calls(self) -> int:
        """Top-level calls that are not matmul-like (norms, RoPE, attention, views, copies)."""
        return self.total - self.matmul_calls

    def __repr__(self) -> str:
        return (f"OpCount(total={self.total}, matmul={self.matmul_calls}, "
                f"other={self.other_calls}, nested_total={self.nested_total})")


@contextlib.contextmanager
def _profiled():
    from torch.profiler import ProfilerActivity, profile

    from .breakdown import _native_stderr_silenced

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with _native_stderr_silenced(), profile(activities=acts) as prof:
        yield prof


def _op_parent(ev):
    """The nearest enclosing operator event of ``ev``, or None."""
    p = ev.cpu_parent
    while p is not None and not is_op(p.name):
        p = p.cpu_parent
    return p


def _count(events) -> OpCount:
    ops = [ev for ev in events if is_op(ev.name)]
    top = [ev for ev in ops if _op_parent(ev) is None]
    by_name = Counter(ev.name for ev in top)
    matmul = Counter({k: v for k, v in by_name.items() if is_matmul(k)})
    return OpCount(len(top), by_name, matmul, len(ops))


def count_ops(fn: Callable, *args, **kwargs) -> OpCount:
    """Run ``fn(*args, **kwargs)`` once and count its operator calls (see the module
    docstring for what is seen). Works inside ``torch.inference_mode()`` and for a
    ``torch.compile``d ``fn`` (run it once before, so that compiling is not counted).

    >>> count_ops(lambda a, b: (a + 1) + (a @ b) + 2, x, y).total   # 3 adds, 1 matmul
    4
    """
    with _profiled() as prof:
        fn(*args, **kwargs)
        sync()
    return _count(prof.events())


@dataclass(frozen=True)
class TracedOp:
    """One top-level operator call of a traced run: name, start and duration (µs from the
    run's first call), and whether it is matmul-like."""
    name: str
    start_us: float
    duration_us: float
    matmul: bool


def trace_ops(fn: Callable, *args, **kwargs) -> list[TracedOp]:
    """Run ``fn(*args, **kwargs)`` once under the profiler and return its top-level operator
    calls in time order (what :func:`count_ops` counts), each with its start and duration.
    The gaps between consecutive calls are time spent outside any operator: Python and the
    way into the dispatcher."""
    with _profiled() as prof:
        fn(*args, **kwargs)
        sync()
    top = sorted((ev for ev in prof.events() if is_op(ev.name) and _op_parent(ev) is None),
                 key=lambda ev: ev.time_range.start)
    if not top:
        return []
    t0 = top[0].time_range.start
    return [TracedOp(ev.name, ev.time_range.start - t0,
                     ev.time_range.end - ev.time_range.start, is_matmul(ev.name)) for ev in top]


def measure_op_overhead(calls: int = 2000, rounds: int = 7, warmup: int = 1,
                        inference: bool = True, device=None) -> float:
    """t_op: seconds one tiny eager operator costs on this machine.

    Times ``calls`` back-to-back ``x + x`` on a 1-element tensor (the Python call, the
    dispatcher, the output's allocation and a trivial kernel; on a GPU the launch) and
    divides by ``calls``; returns the median of ``rounds`` rounds after ``warmup`` rounds.
    ``inference``: run under ``torch.inference_mode()`` as the decode steps do (no
    autograd bookkeeping).
    """
    if calls < 1 or rounds < 5:
        raise ValueError(f"calls={calls} must be >= 1 and rounds={rounds} >= 5 "
                         "(a median of at least five)")
    dev = torch.device(device) if device is not None else default_device()
    ctx = torch.inference_mode() if inference else contextlib.nullcontext()
    with ctx:
        x = torch.ones(1, device=dev)

        def one_round() -> float:
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                x + x
            sync(dev)
            return (time.perf_counter() - t0) / calls

        for _ in range(warmup):
            one_round()
        return statistics.median(one_round() for _ in range(rounds))


@dataclass
class OverheadBreakdown:
    """One step's wall time split into matrix multiplies and everything else (seconds).

    ``median_s``, ``min_s``, ``max_s``: wall time of ``repeats`` unprofiled runs after a
    warm-up. ``matmul_s``: median time inside the matmul-like operators, measured in
    separate profiled runs. ``outside_s = median_s - matmul_s``, so the two parts add up
    to the wall time; "outside" is Python, the dispatcher, allocations, and every small op
    (norms, RoPE, attention, cache writes, elementwise), on a GPU also launch gaps.
    ``profiled_s``: median wall time of the profiled runs (how much profiling slowed the
    step; not used in the split). ``ops``: the operator count of one profiled run. The two
    medians come from different runs: on a busy machine (another process on the cores a
    multi-threaded kernel waits for) ``matmul_s`` can even exceed ``median_s``; rerun
    when ``outside_s`` is negative or ``min_s``–``max_s`` is wide.
    """
    median_s: float
    min_s: float
    max_s: float
    matmul_s: float
    profiled_s: float
    ops: OpCount
    times_s: list[float] = field(default_factory=list)
    matmul_times_s: list[float] = field(default_factory=list)

    @property
    def outside_s(self) -> float:
        return self.median_s - self.matmul_s

    @property
    def outside_times_s(self) -> list[float]:
        """Each timed run minus the median time inside the matmuls: samples whose median is
        ``outside_s`` and whose spread is the wall time's (the matmul median's own
        uncertainty is not in it). Empty on a run where one of them is not positive."""
        out = [t - self.matmul_s for t in self.times_s]
        return out if out and min(out) > 0 else []

    @property
    def outside_per_op_s(self) -> float:
        """Outside time per operator call: the t_op this step effectively paid (Python
        between the calls and the small kernels included), to set beside
        :func:`measure_op_overhead`'s tiny-op t_op."""
        return self.outside_s / self.ops.total if self.ops.total else 0.0

    @property
    def outside_share(self) -> float:
        """Fraction of the step spent outside the matmuls."""
        return self.outside_s / self.median_s

    def __repr__(self) -> str:
        return (f"OverheadBreakdown(median={self.median_s * 1e3:.2f} ms "
                f"[{self.min_s * 1e3:.2f}–{self.max_s * 1e3:.2f}], "
                f"matmul={self.matmul_s * 1e3:.2f} ms, outside={self.outside_s * 1e3:.2f} ms, "
                f"ops={self.ops.total})")


# the fewest timed runs a breakdown takes its median of
MIN_REPEATS = 5


def _matmul_seconds(events, on_cuda: bool) -> float:
    """Time in the innermost matmul-like operators (a linear's mm, not the linear around
    it: the layers of dispatch between them count as overhead)."""
    total_us = 0.0
    for ev in events:
        if not is_matmul(ev.name):
            continue
        inner = any(is_matmul(ch.name) for ch in _descendants(ev))
        if inner:
            continue
        us = ev.cpu_time_total
        if on_cuda:
            us = max(us, getattr(ev, "device_time_total", 0.0))
        total_us += us
    return total_us / 1e6


def _descendants(ev):
    stack = list(ev.cpu_children)
    while stack:
        ch = stack.pop()
        yield ch
        stack.extend(ch.cpu_children)


def step_breakdown(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
                   profiled_repeats: int = 3, device=None) -> OverheadBreakdown:
    """Time ``fn()`` and split its wall time into matmuls and the rest (see
    :class:`OverheadBreakdown`).

    The wall time comes from ``repeats`` runs without the profiler (after ``warmup``
    runs), so the profiler's own cost does not enter it; ``profiled_repeats`` more runs
    under ``torch.profiler``, interleaved with them, give the time inside the innermost
    matmul-like operators (CPU time; on CUDA their device time), whose median is
    subtracted. ``fn`` is
    responsible for its own ``inference_mode`` and for being repeatable (a decode step
    that appends to a cache must have room: see :func:`make_decode_step`).
    """
    return step_breakdowns({"fn": fn}, repeats, warmup, profiled_repeats, device)["fn"]


def step_breakdowns(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                    profiled_repeats: int = 3, device=None) -> dict[str, OverheadBreakdown]:
    """:func:`step_breakdown` of several steps measured against each other: ``repeats``
    rounds in which each step runs once (the order rotating from round to round), the
    profiled runs spread over the same rounds. A slow moment of a shared machine then lands
    on every step's samples, not on one step's median; the medians can be compared
    (:func:`llmlab.profiling.compare.compare` on ``times_s``)."""
    if repeats < MIN_REPEATS:
        raise ValueError(f"repeats={repeats} must be >= {MIN_REPEATS} (a median of at least five)")
    if not 1 <= profiled_repeats <= repeats:
        raise ValueError(f"profiled_repeats={profiled_repeats} must be in [1, repeats={repeats}]")
    if not fns:
        raise ValueError("fns is empty: pass at least one step to time")
    dev = torch.device(device) if device is not None else default_device()
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    # profiled runs interleaved with the timed ones, spread over the rounds: a busy moment
    # of a shared machine then lands on both kinds of sample, not on one
    profile_at = {round(i * repeats / profiled_repeats) for i in range(profiled_repeats)}
    times = {n: [] for n in names}
    matmul = {n: [] for n in names}
    profiled = {n: [] for n in names}
    ops: dict[str, OpCount] = {}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[name]
            with Timer(dev) as t:
                fn()
            times[name].append(t.seconds)
            if i not in profile_at:
                continue
            with _profiled() as prof:
                with Timer(dev) as t:
                    fn()
            profiled[name].append(t.seconds)
            events = prof.events()
            matmul[name].append(_matmul_seconds(events, dev.type == "cuda"))
            ops.setdefault(name, _count(events))
    return {n: OverheadBreakdown(statistics.median(times[n]), min(times[n]), max(times[n]),
                                 statistics.median(matmul[n]), statistics.median(profiled[n]),
                                 ops[n], times[n], matmul[n])
            for n in names}


# -- decode steps to measure --------------------------------------------------------------

def make_decode_step(model, batch: int, context: int, steps: int = 256,
                     compile: bool = False,
                     gemv: bool | None = None) -> Callable[[], torch.Tensor]:
    """A repeatable decode step of ``model`` (a CausalLM): ``batch`` sequences, one new token
    each after ``context`` cached ones, with a contiguous KV cache, under inference mode.

    Each call does what a generation step does: ``cache.begin(1)``, the forward with
    ``last_only=True``, ``cache.advance()``; it returns logits [batch, vocab]. The cache
    grows by one token per call; the call that would overflow it first rewinds it to
    ``context`` (a few small ops more, once every ``steps`` calls). The cached K/V stay
    zero (the prompt is not run): a step does the same work whatever the cache holds.

    ``compile=True``: the compiled step of ``llmlab.generate(..., compile=True)`` on a
    static cache (:mod:`llmlab.compile`), which reads its whole bucket of slots every step.
    ``gemv`` (with ``compile=True``): None runs the model's shared compiled step (the one
    ``generate`` uses, :func:`llmlab.compile.compiled_step`); True or False a
    :class:`~llmlab.compile.CompiledStep` of its own, with or without the CPU's float32
    graph pass (``llmlab::f32_gemv`` in place of PyTorch's matmuls), compiled on its first
    call.
    """
    from ..cache.contiguous import ContiguousKVCache
    from ..cache.static import StaticKVCache, slots_for

    if batch < 1 or context < 0 or steps < 1:
        raise ValueError(f"batch={batch} and steps={steps} must be >= 1, "
                         f"context={context} >= 0")
    c = model.config
    if context + steps > c.max_position_embeddings:
        raise ValueError(f"context={context} + steps={steps} is past the model's context of "
                         f"{c.max_position_embeddings} tokens")
    if gemv is not None and not compile:
        raise ValueError("gemv chooses the compiled step's matmuls: it needs compile=True")
    if compile:
        from ..compile import CompiledStep, compiled_step

        cache = StaticKVCache.for_model(model, batch, slots_for(context + steps,
                                                                c.max_position_embeddings))
        compiled = compiled_step(model) if gemv is None else CompiledStep(model, gemv=gemv)
    else:
        cache = ContiguousKVCache.for_model(model, batch, context + steps)
    ids = torch.randint(0, c.vocab_size, (batch, 1), device=model.device,
                        generator=torch.Generator().manual_seed(0))

    def rewind() -> None:
        cache.reset()
        if context:
            cache.begin(context)
            cache.advance()

    rewind()

    @torch.inference_mode()
    def step() -> torch.Tensor:
        if cache.length >= context + steps:
            rewind()
        positions = cache.begin(1)
        if compile:
            logits = compiled(ids, positions, cache)
        else:
            logits = model(ids, positions=positions, cache=cache, last_only=True)[:, -1]
        cache.advance()
        return logits

    return step


# -- the overhead roofline (a model) ------------------------------------------------------

@dataclass(frozen=True)
class ModelledStep:
    """A step time from :class:`OverheadModel` (a model, not a measurement), seconds.

    ``roof_s = max(bytes / bandwidth, flops / peak)``; ``dispatch_s = ops · t_op``.
    """
    label: str
    bytes: int
    flops: int
    ops: int
    roof_s: float
    dispatch_s: float

    @property
    def total_s(self) -> float:
        return self.roof_s + self.dispatch_s

    def __repr__(self) -> str:
        return (f"ModelledStep({self.label!r} (model): {self.total_s * 1e3:.2f} ms = roof "
                f"{self.roof_s * 1e3:.2f} + {self.ops} ops × t_op = {self.dispatch_s * 1e3:.2f})")


@dataclass(frozen=True)
class OverheadModel:
    """The overhead roofline: ``max(bytes / bandwidth, flops / peak) + ops · t_op`` seconds.

    ``bandwidth_bytes_per_s`` and ``peak_flops_per_s`` are the measured roofs
    (:class:`~llmlab.profiling.roofline.Ceilings`), ``t_op`` the seconds of one tiny eager
    op (:func:`measure_op_overhead`). The model assumes the ops' dispatch never overlaps
    with the memory traffic (true of eager CPU execution; on a GPU a queue can hide it).
    """
    bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    t_op: float
    device: str = ""

    def __post_init__(self):
        for name in ("bandwidth_bytes_per_s", "peak_flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if not self.t_op >= 0:
            raise ValueError(f"t_op={self.t_op!r} must be >= 0 seconds")

    @classmethod
    def from_ceilings(cls, ceilings: Ceilings, t_op: float) -> "OverheadModel":
        return cls(ceilings.bandwidth_bytes_per_s, ceilings.peak_flops_per_s, t_op,
                   ceilings.device)

    @classmethod
    def measure(cls, device=None, **ceiling_options) -> "OverheadModel":
        """Measure both roofs (:func:`measure_ceilings`) and t_op on ``device``."""
        ceilings = measure_ceilings(device=device, **ceiling_options)
        return cls.from_ceilings(ceilings, measure_op_overhead(device=device))

    def roof_seconds(self, bytes: float, flops: float) -> float:
        """The roofline's time: max(bytes / bandwidth, flops / peak)."""
        return max(bytes / self.bandwidth_bytes_per_s, flops / self.peak_flops_per_s)

    def dispatch_seconds(self, ops: float) -> float:
        """ops · t_op."""
        return ops * self.t_op

    def predict(self, bytes: float, flops: float, ops: float) -> float:
        """Modelled seconds of a step that moves ``bytes``, does ``flops`` in ``ops`` op calls."""
        return self.roof_seconds(bytes, flops) + self.dispatch_seconds(ops)

    def step(self, bytes: int, flops: int, ops: int, label: str = "") -> ModelledStep:
        """:meth:`predict` with its two parts."""
        return ModelledStep(label, int(bytes), int(flops), int(ops),
                            self.roof_seconds(bytes, flops), self.dispatch_seconds(ops))

    def gap(self, breakdown: "OverheadBreakdown", bytes: float, flops: float,
            label: str = "") -> "StepGap":
        """A measured step (its :class:`OverheadBreakdown`) beside this model: how far above
        or below the model it is, split into inside and outside the matmuls."""
        roof = self.roof_seconds(bytes, flops)
        dispatch = self.dispatch_seconds(breakdown.ops.total)
        return StepGap(label, breakdown.median_s, roof + dispatch,
                       breakdown.matmul_s - roof, breakdown.outside_s - dispatch)


@dataclass(frozen=True)
class StepGap:
    """Measured minus modelled step time, seconds, in two parts that add up to it exactly
    (the measured step is ``matmul_s + outside_s``, the model ``roof + ops · t_op``):

    ``inside_s = matmul_s - roof``: the matmuls slower than the roof (weights read below
    the measured bandwidth); ``outside_s = outside_s - ops · t_op``: the rest of the step
    costing more than the model's t_op per call (negative: less)."""
    label: str
    measured_s: float
    modelled_s: float
    inside_s: float
    outside_s: float

    @property
    def gap_s(self) -> float:
        return self.measured_s - self.modelled_s

    def __repr__(self) -> str:
        return (f"StepGap({self.label!r}: measured {self.measured_s * 1e3:.2f} ms, model "
                f"{self.modelled_s * 1e3:.2f} ms, gap {self.gap_s * 1e3:+.2f} = inside the "
                f"matmuls {self.inside_s * 1e3:+.2f} + outside {self.outside_s * 1e3:+.2f})")


def modelled_decode_step(model_or_config, batch: int,
                         overhead_model: OverheadModel,
                         ops: int | None = None, context: int = 0,
                         bytes_per_el: int | None = None, label: str = "") -> ModelledStep:
    """The overhead roofline's time for one decode step at ``batch`` (a model).

    Bytes and FLOPs come from :func:`~llmlab.profiling.roofline.decode_cost` (weights,
    activations, KV cache, lm_head). ``ops``: the step's operator calls; when None, a
    decode step of ``model_or_config`` (then a CausalLM) is counted with :func:`count_ops`.
    """
    if isinstance(model_or_config, ModelConfig):
        config, model = model_or_config, None
    else:
        config, model = model_or_config.config, model_or_config
    if bytes_per_el is None:
        bytes_per_el = model.dtype.itemsize if model is not None else 4
    if ops is None:
        if model is None:
            raise ValueError("ops is required with a ModelConfig (pass the model to count them)")
        ops = count_ops(make_decode_step(model, batch, context, steps=1)).total
    cost = decode_cost(config, batch, context, bytes_per_el)
    return overhead_model.step(cost.bytes, cost.flops, ops, label or cost.label)


@dataclass(frozen=True)
class OverheadPoint:
    """A measured step for the overhead-roofline plot: its label, batch, operator calls,
    modelled bytes and FLOPs, and measured wall time (median, fastest, slowest; seconds)."""
    label: str
    batch: int
    ops: int
    bytes: int
    flops: int
    median_s: float
    min_s: float
    max_s: float

    def modelled(self, overhead_model: OverheadModel) -> ModelledStep:
        return overhead_model.step(self.bytes, self.flops, self.ops, self.label)


def measure_decode_point(model, batch: int, context: int = 0, label: str = "",
                         repeats: int = 5, warmup: int = 1,
                         step: Callable[[], object] | None = None) -> OverheadPoint:
    """Count and time one decode step of ``model`` at ``batch`` (``step``: another step
    function for the same work, e.g. a compiled one; default :func:`make_decode_step`)."""
    if step is None:
        step = make_decode_step(model, batch, context)
    ops = count_ops(step).total
    t = time_fn(step, repeats=repeats, warmup=warmup, device=model.device)
    cost = decode_cost(model.config, batch, context, model.dtype.itemsize)
    return OverheadPoint(label or f"b={batch}", batch, ops, cost.bytes, cost.flops,
                         t.median_s, t.min_s, max(t.times_s))


# -- what a compiled step's gain is made of -----------------------------------------------

def compare_parts(baseline: OverheadBreakdown, candidate: OverheadBreakdown,
                  baseline_name: str, candidate_name: str) -> dict[str, Comparison | None]:
    """Two breakdowns measured in the same rounds (:func:`step_breakdowns`), compared part
    by part through :func:`~llmlab.profiling.compare.compare`: ``"step"`` over the timed
    runs, ``"inside"`` (the time inside the matmuls) over the profiled runs, ``"outside"``
    over :attr:`OverheadBreakdown.outside_times_s`. A part is None where its samples
    cannot be compared (too few, or not all positive: no matmuls, or a busy run)."""
    def parts(br: OverheadBreakdown) -> dict[str, list[float]]:
        return {"step": br.times_s, "inside": br.matmul_times_s, "outside": br.outside_times_s}

    quantity = {"step": "", "inside": "time inside the matmuls",
                "outside": "time outside the matmuls"}
    unit = {"step": "runs", "inside": "profiled runs", "outside": "runs"}
    a, b = parts(baseline), parts(candidate)
    out: dict[str, Comparison | None] = {}
    for part in ("step", "inside", "outside"):
        xs, ys = a[part], b[part]
        usable = min(len(xs), len(ys)) >= MIN_RUNS and min(xs) > 0 and min(ys) > 0
        out[part] = (compare(xs, ys, baseline_name, candidate_name, quantity=quantity[part],
                             unit=unit[part]) if usable else None)
    return out


def _said(c: Comparison | None) -> str:
    return c.sentence() if c is not None else "too few positive samples on this run to compare"


def _worth(what: str, seconds: float, c: Comparison) -> str:
    if c.verdict == FASTER:
        return f"{what} was worth {seconds * 1e3:.1f} ms a step ({c.interval()})"
    if c.verdict == SLOWER:
        return f"{what} cost {-seconds * 1e3:.1f} ms a step ({c.interval()})"
    return (f"{what} was worth no time this run could resolve ({seconds * 1e3:+.1f} ms, "
            f"{c.interval()})")


@dataclass(frozen=True)
class CompileSplit:
    """A compiled CPU decode step's gain over eager, split into its two causes, from three
    steps measured in the same rounds (:func:`step_breakdowns`):

    ``eager``; ``compiled``: the graph with PyTorch's matmuls (``CompiledStep(gemv=False)``),
    so ``eager → compiled`` is what compilation itself does (fewer calls, fused loops);
    ``gemv``: the same graph with the float32 pass's ``llmlab::f32_gemv``, so
    ``compiled → gemv`` is what the custom kernel does. ``bytes``: what one step reads
    (:func:`~llmlab.profiling.roofline.decode_cost`), for the matmuls' read rate."""
    eager: OverheadBreakdown
    compiled: OverheadBreakdown
    gemv: OverheadBreakdown
    bytes: int

    @property
    def compilation(self) -> Comparison:
        return compare(self.eager.times_s, self.compiled.times_s, "the eager step",
                       "the compiled step (PyTorch's matmuls)")

    @property
    def kernel(self) -> Comparison:
        return compare(self.compiled.times_s, self.gemv.times_s,
                       "the compiled step with PyTorch's matmuls",
                       "the compiled step with llmlab::f32_gemv")

    @property
    def total(self) -> Comparison:
        return compare(self.eager.times_s, self.gemv.times_s, "the eager step",
                       "the compiled step with llmlab::f32_gemv")

    @property
    def compilation_s(self) -> float:
        """Median seconds a step saved by compiling alone (negative: lost)."""
        return self.eager.median_s - self.compiled.median_s

    @property
    def kernel_s(self) -> float:
        """Median seconds a step saved by the custom kernel on top (negative: lost)."""
        return self.compiled.median_s - self.gemv.median_s

    @property
    def kernel_in_graph(self) -> bool:
        """False where the C kernels did not build: the pass is off, both graphs the same."""
        return self.gemv.ops.by_name["llmlab::f32_gemv"] > 0

    def read_rate(self, breakdown: OverheadBreakdown) -> float:
        """bytes / time inside the matmuls: the rate the step's weights were read at."""
        return self.bytes / breakdown.matmul_s if breakdown.matmul_s > 0 else float("nan")

    def markdown(self) -> str:
        """The split in sentences, each comparison through :func:`compare`."""
        e, c, g = self.eager, self.compiled, self.gemv

        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.1f} ms"

        def change(saved: float) -> str:
            return (f"saving {ms(saved)}" if saved >= 0 else f"costing {ms(-saved)}") + \
                " a step in medians"

        outside = compare_parts(e, c, "the eager step", "the compiled step")["outside"]
        out = [f"**Compilation** alone ({e.ops.total} → {c.ops.total} operator calls, "
               f"PyTorch's matmuls kept), {change(self.compilation_s)}: "
               f"{self.compilation.sentence()}. Outside the matmuls, {ms(e.outside_s)} → "
               f"{ms(c.outside_s)}: {_said(outside)}."]
        if self.kernel_in_graph:
            inside = compare_parts(c, g, "the step with PyTorch's matmuls",
                                   "the step with llmlab::f32_gemv")["inside"]
            out.append(
                "**The custom kernel** (`llmlab::f32_gemv` for `aten::mm`, nothing else "
                f"changed), {change(self.kernel_s)}: {self.kernel.sentence()}. Inside the "
                f"matmuls, {ms(c.matmul_s)} → {ms(g.matmul_s)}, the step's "
                f"{self.bytes / 1e6:.0f} MB read at {self.read_rate(c) / 1e9:.1f} → "
                f"{self.read_rate(g) / 1e9:.1f} GB/s: {_said(inside)}.")
        else:
            out.append("The C kernels did not build here, so the graph pass is off and the "
                       f"last two steps run the same graph: {self.kernel.sentence()}.")
        saved = e.median_s - g.median_s
        if self.total.verdict == FASTER and self.compilation_s > 0 and self.kernel_s > 0:
            out.append(f"Of the {ms(saved)} saved in all, {self.compilation_s / saved:.0%} is "
                       f"compilation and {self.kernel_s / saved:.0%} the kernel.")
        else:
            out.append(f"In all, {self.total.sentence()}.")
        if min(e.outside_s, c.outside_s, g.outside_s) < 0:
            out.append("A negative time outside the matmuls means their profiled runs took "
                       "longer than the timed ones: the machine was busy; rerun the cell.")
        return " ".join(out)

    def takeaway(self) -> str:
        """One line: what each cause was worth, with its verdict."""
        kernel = (_worth("the custom float32 GEMV, on this CPU's memory,", self.kernel_s,
                         self.kernel) if self.kernel_in_graph
                  else "the custom GEMV was off (its C kernels did not build)")
        return (_worth("removing per-op overhead by compiling", self.compilation_s,
                       self.compilation) + "; " + kernel)
