"""Fused decoder pieces: the plain-PyTorch references of :mod:`llmlab.kernels.fused`, and
:func:`fuse_model`, which rebuilds a loaded model's layers around them.

Three fusions, each a function here with the same signature as its Triton kernel:

    add_rmsnorm(x, residual, weight, eps) -> (out, h)   h = x + residual; out = rmsnorm(h)·weight
    swiglu(gate_up) -> silu(gate) · up                  gate_up = [gate | up] (one matmul)
    qkv_rope(qkv, positions, inv_freq, num_heads, num_kv_heads, head_dim) -> (q, k, v)
                                                        qkv = [q | k | v] (one matmul), q and k
                                                        rotated (half-split RoPE)

These references use the arithmetic of the model's own layers (:class:`~llmlab.layers.RMSNorm`,
:class:`~llmlab.layers.MLP`, :mod:`~llmlab.layers.rotary`), so a fused float32 model gives
the unfused one's tokens (SmolLM2's float32 logits bit for bit). What fusing buys in
PyTorch alone is fewer, larger calls: one matmul for q, k and v instead of three, one for
gate and up instead of two, q and k rotated as one tensor (a SmolLM2 decode step: 1,440
operator calls instead of 1,560). The Triton kernels also merge the elementwise ops into
one pass over memory each; under ``torch.compile`` Inductor fuses those by itself.

:func:`fuse_model` rewrites a :class:`~llmlab.models.llama.CausalLM` in place: each layer
becomes a :class:`FusedDecoderLayer` (same norms, same attention backend and cache
interface) with a :class:`FusedAttention` (``qkv_proj``) and a :class:`FusedMLP`
(``gate_up_proj``). Taught in notebook 11.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .. import attention as attn_backends
from ..kernels import fused as kernels
from ..kernels.fused import check_add_rmsnorm, check_qkv_rope, check_swiglu
from .attention import Attention
from .mlp import MLP
from .norm import RMSNorm
from .rotary import _rotate

BACKENDS = ("torch", "triton")


# -- the references -----------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s arithmetic: ``F.rms_norm`` in float32; otherwise HF Llama's order
    (normalize in float32, round to x's dtype, then scale)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rmsnorm(h) · weight, h)``. ``residual=None``: h is x.

    x, residual [..., hidden] of one dtype; weight [hidden]. The decoder layer calls it
    with the attention output and the residual stream: h is the new residual stream and
    out the MLP's input.
    """
    check_add_rmsnorm(x, residual, weight, eps)
    h = x if residual is None else x + residual
    return rms_norm(h, weight, eps), h


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * inter] (gate first) -> ``silu(gate) · up`` [..., inter]."""
    check_swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin [..., 1, head_dim] for ``positions`` [...]: the model's tables
    (:meth:`RotaryEmbedding.tables`) for any leading dims."""
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = inv_freq.shape[0]
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[..., None, :], signed[..., None, :]


def split_rotate(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int):
    """Split qkv [..., (heads + 2 kv_heads) · head_dim] into q [..., heads, head_dim],
    k, v [..., kv_heads, head_dim] and rotate q and k by precomputed tables.

    q's and k's heads are rotated together, as one tensor (the same four operators as
    rotating one of them); q and k are views of it, and v is a view of qkv.
    """
    heads = qkv.unflatten(-1, (num_heads + 2 * num_kv_heads, head_dim))
    qk = _rotate(heads[..., :num_heads + num_kv_heads, :], cos, signed_sin)
    return qk[..., :num_heads, :], qk[..., num_heads:, :], heads[..., num_heads + num_kv_heads:, :]


def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int):
    """Split the fused projection's output into q, k, v and rotate q and k (half-split RoPE
    at ``positions`` [...], qkv's leading dims, with frequencies ``inv_freq`` [head_dim / 2])."""
    check_qkv_rope(qkv, positions, inv_freq, num_heads, num_kv_heads, head_dim)
    cos, signed = rope_tables(positions, inv_freq, qkv.dtype)
    return split_rotate(qkv, cos, signed, num_heads, num_kv_heads, head_dim)


