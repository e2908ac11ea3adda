"""The serving engine: sampler now; scheduler, step loop and the LLM API in notebook 05."""
from .sampler import filter_logits, sample

__all__ = ["sample", "filter_logits"]
