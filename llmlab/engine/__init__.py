"""The serving engine (notebook 05): request state, schedulers (static and continuous),
the step loop over the paged KV cache, the sampler, and the vLLM-shaped ``LLM`` API."""
from .beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .llm import LLM, EngineStats, LLMEngine, StepRecord, TokenEvent
from ..sampling import filter_logits, sample, sample_rows
from .scheduler import POLICIES, Scheduler, SchedulerConfig, SchedulerOutput
from .sequence import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LLMEngine",
           "EngineStats", "StepRecord", "TokenEvent", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "POLICIES", "sample", "sample_rows", "filter_logits",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
