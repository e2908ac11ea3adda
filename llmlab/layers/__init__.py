"""Building blocks of the decoder: norm, rotary, attention module, MLP, MoE."""
from .attention import Attention
from .mlp import MLP
from .moe import SparseMoE
from .norm import RMSNorm
from .rotary import RotaryEmbedding, apply_rotary

__all__ = ["Attention", "MLP", "SparseMoE", "RMSNorm", "RotaryEmbedding", "apply_rotary"]
