"""Activation-aware channel scaling for the int8 scheme: the same model, easier to quantize.

A linear layer computes y = W x. For any positive vector s [in], y = (W·diag(s)) (x / s):
scaling input channel j of the weight by s_j and the input by 1 / s_j changes nothing in
float arithmetic. It does change what int8 loses. With one scale per output row, the step
of row i is max_j |W_ij s_j| / 127, and round-to-nearest (RTN) leaves an error uniform in
± step / 2 on every weight, independent from weight to weight. The expected squared output
error over inputs with second moment H = E[x xᵀ] is then, summed over rows,

    E ‖(W − Ŵ) x‖² = Σ_i step_i² / 12 · Σ_j H_jj / s_j²
                   ∝ (Σ_i max_j (|W_ij| s_j)²) · (Σ_j H_jj / s_j²).

Growing s_j on a channel with large inputs (large H_jj) shrinks the second factor; it only
costs something in the first when that channel holds the largest weight of some row. This
module finds s by minimizing that product (Adam on log s), then folds it into the model so
the quantized model needs no extra operation at run time:

* q/k/v (input: ``input_layernorm``'s output): W[:, j] · s_j, the norm's weight g_j / s_j;
* gate/up (input: ``post_attention_layernorm``'s output): the same with that norm;
* o_proj (input: the attention output, head by head, each a weighted sum of v): W_o[:, j] · s_j
  and row j of v_proj / s_j. With grouped-query attention q head h reads kv head h // G
  (G = heads per kv head), so s is chosen per kv head and dimension and shared by its G
  q heads;
* down_proj (input: silu(gate) · up): W_down[:, j] · s_j and row j of up_proj / s_j.

Dividing a row of v_proj or up_proj by a constant does not change its int8 error (the
row's scale follows it), so those folds are free.

The idea is AWQ's (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM
Compression and Acceleration", MLSys 2024, https://arxiv.org/abs/2306.00978), which scales
channels by s = mean|x|^α and grid-searches α; SmoothQuant (Xiao et al., ICML 2023,
https://arxiv.org/abs/2211.10438) folds such scales the same way to move outliers from
activations into weights. Here s is free per channel and chosen for the per-row int8 grid
by the error model above, which needs only H's diagonal (each input channel's mean square).

Calibration: the scales need each input channel's mean square on typical text, so
``quantize(..., equalize=True)`` collects them on ``calibration`` token ids (default: the
first 2,048 tokens of ``data/text/calibration_prose.md``, prose written for the workbook on
topics unrelated to the evaluation text). Measured KLDs are in ``llmlab.quant``'s docstring
and ``python -m llmlab.bench quant``.

Layouts: weights [out, in] (``nn.Linear.weight``); H float32 [in, in] (from
:func:`llmlab.quant.gptq.collect_hessians`); s float32 [in]. Limits: dense llama-style
decoders (``DecoderLayer`` with RMSNorm, grouped-query attention, SwiGLU MLP), bias-free
layers, float32 weights. Used by ``llmlab.quantize(model, "int8", equalize=True)``; taught
in notebook 08.
"""
from __future__ import annotations

import torch
from torch import nn

STEPS = 200          # Adam steps per group of layers (the objective is smooth in log s)
LR = 0.05


