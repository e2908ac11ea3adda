"""Safetensors checkpoints in HF layout -> llmlab modules.

Parameter names mirror HF Llama (``model.layers.3.self_attn.q_proj.weight`` becomes
``layers.3.self_attn.q_proj.weight``); Mixtral's per-expert ``w1/w3/w2`` matrices are
stacked into ``w_gate/w_up/w_down`` [experts, ...].
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..device import resolve_device, resolve_dtype
from . import registry
from .fetch import resolve
from .llama import CausalLM, empty_model
from .upcycle import UPCYCLED, upcycle

_EXPERT = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_STACK = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}


def read_state_dict(model_dir: Path, keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (or only ``keys``), with the ``model.`` prefix dropped."""
    out = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                name = k[len("model."):] if k.startswith("model.") else k
                if keys is None or name in keys:
                    out[name] = st.get_tensor(k)
    return out


def to_llmlab_names(sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF names onto :class:`CausalLM`'s, stacking Mixtral experts."""
    out, experts = {}, {}
    for k, v in sd.items():
        m = _EXPERT.fullmatch(k)
        if m:
            layer, e, w = int(m[1]), int(m[2]), m[3]
            experts.setdefault((layer, _STACK[w]), {})[e] = v
            continue
        out[k.replace("block_sparse_moe.", "mlp.")] = v
    for (layer, name), per_expert in experts.items():
        if len(per_expert) != config.num_experts:
            raise ValueError(f"layer {layer} has {len(per_expert)} experts for {name}; "
                             f"config says {config.num_experts}")
        out[f"layers.{layer}.mlp.{name}"] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    if config.tie_word_embeddings:  # one tensor, two names
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def load_model(name_or_path: str, attention: str = "naive", device=None,
               dtype: str | torch.dtype | None = None, **derived_options) -> CausalLM:
    """Load a registered model (``smollm2-135m``, ``tiny-llama``, ...) or a HF-layout folder.

    Returns a :class:`CausalLM` in eval mode on ``device`` (default: CUDA if present),
    in ``dtype`` (default: :func:`llmlab.device.default_dtype` of the device, bfloat16 on
    a GPU and float32 on a CPU), with the attention backend ``attention`` (see
    ``llmlab.attention.available()``).
    Derived models (``smollm2-135m-moe8``) are built from their base model at load time;
    ``derived_options`` go to their builder (for the upcycled MoE: ``router_seed``,
    ``expert_noise``, ``noise_seed``; see :func:`llmlab.models.upcycle.upcycle`).
    """
    from .. import attention as attn_backends

    attn_backends.get(attention)  # fail early with the list of names
    spec = registry.MODELS.get(str(name_or_path))
    if spec is not None and spec.kind == "derived":
        return load_upcycled(spec.name, attention=attention, device=device, dtype=dtype,
                             **derived_options)
    if derived_options:
        raise ValueError(f"options {sorted(derived_options)} apply only to derived models "
                         f"{[n for n, s in registry.MODELS.items() if s.kind == 'derived']}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve(name_or_path)
    config = ModelConfig.from_file(path)
    model = empty_model(config, attention)
    sd = to_llmlab_names(read_state_dict(path), config)
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rotary()  # buffers were built on meta
    model = model.to(device=dev, dtype=dt)
    model.reset_rotary(dev)  # RoPE frequencies stay float32 whatever the dtype
    model.name = str(name_or_path)
    return model.eval()


def load_upcycled(name: str, attention: str = "naive", device=None,
                  dtype: str | torch.dtype | None = None, router_seed: int = 0,
                  expert_noise: float = 0.0, noise_seed: int = 0) -> CausalLM:
    """Build a registered upcycled model (``smollm2-135m-moe8``) from its base model's files
    (see :func:`llmlab.models.upcycle.upcycle`)."""
    if name not in UPCYCLED:
        raise ValueError(f"unknown upcycled model {name!r}; allowed: {list(UPCYCLED)}")
    base, experts, top_k = UPCYCLED[name]
    dense = load_model(base, attention=attention, device=device, dtype=dtype)
    moe = upcycle(dense, num_experts=experts, top_k=top_k, router_seed=router_seed,
                  expert_noise=expert_noise, noise_seed=noise_seed)
    moe.name = name
    return moe


def load_tokenizer(name_or_path: str):
    """The HF tokenizer (with chat template) saved beside the model."""
    from transformers import AutoTokenizer

    path = resolve(name_or_path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"no tokenizer files in {path}; tiny models borrow smollm2-135m's, "
                                f"so run: {registry.fetch_command('smollm2-135m')}")
    return AutoTokenizer.from_pretrained(str(path))
