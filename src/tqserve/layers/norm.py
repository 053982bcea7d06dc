"""RMSNorm, computed in float32 whatever the model dtype (as HF does), with an optional fused residual add.

On CUDA tensors one Triton launch does it all (`ops.rms_norm`); this torch expression is its reference.
"""

from __future__ import annotations

import torch
from torch import nn

from tqserve.ops import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the pre-norm
        decoder pattern, so the sum that feeds the next layer's residual branch is returned too."""
        if fused(x):
            from tqserve.ops.rms_norm import rms_norm  # Triton: imported on the CUDA path only

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