def ops(backend: str):
    """The module holding ``add_rmsnorm``, ``swiglu`` and ``qkv_rope`` for ``backend``:
    ``"torch"`` (this module's references) or ``"triton"`` (:mod:`llmlab.kernels.fused`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: {list(BACKENDS)}")
    if backend == "triton":
        return kernels
    return SimpleNamespace(add_rmsnorm=add_rmsnorm, swiglu=swiglu, qkv_rope=qkv_rope)


# -- the fused modules ----------------------------------------------------------------------

class FusedAttention(nn.Module):
    """:class:`~llmlab.layers.Attention` with one ``qkv_proj`` and the split + RoPE fused.

    ``qkv_proj`` maps hidden -> (heads + 2 kv_heads) · head_dim (an ``nn.Linear`` or a
    quantized layer); the backend and ``cache.attend`` are used as in the unfused module.
    """

    def __init__(self, attn: Attention, qkv_proj: nn.Module, backend: str):
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.qkv_proj, self.o_proj, self.rotary = qkv_proj, attn.o_proj, attn.rotary
        self.backend = attn.backend
        self.fused_backend = backend

    def set_backend(self, name: str) -> None:
        self.backend = attn_backends.get(name)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv_proj(x)
        if self.fused_backend == "triton":
            q, k, v = kernels.qkv_rope(qkv, positions, self.rotary.inv_freq, self.num_heads,
                                       self.num_kv_heads, self.head_dim)
        else:   # the tables the first layer built serve every layer (rotary's memo)
            cos, signed = self.rotary.tables(positions, qkv.dtype)
            q, k, v = split_rotate(qkv, cos, signed, self.num_heads, self.num_kv_heads,
                                   self.head_dim)
        if cache is None:
            out = self.backend.forward(q, k, v, causal=True, key_padding_mask=key_padding_mask)
        else:
            out = cache.attend(self.layer_idx, q, k, v, self.backend)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))


class FusedMLP(nn.Module):
    """SwiGLU with gate and up as one ``gate_up_proj`` (hidden -> 2 · inter, gate first)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, backend: str):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.swiglu = ops(backend).swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(self.gate_up_proj(x)))


class FusedRMSNorm(RMSNorm):
    """:class:`RMSNorm` through :func:`llmlab.kernels.fused.add_rmsnorm` (no residual)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.add_rmsnorm(x, None, self.weight, self.eps)[0]


class FusedDecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``+ mlp(norm(x))``, the second residual add fused into the
    post-attention norm: ``normed, x = add_rmsnorm(attn_out, x, weight, eps)``.

    The MLP's residual add stays a separate op: fusing it into the next layer's input norm
    needs the layer loop to pass (x, residual) pairs between layers.
    """

    def __init__(self, layer: nn.Module, self_attn: nn.Module, mlp: nn.Module, backend: str):
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = mlp
        self.add_rmsnorm = ops(backend).add_rmsnorm

    def forward(self, x, positions, cache=None, key_padding_mask=None):
        h = self.self_attn(self.input_layernorm(x), positions, cache, key_padding_mask)
        norm = self.post_attention_layernorm
        normed, x = self.add_rmsnorm(h, x, norm.weight, norm.eps)
        return x + self.mlp(normed)


# -- fusing a model ----------------------------------------------------------------------------

def _concat_linears(parts: list[nn.Module], names: list[str]) -> nn.Linear:
    """One nn.Linear whose output rows are ``parts``' rows stacked (biases too)."""
    for name, p in zip(names, parts):
        if type(p) is not nn.Linear:
            raise ValueError(f"{name} is a {type(p).__name__}; fuse_model concatenates plain "
                             "nn.Linear layers (or uses a quantized model's shared projection)")
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        raise ValueError(f"{names} have biases on some layers only: {has_bias}")
    w = torch.cat([p.weight.detach() for p in parts])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=all(has_bias), device="meta")
    fused.weight = nn.Parameter(w, requires_grad=False)
    if all(has_bias):
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]),
                                  requires_grad=False)
    return fused