def _log_error(a: torch.Tensor, h: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """log of the error model for |W| = a [rows, in], h [in] and log s [in]."""
    return (a * log_s.exp()).amax(dim=1).pow(2).sum().log() + (h * (-2 * log_s).exp()).sum().log()


def expected_rtn_error(weights: list[torch.Tensor], h: torch.Tensor,
                       s: torch.Tensor | None = None) -> torch.Tensor:
    """The error model above, up to a constant: (Σ_i max_j (|W_ij| s_j)²) · (Σ_j h_j / s_j²)
    over the rows of all ``weights`` (sharing one input), with h = diag(H) [in] and s [in]
    (None: all ones). A 0-dim tensor."""
    log_s = torch.zeros_like(h) if s is None else s.log()
    return _log_error(torch.cat([w.abs() for w in weights]), h, log_s).exp()


@torch.enable_grad()
def channel_scales(weights: list[torch.Tensor], h: torch.Tensor,
                   index: torch.Tensor | None = None, steps: int = STEPS,
                   lr: float = LR) -> torch.Tensor:
    """Per-input-channel scales s [in] minimizing :func:`expected_rtn_error` for
    ``weights`` (each [out_k, in], one shared input) and h = diag(H) [in].

    index: int64 [in] mapping every channel to a free parameter (s = p[index]), for
    channels that must share a scale (o_proj's q heads of one kv head); None: one per
    channel. s is normalized to geometric mean 1 (the objective ignores a common factor).
    Channels with h = 0 (never active on the calibration text) get a small floor so that
    their scale stays finite.
    """
    a = torch.cat([w.detach().abs().float() for w in weights])
    h = h.detach().float().clamp_min(0)
    h = h + 1e-3 * h.mean().clamp_min(1e-30)          # floor: dead channels stay finite
    n = a.shape[1] if index is None else int(index.max()) + 1
    log_p = torch.zeros(n, requires_grad=True)
    opt = torch.optim.Adam([log_p], lr=lr)
    for _ in range(steps):
        loss = _log_error(a, h, log_p if index is None else log_p[index])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        log_s = log_p if index is None else log_p[index]
        return (log_s - log_s.mean()).exp()


def _scale_rows(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach() / s[:, None], requires_grad=False)


def _scale_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.detach() * s[None, :], requires_grad=False)


def _scale_norm(norm: nn.Module, s: torch.Tensor) -> None:
    norm.weight = nn.Parameter(norm.weight.detach() / s, requires_grad=False)


def _check_layer(layer) -> None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    needed = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    needed += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    for parent, name in needed:
        mod = getattr(parent, name, None)
        if not isinstance(mod, nn.Linear) or mod.bias is not None:
            raise ValueError(f"equalize needs bias-free nn.Linear {name} in every decoder "
                             f"layer (a dense llama-style model); got {type(mod).__name__}")


@torch.no_grad()
def equalize(model, hessians: dict, steps: int | None = None) -> dict:
    """Fold channel scales into ``model`` in place (its norms, v_proj, up_proj and the
    scaled layers get new weight tensors; tensors shared with another model are not
    written), and return the hessians of the scaled inputs, H / (s sᵀ), under the same keys
    as ``hessians`` ({(layer, "self_attn.q_proj"): H, ...}, from
    :func:`llmlab.quant.gptq.collect_hessians` on the unscaled model).

    The float model computes the same function before and after, up to float32 rounding.
    ``steps``: Adam steps per group of layers (None: the module's ``STEPS``).
    """
    steps = STEPS if steps is None else steps
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    d = cfg.head_dim
    # o_proj input channel (q head h, dim e) shares the scale of v row (h // group, e)
    kv = torch.arange(cfg.num_heads) // group
    o_index = (kv[:, None] * d + torch.arange(d)[None, :]).reshape(-1)
    out: dict = {}
    done: dict[int, torch.Tensor] = {}

    def scaled_h(key, s):
        H = hessians[key]
        if id(H) not in done:
            done[id(H)] = H / s[:, None] / s[None, :]
        out[key] = done[id(H)]

    for i, layer in enumerate(model.layers):
        _check_layer(layer)
        attn, mlp = layer.self_attn, layer.mlp
        groups = [
            ("self_attn", ["q_proj", "k_proj", "v_proj"], layer.input_layernorm, None),
            ("mlp", ["gate_proj", "up_proj"], layer.post_attention_layernorm, None),
            ("self_attn", ["o_proj"], attn.v_proj, o_index),
            ("mlp", ["down_proj"], mlp.up_proj, None),
        ]
        for role, names, source, index in groups:
            parent = getattr(layer, role)
            key = (i, f"{role}.{names[0]}")
            if key not in hessians:
                raise ValueError(f"hessians has no entry {key}; pass collect_hessians(model, ...)")
            mods = [getattr(parent, n) for n in names]
            s = channel_scales([m.weight for m in mods], hessians[key].diagonal(), index, steps)
            for m in mods:
                _scale_columns(m, s)
            if isinstance(source, nn.Linear):          # v_proj / up_proj rows
                _scale_rows(source, s if index is None     # o: one scale per kv head row
                            else s.view(cfg.num_heads, d)[::group].reshape(-1))
            else:                                      # the RMSNorm before the group
                _scale_norm(source, s)
            for n in names:
                scaled_h((i, f"{role}.{n}"), s)
    return out
