"""Measuring: timers, peak memory, analytic FLOP/byte counters, request metrics, the roofline."""
from .flops import (attention_bytes, attention_flops, linear_bytes, linear_flops,
                    model_flops_per_token, weight_bytes)
from .compare import Comparison, Fit, compare, expect, fit_linear, fit_power
from .dispatch import count_c10d_ops
from .memory import MemoryResult, peak_memory
from .metrics import RequestMetrics, summarize
from .overhead import (ModelledStep, OpCount, OverheadBreakdown, OverheadModel, OverheadPoint,
                       count_ops, make_decode_step, measure_decode_point, measure_op_overhead,
                       modelled_decode_step, step_breakdown, trace_ops, TracedOp)
from .roofline import (Ceilings, Cost, RooflinePoint, decode_cost, forward_cost,
                       measure_bandwidth, measure_ceilings, measure_matmul_flops, prefill_cost)
from .timer import Timer, time_fn, time_interleaved

__all__ = ["Comparison", "Fit", "compare", "expect", "fit_linear", "fit_power", "count_c10d_ops", "trace_ops", "TracedOp", "Timer", "time_fn", "time_interleaved", "peak_memory", "MemoryResult", "RequestMetrics", "summarize",
           "linear_flops", "linear_bytes", "attention_flops", "attention_bytes",
           "model_flops_per_token", "weight_bytes", "Ceilings", "Cost", "RooflinePoint",
           "measure_bandwidth", "measure_matmul_flops", "measure_ceilings", "forward_cost",
           "prefill_cost", "decode_cost", "OpCount", "count_ops", "measure_op_overhead",
           "OverheadBreakdown", "step_breakdown", "OverheadModel", "ModelledStep",
           "modelled_decode_step", "OverheadPoint", "measure_decode_point", "make_decode_step"]
