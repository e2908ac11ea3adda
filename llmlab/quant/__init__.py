"""Weight-only quantization: ``llmlab.quantize(model, scheme)`` returns a smaller model.

>>> qmodel = llmlab.quantize(model, "int4", group_size=32)   # model itself is untouched
>>> llmlab.generate(qmodel, tok, "Hello", max_new_tokens=8)

Schemes (every linear layer of every decoder block):

* ``"int8"``: symmetric int8, one scale per output channel;
* ``"int4"``: 4-bit, group-wise asymmetric (w = q·d + m), ``group_size=32`` by default;
* ``"q4_1"``: exactly GGUF's Q4_1 (blocks of 32, float16 d and m);
* ``"fp8"``: float8 e4m3, one scale per output channel.

``lm_head`` chooses the format of the tied embedding / lm_head: ``"q8_0"`` (the default),
``"int8"`` (one scale per row), ``"int4"`` (groups of 32), ``"bf16"`` or ``"fp32"``. The
[49152, 576] table is a fifth of SmolLM2's float32 bytes and every decode step reads all of
it, so a float32 head (113 MB) would outweigh all the 4-bit layers together (66-80 MB). The
shipped file stores it as GGUF Q8_0 (int8 codes, a float16 scale per 32), so ``"q8_0"``
keeps it exactly, at 34 bytes per 32 weights. The int4 and Q4_1 linears also give back the
shipped weights exactly, so with the Q8_0 head and float32 arithmetic (the C decode kernels,
the reference) an int4 model is the float model up to the order of the additions; an int4
head instead gives a KLD of 6.7e-2 nats/token against float32 (measured over 1,023 tokens of
the evaluation text), which is why 4 bits are not the default there.

``exact_top=64`` (the default) wraps the head in :class:`RefinedHead`, which recomputes the
64 largest logits of each position in float32 from the head's exact rows where the head's
kernel rounds to bfloat16 (PyTorch's packed kernels, the fallback without a C compiler or
under ``use_kernels("torch")``): with those kernels, over 1,023 tokens, int4 gives a KLD of
3.3e-4 with it and 8.1e-4 without. Where the head computes in float32 it does nothing.

The ``"int8"`` scheme keeps its definition (one scale per output channel) and with it a
larger error: the per-row int8 linears alone give a KLD of about 3e-3 (the q/k/v and down
projections about a third each), because one step per row is coarser than the shipped
4-bit blocks wherever a block's range is small next to its row's largest weight. Two
calibrated options keep the format and lower the error, both from statistics of the
layers' inputs on :func:`calibration_token_ids` (prose written for the workbook):
``equalize=True`` folds a scale per input channel into the norms, v_proj and up_proj
(:mod:`llmlab.quant.equalize`, AWQ's idea), and ``rounding="gptq"`` chooses the codes with
GPTQ (:mod:`llmlab.quant.gptq`). Over the whole evaluation text (2,531 tokens): round to
nearest 3.2e-3, both together 9.2e-4 (``python -m llmlab.bench quant`` prints both).

``fuse=True`` (the default) stores q/k/v and gate/up of each layer as one matrix each
(:class:`SharedProjection`): one kernel call per group, the same weights.

Activations stay float32 between layers; the KV cache is untouched. The C decode kernels
are torch operators (``torch.ops.llmlab.int8_gemv``, ``q4_gemv``, ...), so a quantized
model's decode step compiles into one graph: ``llmlab.generate(qmodel, tok, prompts,
compile=True)`` gives eager's greedy tokens (notebook 11). Taught in notebook 08.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..models.llama import CausalLM
from . import formats, gptq
from .equalize import channel_scales, equalize as equalize_channels
from .formats import (Q4_1, fp8_dequantize, fp8_quantize, group_dequantize, group_quantize,
                      int8_dequantize, int8_quantize, q4_1_dequantize, q4_1_quantize)
from .linear import (BF16Linear, FP8Linear, GroupLinear, Int8Linear, ProjectionSlice, Q8_0Linear,
                     QuantizedEmbedding, QuantizedLinear, RefinedHead, SharedProjection,
                     use_kernels)

SCHEMES = ("int8", "int4", "q4_1", "fp8")
ROUNDINGS = ("rtn", "gptq")          # gptq: int8 only (llmlab.quant.gptq)
LM_HEAD_CHOICES = ("q8_0", "int8", "int4", "bf16", "fp32")
FUSED = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}

__all__ = ["quantize", "fake_quantize", "SCHEMES", "weight_nbytes", "QuantizedCausalLM", "QuantizedLinear",
           "Int8Linear", "GroupLinear", "FP8Linear", "Q8_0Linear", "QuantizedEmbedding",
           "SharedProjection", "ProjectionSlice", "RefinedHead", "use_kernels", "Q4_1",
           "q4_1_quantize", "q4_1_dequantize", "int8_quantize", "int8_dequantize",
           "group_quantize", "group_dequantize", "fp8_quantize", "fp8_dequantize", "formats",
           "ROUNDINGS", "gptq", "gptq_int8", "collect_hessians", "calibration_token_ids",
           "equalize_channels", "channel_scales"]

gptq_int8, collect_hessians = gptq.gptq_int8, gptq.collect_hessians
calibration_token_ids = gptq.calibration_token_ids


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


def _check_quantizable(model, scheme: str, group_size: int, lm_head: str) -> None:
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
    sizes = {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}
    if scheme == "int4":
        for n in sizes:
            formats.check_group_size(group_size, n)
    if scheme == "q4_1" or lm_head in ("q8_0", "int4"):
        for n in (sizes if scheme == "q4_1" else {cfg.hidden_size}):
            if n % formats.Q4_1_BLOCK:
                raise ValueError(f"{scheme if scheme == 'q4_1' else 'lm_head=' + lm_head} needs "
                                 f"layer input sizes divisible by 32; got {n}")


def _make_gptq_linear(weights: list[torch.Tensor], hs: list[torch.Tensor]) -> Int8Linear:
    """int8 codes chosen by GPTQ for the rows of ``weights`` stacked, each part with its
    input's H: one run where the parts share H (rows are independent, so the codes are
    those of separate runs), else one run per part."""
    if all(h is hs[0] for h in hs):
        return Int8Linear.from_codes(*gptq.gptq_int8(torch.cat(weights), hs[0]))
    parts = [gptq.gptq_int8(w, h) for w, h in zip(weights, hs)]
    return Int8Linear.from_codes(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))


def _quantize_block(parent: nn.Module, role: str, scheme: str, group_size: int, fuse: bool,
                    hessians: dict | None = None) -> None:
    """Replace the linear layers of one attention or MLP module (``role``), in place;
    ``hessians`` ({child name: H}, GPTQ rounding) or None (round to nearest)."""
    for name, child in parent.named_children():
        if isinstance(child, nn.Linear) and child.bias is not None:
            raise ValueError(f"{name} has a bias; quantize supports bias-free layers")
    fused_name, names = FUSED.get(role, (None, ()))
    if fuse and all(isinstance(getattr(parent, n, None), nn.Linear) for n in names):
        weights = [getattr(parent, n).weight.detach() for n in names]
        fused = (_make_linear(torch.cat(weights), scheme, group_size) if hessians is None
                 else _make_gptq_linear(weights, [hessians[n] for n in names]))
        shared = SharedProjection(fused, [w.shape[0] for w in weights])
        setattr(parent, fused_name, shared)
        for n, part in zip(names, shared.parts):
            setattr(parent, n, part)
    for name, child in list(parent.named_children()):
        if isinstance(child, nn.Linear):
            w = child.weight.detach()
            setattr(parent, name, _make_linear(w, scheme, group_size) if hessians is None
                    else _make_gptq_linear([w], [hessians[name]]))


def _calibration_hessians(model, scheme: str, rounding: str, equalize: bool,
                          calibration) -> dict | None:
    """Check ``rounding`` / ``equalize`` / ``calibration``; when either needs them, the
    layers' input second moments on the calibration text (else None)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}; allowed: {list(ROUNDINGS)}")
    if not isinstance(equalize, bool):
        raise ValueError(f"equalize={equalize!r} must be True or False")
    if rounding == "rtn" and not equalize:
        if calibration is not None:
            raise ValueError("calibration is used by rounding='gptq' or equalize=True only; "
                             "got rounding='rtn', equalize=False")
        return None
    if scheme != "int8":
        what = "rounding='gptq'" if rounding == "gptq" else "equalize=True"
        raise ValueError(f"{what} is implemented for scheme 'int8' only; for {scheme!r} "
                         "allowed: ['rtn'] and equalize=False")
    if calibration is None:
        name = getattr(model, "name", "custom")
        if name != "smollm2-135m":
            raise ValueError(f"rounding='gptq' and equalize=True need calibration token ids for "
                             f"model {name!r} (the shipped calibration text is tokenized for "
                             "smollm2-135m); pass calibration=<list of token ids>, e.g. "
                             "llmlab.quant.calibration_token_ids(tokenizer)")
        from ..models.loader import load_tokenizer
        calibration = gptq.calibration_token_ids(load_tokenizer(name))
    return gptq.collect_hessians(model, calibration)


