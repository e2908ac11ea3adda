"""Prepacked weights for CPU matrix multiplies (oneDNN), a serving engine's CPU trick.

A CPU GEMM library does not multiply a weight in the layout it is stored in: every call
first copies ("packs") panels of the weight into a blocked layout its micro-kernel reads
with unit stride, then multiplies. For a prompt of 1000 tokens the packing is a rounding
error. For a decode step of 16–64 rows it is a real share of the work, because the
multiply itself is small and the packing touches every weight once more. Serving engines
on CPU (vLLM's CPU backend, Intel's extension for PyTorch) therefore reorder each weight
once, at load time, into the library's blocked layout and call the GEMM on that.

:func:`prepack_linears` does this for every ``nn.Linear`` of a model with oneDNN
(``torch.ops.mkldnn._reorder_linear_weight`` once; ``_linear_pointwise`` per call). The
module keeps its ``weight`` parameter, so tied weights, ``state_dict`` and every other
reader are unchanged; the packed copy is extra memory (as much again as the linear
weights, ~540 MB for SmolLM2-135M in float32).

Limits, and when the plain ``F.linear`` runs instead:

* float32 on CPU only, no autograd (inference);
* fewer than ``min_rows`` rows (default 16): at a handful of rows the GEMM only streams
  the weight, MKL's path for that is as fast or faster, and measured on a 2-core Xeon the
  packed call was slower at 1–8 rows;
* the weight changed since packing (in place, or replaced): it is repacked on the next call.

Results equal ``F.linear`` to float32 rounding (another summation order), not bit for bit.
Used by the serving engine (:class:`llmlab.engine.LLM`, ``prepack_weights``); notebook 05.
"""
from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MIN_ROWS = 16


def prepack_supported() -> bool:
    """Whether this torch build has the oneDNN linear ops."""
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and bool(ops._reorder_linear_weight) \
            and bool(ops._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def prepack_by_default(model: nn.Module) -> bool:
    """Prepack when it is known to pay: a float32 model on an x86 CPU with oneDNN."""
    try:
        p = next(model.parameters())
    except StopIteration:
        return False
    return (p.device.type == "cpu" and p.dtype == torch.float32 and prepack_supported()
            and platform.machine().lower() in ("x86_64", "amd64"))


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` that also holds its weight in oneDNN's blocked layout.

    Made by :func:`prepack_linears` (which switches an existing module's class, so its
    parameters stay the same objects); ``min_rows`` is the smallest row count that takes
    the packed path.
    """

    min_rows: int = DEFAULT_MIN_ROWS

    def _repack(self) -> None:
        w = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self._packed_key = (w.data_ptr(), w._version, w.dtype, w.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1)
        if (rows < self.min_rows or x.dtype != torch.float32 or w.dtype != torch.float32
                or x.device.type != "cpu" or w.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        if self._packed_key != (w.data_ptr(), w._version, w.dtype, w.device):
            self._repack()
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self._packed, bias,
                                               "none", [None], "")
        return y.view(*x.shape[:-1], self.out_features)


def prepack_linears(model: nn.Module, min_rows: int = DEFAULT_MIN_ROWS) -> int:
    """Give every ``nn.Linear`` of ``model`` a oneDNN-packed weight, in place.

    Returns how many linears are prepacked (0, and the model untouched, where this torch
    build has no oneDNN). Calling it again only updates ``min_rows``.
    """
    if not isinstance(min_rows, int) or min_rows < 1:
        raise ValueError(f"min_rows={min_rows!r} must be an int >= 1")
    if not prepack_supported():
        return 0
    count = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = PrepackedLinear
            mod._packed_key = None
            with torch.no_grad():
                mod._repack()
        if isinstance(mod, PrepackedLinear):
            mod.min_rows = min_rows
            count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`prepack_linears`: plain ``nn.Linear`` modules again, packed copies freed."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, PrepackedLinear):
            mod.__class__ = nn.Linear
            for name in ("_packed", "_packed_key", "min_rows"):
                mod.__dict__.pop(name, None)
            count += 1
    return count


__all__ = ["PrepackedLinear", "prepack_linears", "unpack_linears", "prepack_supported",
           "prepack_by_default", "DEFAULT_MIN_ROWS"]
