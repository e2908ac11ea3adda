"""How many bytes of KV cache a token costs: multi-head, grouped-query and multi-head latent
attention, and a sliding window (with attention sinks), in one calculator.

Per token and layer, with ``n_h`` query heads of dimension ``d_h``, ``n_g`` KV heads and
``b`` bytes per element (DeepSeek-AI, *DeepSeek-V2*, arXiv:2405.04434, Table 1):

    MHA   2 · n_h · d_h · b          every head keeps its own K and V
    GQA   2 · n_g · d_h · b          heads share K/V in groups (Ainslie et al., EMNLP 2023,
                                     arXiv:2305.13245)
    MLA   (d_c + d_h^R) · b          one compressed latent c_KV of d_c and a shared
                                     RoPE key of d_h^R, from which K and V are rebuilt

times the layers. A sliding window of ``w`` tokens plus ``s`` sinks (StreamingLLM,
arXiv:2309.17453; Mistral 7B's window, arXiv:2310.06825) caps the cache at ``s + w``
tokens whatever the context, so per token of a context of n it costs
``min(n, s + w) / n`` of the above. Taught in notebook 14.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("mha", "gqa", "mla")


@dataclass(frozen=True)
class AttentionShape:
    """What the KV cache of one model depends on (numbers from its published config)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int          # = num_heads for MHA
    head_dim: int
    native: str                # the scheme the model uses
    latent_dim: int = 0        # MLA: d_c, the compressed K/V latent per token
    rope_dim: int = 0          # MLA: d_h^R, the decoupled RoPE key per token
    source: str = ""


MODELS = {
    "smollm2-135m": AttentionShape(
        "SmolLM2-135M", 30, 9, 3, 64, "gqa",
        source="HuggingFaceTB/SmolLM2-135M-Instruct config.json "
               "(https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct); data/models/"),
    "llama-3-8b": AttentionShape(
        "Llama-3-8B", 32, 32, 8, 128, "gqa",
        source="meta-llama/Meta-Llama-3-8B config.json: 32 layers, 32 heads, 8 KV heads, "
               "hidden 4096 (https://huggingface.co/meta-llama/Meta-Llama-3-8B)"),
    "deepseek-v2": AttentionShape(
        "DeepSeek-V2", 60, 128, 128, 128, "mla", latent_dim=512, rope_dim=64,
        source="DeepSeek-V2, arXiv:2405.04434, sections 2.1 and 3.1.2: 60 layers, 128 heads "
               "of d_h 128, d_c = 4 d_h = 512, d_h^R = d_h / 2 = 64"),
}


@dataclass(frozen=True)
class KVBytes:
    """The result of :func:`kv_bytes`."""

    model: str
    scheme: str
    context: int
    cached_tokens: int          # tokens the cache holds at this context
    per_token_per_layer: int    # bytes one cached token costs in one layer
    total: int                  # bytes of the whole cache for one sequence

    @property
    def per_token(self) -> float:
        """Bytes per token of context (less than a cached token's when a window evicts)."""
        return self.total / self.context


def kv_bytes(model: str | AttentionShape, scheme: str | None = None, context: int = 1, *,
             window: int | None = None, sinks: int = 0, bytes_per_el: float = 2) -> KVBytes:
    """The KV cache of one sequence of ``context`` tokens of ``model`` (a name of
    :data:`MODELS` or an :class:`AttentionShape`) under ``scheme`` ("mha", "gqa", "mla";
    None: the model's own), keeping at most ``sinks + window`` tokens when ``window`` is
    given. ``bytes_per_el`` 2 for float16/bfloat16 (1 for an int8 cache, 4 for float32).

    MHA of a GQA model counts ``num_heads`` KV heads (what it would cost without sharing);
    "mla" needs a model with a latent (DeepSeek-V2). ValueError names a bad argument.
    """
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"model={model!r}; allowed: {list(MODELS)} or an AttentionShape")
        model = MODELS[model]
    scheme = model.native if scheme is None else scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}; allowed: {list(SCHEMES)}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r} must be an int >= 1 (tokens)")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window={window!r} must be an int >= 1, or None (no window)")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r} must be an int >= 0")
    if not bytes_per_el > 0:
        raise ValueError(f"bytes_per_el={bytes_per_el!r} must be > 0")
    if scheme == "mla":
        if not model.latent_dim:
            raise ValueError(f"scheme='mla' needs a latent dimension; {model.name} has none "
                             f"(its scheme is {model.native!r})")
        elements = model.latent_dim + model.rope_dim
    else:
        heads = model.num_heads if scheme == "mha" else model.num_kv_heads
        elements = 2 * heads * model.head_dim
    per_layer = int(elements * bytes_per_el)
    cached = context if window is None else min(context, sinks + window)
    return KVBytes(model.name, scheme, context, cached, per_layer,
                   per_layer * model.num_layers * cached)


__all__ = ["AttentionShape", "MODELS", "SCHEMES", "KVBytes", "kv_bytes"]
