"""Measuring: timers, peak memory, analytic FLOP/byte counters, request metrics."""
from .flops import (attention_bytes, attention_flops, linear_bytes, linear_flops,
                    model_flops_per_token, weight_bytes)
from .memory import MemoryResult, peak_memory
from .metrics import RequestMetrics, summarize
from .timer import Timer, time_fn

__all__ = ["Timer", "time_fn", "peak_memory", "MemoryResult", "RequestMetrics", "summarize",
           "linear_flops", "linear_bytes", "attention_flops", "attention_bytes",
           "model_flops_per_token", "weight_bytes"]
