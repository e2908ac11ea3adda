"""RMSNorm: x / sqrt(mean(x²) + eps) · weight, computed in float32 like the reference.

A float32 input takes PyTorch's one-call ``F.rms_norm`` (the same arithmetic, bit for bit
on CPU, tested against the formula); other dtypes follow HF Llama's order exactly:
normalize in float32, round to the input dtype, then scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
