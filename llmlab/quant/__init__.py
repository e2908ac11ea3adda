"""Weight-only quantization: ``llmlab.quantize(model, scheme)`` returns a smaller model.

>>> qmodel = llmlab.quantize(model, "int4", group_size=32)   # model itself is untouched
>>> llmlab.generate(qmodel, tok, "Hello", max_new_tokens=8)

Schemes (every linear layer of every decoder block):

* ``"int8"``: symmetric int8, one scale per output channel;
* ``"int4"``: 4-bit, group-wise asymmetric (w = q·d + m), ``group_size=32`` by default;
* ``"q4_1"``: exactly GGUF's Q4_1 (blocks of 32, float16 d and m);
* ``"fp8"``: float8 e4m3, one scale per output channel.

``lm_head`` chooses the format of the tied embedding / lm_head: ``"int8"`` (the default,
one scale per row), ``"bf16"`` or ``"fp32"``. Why int8 by default: the [49152, 576] table is a
fifth of SmolLM2's float32 bytes and every decode step reads all of it, so a float32 head
(113 MB) would outweigh all the 4-bit layers together (66-80 MB); the shipped file keeps
this table at 8 bits (Q8_0), and 4 bits would lose more than the file did. The cost is
measured, not assumed: over 256 tokens of the evaluation text the int8 head adds about
2e-3 nats/token of KLD to int4 (2.7e-3 against 3e-4 with a float32 head, the rest being
the kernels' bfloat16 activations). ``lm_head="fp32"`` is the choice for quality; bfloat16
halves the bytes but is no faster than float32 on this CPU's matmul.

Activations stay float32 between layers; the KV cache is untouched. Taught in notebook 08.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..models.llama import CausalLM
from . import formats
from .formats import (Q4_1, fp8_dequantize, fp8_quantize, group_dequantize, group_quantize,
                      int8_dequantize, int8_quantize, q4_1_dequantize, q4_1_quantize)
from .linear import (BF16Linear, FP8Linear, GroupLinear, Int8Linear, QuantizedEmbedding,
                     QuantizedLinear, use_kernels)

SCHEMES = ("int8", "int4", "q4_1", "fp8")
LM_HEAD_CHOICES = ("int8", "bf16", "fp32")

__all__ = ["quantize", "fake_quantize", "SCHEMES", "weight_nbytes", "QuantizedCausalLM", "QuantizedLinear",
           "Int8Linear", "GroupLinear", "FP8Linear", "QuantizedEmbedding", "use_kernels", "Q4_1",
           "q4_1_quantize", "q4_1_dequantize", "int8_quantize", "int8_dequantize",
           "group_quantize", "group_dequantize", "fp8_quantize", "fp8_dequantize", "formats"]


class QuantizedCausalLM(CausalLM):
    """A :class:`CausalLM` whose linear layers are quantized; ``dtype`` is the activations'."""

    quant_scheme: str = "?"
    quant_options: dict = {}

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype


def _make_linear(weight: torch.Tensor, scheme: str, group_size: int) -> QuantizedLinear:
    if scheme == "int8":
        return Int8Linear(weight)
    if scheme == "int4":
        return GroupLinear(weight, group_size=group_size)
    if scheme == "q4_1":
        return GroupLinear(weight, q4_1=True)
    return FP8Linear(weight)


@torch.no_grad()
def quantize(model: CausalLM, scheme: str, *, group_size: int = 32,
             lm_head: str = "int8") -> QuantizedCausalLM:
    """A new model with every decoder linear layer stored in ``scheme``; ``model`` is untouched.

    The new model shares the float tensors it does not quantize (norms; the embedding when
    ``lm_head="fp32"``) with ``model``: neither model writes to them.
    group_size: inputs per group for ``"int4"`` (must divide every layer's input size).
    lm_head: ``"int8"`` (default), ``"bf16"`` or ``"fp32"`` for the tied embedding / output
    projection (see the module docstring for why int8).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; allowed: {list(SCHEMES)}")
    if lm_head not in LM_HEAD_CHOICES:
        raise ValueError(f"lm_head={lm_head!r}; allowed: {list(LM_HEAD_CHOICES)}")
    if not isinstance(model, CausalLM):
        raise ValueError(f"quantize needs an llmlab CausalLM; got {type(model).__name__}")
    if isinstance(model, QuantizedCausalLM):
        raise ValueError(f"model is already quantized ({model.quant_scheme}); quantize the "
                         "float model instead")
    if model.dtype != torch.float32:
        raise ValueError(f"quantize expects a float32 model; got {model.dtype}")
    if getattr(model.config, "is_moe", False):
        raise ValueError("quantize supports dense models only (this one is a mixture of experts)")
    cfg = model.config
    if scheme == "int4":
        for n in {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}:
            formats.check_group_size(group_size, n)
    elif scheme == "q4_1":
        for n in {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}:
            if n % formats.Q4_1_BLOCK:
                raise ValueError(f"q4_1 needs layer input sizes divisible by 32; got {n}")

    # Copy the module tree but not the tensors: every parameter and buffer maps to itself.
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    new = copy.deepcopy(model, memo)
    new.__class__ = QuantizedCausalLM
    new.quant_scheme = scheme
    new.quant_options = {"group_size": group_size if scheme == "int4" else None, "lm_head": lm_head}

    for layer in new.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    if child.bias is not None:
                        raise ValueError(f"{name} has a bias; quantize supports bias-free layers")
                    setattr(parent, name, _make_linear(child.weight.detach(), scheme, group_size))
    if lm_head != "fp32":
        w = new.lm_head.weight.detach()
        head = Int8Linear(w) if lm_head == "int8" else BF16Linear(w)
        new.lm_head = head
        if cfg.tie_word_embeddings:
            new.embed_tokens = QuantizedEmbedding(head)
    return new.eval()


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of all weights as stored (quantized formats at their packed size), each
    shared tensor counted once: what one decode step reads from memory."""
    seen, total = set(), 0
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear):
            if id(mod) not in seen:
                seen.add(id(mod))
                total += mod.weight_nbytes()
            continue
        if isinstance(mod, QuantizedEmbedding):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


@torch.no_grad()
def fake_quantize(model: CausalLM, roundtrip) -> CausalLM:
    """A new float model whose decoder linear weights are ``roundtrip(W)`` (W [out, in] ->
    the dequantized [out, in]): simulated quantization, to measure a format's error
    without a kernel for it. The embedding, lm_head and norms are shared with ``model``."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    new = copy.deepcopy(model, memo)
    for layer in new.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    w = child.weight.detach()
                    got = roundtrip(w)
                    if not isinstance(got, torch.Tensor) or got.shape != w.shape:
                        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                        raise ValueError(f"roundtrip returned {shape} for a weight of shape "
                                         f"{tuple(w.shape)}; it must return the same shape")
                    lin = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                    lin.weight = nn.Parameter(got.to(w.dtype).contiguous(), requires_grad=False)
                    setattr(parent, name, lin)
    return new.eval()
