"""Linear layers. Weights are allocated uninitialized: every value is overwritten by `load_weights`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b with W stored as [out_features, in_features] (the HF layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul (q/k/v, gate/up).

    Output rows are the shards concatenated in order; `load_shard` writes one checkpoint tensor
    into its row range, and `split` cuts the fused output back into the shards.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(out_sizes), bias, dtype)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]

    def load_shard(self, param: str, shard: int, tensor: torch.Tensor) -> None:
        target = getattr(self, param)
        if target is None:
            raise ValueError(f"checkpoint has a {param} for a projection built without one")
        start, size = self.offsets[shard], self.out_sizes[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard} of {param}: expected {size} rows, got {tuple(tensor.shape)}")
        target.data[start : start + size].copy_(tensor)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)

    def shards(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x, one per shard. On CUDA one fused matmul (fewer launches); on the
        CPU one matmul per shard over row views of the weight, which MKL runs faster than the
        wide fused matmul plus the split (measured on SmolLM2 decode batches)."""
        if x.is_cuda:
            return self.split(self(x))
        out = []
        for start, size in zip(self.offsets, self.out_sizes):
            b = None if self.bias is None else self.bias[start : start + size]
            out.append(F.linear(x, self.weight[start : start + size], b))
        return tuple(out)