def _make_head(weight: torch.Tensor, lm_head: str) -> QuantizedLinear:
    if lm_head == "q8_0":
        return Q8_0Linear(weight)
    if lm_head == "int8":
        return Int8Linear(weight)
    if lm_head == "int4":
        return GroupLinear(weight, group_size=32)
    return BF16Linear(weight)


@torch.no_grad()
def quantize(model: CausalLM, scheme: str, *, group_size: int = 32, lm_head: str = "q8_0",
             fuse: bool = True, rounding: str = "rtn", equalize: bool = False,
             calibration=None, exact_top: int = 64) -> QuantizedCausalLM:
    """A new model with every decoder linear layer stored in ``scheme``; ``model`` is untouched.

    The new model shares the float tensors it does not quantize (norms; the embedding when
    ``lm_head="fp32"``) with ``model``: neither model writes to them.
    group_size: inputs per group for ``"int4"`` (must divide every layer's input size).
    lm_head: ``"q8_0"`` (default), ``"int8"``, ``"int4"``, ``"bf16"`` or ``"fp32"`` for the
    tied embedding / output projection (see the module docstring for the trade-off).
    fuse: store q/k/v and gate/up of each layer as one matrix each (:class:`SharedProjection`),
    one matmul per group instead of three or two; the weights are the same.
    rounding: ``"rtn"`` (default: every weight rounded to its nearest code) or ``"gptq"``
    (``"int8"`` only: the same scales, codes chosen by GPTQ to keep each layer's outputs
    close on calibration text; :mod:`llmlab.quant.gptq`). calibration: the token ids GPTQ
    runs the float model on; None means the first 2,048 tokens of
    ``data/text/calibration_prose.md`` (prose written for the workbook; for
    ``smollm2-135m`` only).
    equalize: (``"int8"`` only) fold per-input-channel scales, chosen from the calibration
    text's input statistics, into the norms, v_proj and up_proj before quantizing
    (:mod:`llmlab.quant.equalize`, with its measured KLDs; AWQ's idea; about a minute on a
    2-core CPU).
    exact_top: recompute this many of the largest logits per position exactly in float32
    (:class:`RefinedHead`; 0: keep the head kernel's bfloat16 logits). No effect with
    ``lm_head="fp32"``.
    """
    _check_quantizable(model, scheme, group_size, lm_head)
    if not isinstance(exact_top, int) or not 0 <= exact_top <= model.config.vocab_size:
        raise ValueError(f"exact_top={exact_top!r} must be an int in [0, "
                         f"{model.config.vocab_size}] (0: off)")
    hessians = _calibration_hessians(model, scheme, rounding, equalize, calibration)
    # Copy the module tree but not the tensors: every parameter and buffer maps to itself.
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    new = copy.deepcopy(model, memo)
    new.__class__ = QuantizedCausalLM
    new.quant_scheme = scheme
    new.quant_options = {"group_size": group_size if scheme == "int4" else None,
                         "lm_head": lm_head, "fuse": fuse, "rounding": rounding,
                         "equalize": equalize, "exact_top": exact_top if lm_head != "fp32" else 0}
    if equalize:                 # new norms / v / up weights; model's tensors untouched
        hessians = equalize_channels(new, hessians)
    if rounding == "rtn":        # equalize alone needed the statistics, not the rounding
        hessians = None
    for i, layer in enumerate(new.layers):
        for role in ("self_attn", "mlp"):
            hs = None if hessians is None else {
                name.split(".", 1)[1]: h for (j, name), h in hessians.items()
                if j == i and name.split(".", 1)[0] == role}
            _quantize_block(getattr(layer, role), role, scheme, group_size, fuse, hs)
    if lm_head != "fp32":
        head = _make_head(new.lm_head.weight.detach(), lm_head)
        new.lm_head = RefinedHead(head, exact_top) if exact_top else head
        if new.config.tie_word_embeddings:
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
