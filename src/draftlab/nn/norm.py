"""RMSNorm as Llama-family decoder layers use it, shared by every draft architecture."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / norm precision: at least fp32, but fp64 stays fp64 (gradient checks run in double)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in (at least) fp32 and scale in the input dtype, as Llama does.
        y = F.rms_norm(x.to(compute_dtype(x.dtype)), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)
