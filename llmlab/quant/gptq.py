"""GPTQ rounding for the int8 scheme: the same codes' grid, better rounding decisions.

Round-to-nearest (RTN, ``formats.int8_quantize``) rounds every weight alone. GPTQ
(Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", ICLR 2023, https://arxiv.org/abs/2210.17323) keeps
the same grid, here the int8 scheme's one scale per output row, s = max|w_row| / 127,
and chooses the codes so that the layer's *outputs* stay close on typical inputs:
it minimizes ‖X Wᵀ − X Ŵᵀ‖² over the calibration inputs X [n, in].

That error is a quadratic form in each row's weight error δ = w − ŵ: ‖X δ‖² = n·δᵀ H δ
with **H = XᵀX / n** [in, in], the (uncentered) second moment of the layer's inputs; rows
are independent (they share H, not their errors). GPTQ quantizes the input columns one at
a time, and after rounding column i it spreads that column's error over the columns not yet
quantized, in proportion to the inverse of H (Optimal Brain Surgeon's update): the remaining
weights absorb what column i got wrong, where the inputs are correlated. Implemented as in
the paper: the Cholesky factor of H⁻¹ gives every update, applied lazily per ``block`` of
columns; ``act_order`` quantizes the columns with the largest H diagonal (the largest
inputs) first; ``damp`` adds damp · mean(diag H) to the diagonal, so H is invertible and
the updates stay moderate.

Layouts: weights ``w [out_features, in_features]`` (``nn.Linear.weight``), codes int8
[out, in] in [-127, 127], scales float32 [out], w ≈ q · scale[:, None] as in
:mod:`llmlab.quant.formats`: the stored format and the kernels do not change, only the
codes do. H is float32 [in, in], one per distinct layer input.

Limits:

* the inputs come from the float32 model (every layer sees unquantized inputs), not from
  the partly quantized model as in the paper's sequential variant;
* the scales stay RTN's (max|w|/127); GPTQ does not search for better ones;
* the error is measured on the calibration text only: it should look like what the model
  will read. ``data/text/calibration_prose.md`` is prose written for the workbook (a story,
  a how-to, tides, bicycles, a letter, ...) on topics unrelated to the evaluation text;
* inputs that are zero on every calibration token ("dead", H's diagonal 0) carry no
  information: their weights get the RTN codes and take no share of other errors;
* int8 only (``llmlab.quantize(model, "int8", rounding="gptq")``); the same algorithm works
  for other grids but is not wired to them.

Taught in notebook 08.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .formats import int8_scale

CALIBRATION_TEXT = Path(__file__).resolve().parents[2] / "data" / "text" / "calibration_prose.md"
DAMP = 0.1   # chosen on held-out calibration prose (see gptq_int8), never on the evaluation text


def calibration_text() -> str:
    """The calibration text without its title line."""
    if not CALIBRATION_TEXT.exists():
        raise FileNotFoundError(f"no calibration text at {CALIBRATION_TEXT}")
    return CALIBRATION_TEXT.read_text().split("\n", 1)[1].lstrip("\n")


def calibration_token_ids(tokenizer, max_tokens: int | None = 2048) -> list[int]:
    """Token ids of the calibration text (``data/text/calibration_prose.md``), the first
    ``max_tokens`` of them (None: all, 4,730 for SmolLM2's tokenizer)."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 2):
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 2 or None")
    ids = tokenizer(calibration_text())["input_ids"]
    return ids if max_tokens is None else ids[:max_tokens]


def _decoder_linears(model) -> list[tuple[int, str, nn.Linear]]:
    return [(i, name, mod) for i, layer in enumerate(model.layers)
            for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)]


@torch.inference_mode()
def collect_hessians(model, token_ids, window: int = 512) -> dict[tuple[int, str], torch.Tensor]:
    """H = XᵀX / n for the input X [n, in] of every decoder ``nn.Linear`` (not lm_head),
    over ``token_ids`` run through ``model`` (float32) in windows of ``window`` tokens,
    each a fresh context (as :func:`llmlab.quant.eval.compare_logits` does).

    -> {(layer index, module name): H float32 [in, in]}, e.g. ``(3, "self_attn.q_proj")``.
    Layers called with the same input tensor (q/k/v; gate/up) share one H: the same tensor
    object under each of their keys. Accumulated in float64, returned in float32.
    """
    from ..models.llama import CausalLM

    if not isinstance(model, CausalLM):
        raise ValueError(f"collect_hessians needs an llmlab CausalLM; got {type(model).__name__}")
    if model.dtype != torch.float32:
        raise ValueError(f"collect_hessians expects a float32 model; got {model.dtype}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int")
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.reshape(-1).tolist()
    token_ids = list(token_ids)
    if not token_ids:
        raise ValueError("token_ids is empty; pass at least one token id")
    from ..prompts import check_token_ids
    check_token_ids(token_ids, model.config.vocab_size)

    sums: dict[tuple[int, str], list] = {}     # key -> [XᵀX float64, rows]; shared lists alias
    last = {"x": None, "key": None}

    def hook_for(key):
        def hook(mod, inputs, output):
            x = inputs[0]
            if x is last["x"]:                      # same input as the previous layer: share H
                sums[key] = sums[last["key"]]
                return
            x2 = x.reshape(-1, x.shape[-1]).double()
            acc = sums.get(key)
            if acc is None:
                acc = sums[key] = [torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float64,
                                               device=x2.device), 0]
            acc[0] += x2.T @ x2
            acc[1] += x2.shape[0]
            last["x"], last["key"] = x, key
        return hook

    handles = [mod.register_forward_hook(hook_for((i, name)))
               for i, name, mod in _decoder_linears(model)]
    try:
        ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)
        for start in range(0, len(ids), window):
            last["x"] = last["key"] = None
            model(ids[start:start + window][None])
    finally:
        for h in handles:
            h.remove()
    out, done = {}, {}
    for key, acc in sums.items():
        if id(acc) not in done:
            done[id(acc)] = (acc[0] / max(acc[1], 1)).float()
        out[key] = done[id(acc)]
    return out


