"""ModelConfig: the few numbers that define a Llama-family decoder, read from a HF config.json.

Understands llama, mistral, mixtral and qwen2 configs (old ``rope_theta`` and new
``rope_parameters`` spellings). A config that asks for something the decoder does not
implement (scaled RoPE, sliding-window attention, another activation, MLP or output
projection biases) is refused with an error naming the field, rather than loaded into a
model that would silently compute a different function. Taught in notebook 00.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2")
SUPPORTED_ACTIVATIONS = ("silu", "swish")  # two names of x·sigmoid(x), SwiGLU's gate


def _rope_type(spec) -> str:
    """The RoPE variant a ``rope_scaling`` / ``rope_parameters`` dict asks for."""
    if not isinstance(spec, dict):
        return repr(spec)
    return str(spec.get("rope_type", spec.get("type", "default")))


def check_implemented(d: dict) -> None:
    """Refuse HF config fields that change the model's function in ways llmlab does not
    implement; the ValueError names the field, its value and what is supported."""
    for name in ("rope_scaling", "rope_parameters"):
        spec = d.get(name)
        if spec and _rope_type(spec) != "default":
            raise ValueError(f"{name}={spec!r}: RoPE type {_rope_type(spec)!r} is not "
                             "implemented (llmlab's rotary embedding is plain RoPE, "
                             "rope_type 'default')")
    window, context = d.get("sliding_window"), d.get("max_position_embeddings", 2048)
    # qwen2 writes a window but switches it off with use_sliding_window=False
    if window is not None and d.get("use_sliding_window") is not False and window < context:
        raise ValueError(f"sliding_window={window} is smaller than the context "
                         f"(max_position_embeddings={context}): sliding-window attention is "
                         "not implemented; llmlab's attention sees the whole context")
    act = d.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not implemented; allowed: "
                         f"{list(SUPPORTED_ACTIVATIONS)} (the SwiGLU MLP's gate)")
    if d.get("mlp_bias"):
        raise ValueError(f"mlp_bias={d['mlp_bias']!r} is not implemented: llmlab's MLP "
                         "projections have no bias")
    if d.get("attention_bias") and d.get("model_type", "llama") != "qwen2":
        # Llama's attention_bias adds a bias to o_proj too; llmlab has biases on q, k, v
        # only, which is exactly Qwen2's layout.
        raise ValueError(f"attention_bias={d['attention_bias']!r} is not implemented for "
                         f"model_type={d.get('model_type', 'llama')!r} (it also biases the "
                         "output projection); only qwen2's q/k/v biases are")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0  # 0 means a dense MLP
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        mt = d.get("model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={mt!r} is not supported; allowed: {SUPPORTED_MODEL_TYPES}")
        check_implemented(d)
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", mt == "qwen2")),
            num_experts=d.get("num_local_experts", 0) or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            model_type=mt,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict:
        return asdict(self)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count; ``active=True`` counts only the top-k experts a token uses."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * self.intermediate_size
        if self.is_moe:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = mlp * experts + h * self.num_experts
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h
