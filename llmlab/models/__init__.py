"""Models: the decoder, the loader, the registry of names, and fetching."""
from .fetch import resolve
from .llama import CausalLM
from .loader import load_model, load_tokenizer
from .registry import MODELS

__all__ = ["CausalLM", "load_model", "load_tokenizer", "MODELS", "resolve"]
