"""Models: the decoder, the loader, the registry of names, and fetching."""
from .fetch import resolve
from .llama import CausalLM, first_layers
from .loader import load_model, load_tokenizer
from .registry import MODELS

__all__ = ["CausalLM", "first_layers", "load_model", "load_tokenizer", "MODELS", "resolve"]