@torch.no_grad()
def gptq_int8(w: torch.Tensor, H: torch.Tensor, damp: float = DAMP, block: int = 128,
              act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] and its input's H [in, in] -> (q int8 [out, in], scale float32 [out]).

    The scales are ``formats.int8_quantize``'s (max|w_row| / 127), the codes chosen by GPTQ
    to keep ‖X wᵀ − X ŵᵀ‖ small (see the module docstring). damp: added to H's diagonal
    as damp · mean(diag H) (> 0; the paper uses 0.01). The default, 0.1, was chosen with
    ``equalize=True`` on SmolLM2, calibrating on the first 2,048 tokens of the calibration
    prose and measuring the KLD on the next 1,536 (damp 0.01 / 0.1 / 0.3 / 1.0: 1.10e-3 /
    8.66e-4 / 8.68e-4 / 8.94e-4 nats/token); block: columns per lazy update;
    act_order: quantize the inputs with the largest H diagonal first. Dead inputs (H's
    diagonal 0) get their RTN codes.
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"w must be a floating-point matrix [out_features, in_features]; "
                         f"got {shape}")
    n = w.shape[1]
    if (not isinstance(H, torch.Tensor) or not H.is_floating_point()
            or tuple(H.shape) != (n, n)):
        shape = tuple(H.shape) if isinstance(H, torch.Tensor) else type(H).__name__
        raise ValueError(f"H must be a floating-point [in, in] = [{n}, {n}] matrix for w of "
                         f"shape {tuple(w.shape)}; got {shape}")
    if not torch.isfinite(H).all() or not torch.isfinite(w).all():
        raise ValueError("w and H must be finite (no inf or nan)")
    if (isinstance(damp, bool) or not isinstance(damp, (int, float))
            or not 0 < damp <= 1):
        raise ValueError(f"damp={damp!r} must be a number in (0, 1] (a fraction of H's mean "
                         "diagonal; the paper uses 0.01)")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int (columns per lazy update)")
    if not isinstance(act_order, bool):
        raise ValueError(f"act_order={act_order!r} must be True or False")

    w = w.detach().float()
    scale = int8_scale(w)
    W = w.clone()
    H = H.detach().to(device=w.device, dtype=torch.float64).clone()
    diag = H.diagonal()
    dead = diag <= 0
    H[dead, :] = 0
    H[:, dead] = 0
    diag[dead] = 1                       # decoupled: H⁻¹ keeps no link to the other inputs
    perm = (torch.argsort(diag, descending=True, stable=True) if act_order
            else torch.arange(n, device=w.device))
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    try:
        L = torch.linalg.cholesky(H)
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
    except RuntimeError as e:           # torch.linalg.LinAlgError is a RuntimeError
        raise ValueError(f"H is not positive definite even with damp={damp}; H must be a "
                         f"second moment XᵀX/n (symmetric, positive semi-definite): {e}") from e

    # columns as contiguous rows: every step below reads and writes whole rows of Wt
    Wt, Qt = W.t().contiguous(), torch.zeros(n, w.shape[0], dtype=w.dtype, device=w.device)
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        W1 = Wt[b0:b1].clone()                         # [columns of the block, out]
        Err = torch.zeros_like(W1)
        Hi = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = W1[i]
            q = torch.round(col / scale).clamp_(-127, 127)
            Qt[b0 + i] = q
            e = (col - q * scale) / Hi[i, i]
            W1[i:] -= Hi[i, i:, None] * e
            Err[i] = e
        Wt[b1:] -= Hinv[b0:b1, b1:].t() @ Err
    q = Qt.t()[:, torch.argsort(perm)].to(torch.int8)
    return q, scale
