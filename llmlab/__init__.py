"""llmlab: a workbook for learning LLM inference acceleration on a real model.

>>> import llmlab
>>> model = llmlab.load_model("smollm2-135m", attention="naive")
>>> tok = llmlab.load_tokenizer("smollm2-135m")
>>> llmlab.generate(model, tok, "What is the capital of France?", max_new_tokens=20).text
>>> llm = llmlab.LLM("smollm2-135m", scheduler="continuous")          # the serving engine
>>> llm.generate(["Hi!", "Name a colour."], llmlab.SamplingParams(max_tokens=16))
"""
from . import device  # noqa: F401  (first: sets TRITON_INTERPRET on CPU-only machines)
from .config import ModelConfig
from .engine import LLM, SamplingParams
from .generate import Generation, generate
from .models import load_model, load_tokenizer
from .quant import quantize
from .speculative import SpeculativeConfig

__version__ = "0.1.0"
__all__ = ["ModelConfig", "load_model", "load_tokenizer", "generate", "Generation", "LLM",
           "SamplingParams", "quantize", "SpeculativeConfig"]