def _projection(parent: nn.Module, fused_name: str, names: list[str], sizes: list[int]):
    """The fused projection of ``names`` on ``parent``: a quantized model's shared one (its
    packed layer) when present, else the plain linear layers concatenated."""
    shared = getattr(parent, fused_name, None)
    if shared is not None and hasattr(shared, "fused"):
        if list(shared.sizes) != sizes:
            raise ValueError(f"{fused_name} packs {list(shared.sizes)} outputs; expected {sizes}")
        return shared.fused
    return _concat_linears([getattr(parent, n) for n in names], names)


def _fused_layer(layer: nn.Module, backend: str) -> FusedDecoderLayer:
    attn = layer.self_attn
    if not isinstance(attn, Attention):
        raise ValueError(f"layer {getattr(attn, 'layer_idx', '?')}: self_attn is a "
                         f"{type(attn).__name__}; fuse_model expects llmlab's Attention")
    d = attn.head_dim
    qkv = _projection(attn, "qkv_proj", ["q_proj", "k_proj", "v_proj"],
                      [attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d])
    new_attn = FusedAttention(attn, qkv, backend)
    mlp = layer.mlp
    if isinstance(mlp, MLP):   # a mixture of experts keeps its own MLP
        inter = mlp.down_proj.in_features
        gate_up = _projection(mlp, "gate_up_proj", ["gate_proj", "up_proj"], [inter, inter])
        mlp = FusedMLP(gate_up, mlp.down_proj, backend)
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not isinstance(getattr(layer, name), RMSNorm):
            raise ValueError(f"{name} is a {type(getattr(layer, name)).__name__}; "
                             "fuse_model expects llmlab's RMSNorm")
    fused = FusedDecoderLayer(layer, new_attn, mlp, backend)
    if backend == "triton":
        fused.input_layernorm = _triton_norm(layer.input_layernorm)
    return fused


def _triton_norm(norm: RMSNorm) -> FusedRMSNorm:
    new = FusedRMSNorm(norm.weight.shape[0], norm.eps)
    new.weight = norm.weight
    return new


def fuse_model(model: nn.Module, backend: str = "torch") -> nn.Module:
    """Rewrite a loaded :class:`~llmlab.models.llama.CausalLM` in place to run fused; returns it.

    Each decoder layer becomes a :class:`FusedDecoderLayer`: q/k/v concatenated into one
    ``qkv_proj`` followed by ``qkv_rope``; gate/up into one ``gate_up_proj`` followed by
    ``swiglu`` (dense MLPs; a mixture of experts keeps its own); the post-attention residual
    add fused into its norm (``add_rmsnorm``). ``backend``: ``"torch"`` runs this module's
    PyTorch references (any device, ``torch.compile`` included); ``"triton"`` runs
    :mod:`llmlab.kernels.fused` (compiled on CUDA; in the interpreter on a CPU, slow: for
    checks), the final norm included. A quantized model's shared projections are used as
    they are. The weights move into the new layers (the separate q/k/v and gate/up layers
    are gone: load the model again to unfuse); attention backends, KV caches and
    ``set_attention`` work as before. Sets ``model.fused`` to the backend.
    """
    ops(backend)   # checks the name
    if getattr(model, "fused", None):
        raise ValueError(f"model is already fused (backend={model.fused!r}); load it again "
                         "to fuse with another backend")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"fuse_model needs an llmlab CausalLM; got {type(model).__name__}")
    new = [_fused_layer(layer, backend) for layer in layers]     # check every layer first
    with torch.no_grad():
        for i, layer in enumerate(new):
            layers[i] = layer
    if backend == "triton" and isinstance(model.norm, RMSNorm):
        model.norm = _triton_norm(model.norm)
    model.fused = backend
    return model


__all__ = ["add_rmsnorm", "swiglu", "qkv_rope", "rms_norm", "rope_tables", "split_rotate",
           "fuse_model", "ops", "FusedAttention", "FusedMLP", "FusedDecoderLayer",
           "FusedRMSNorm", "BACKENDS"]
