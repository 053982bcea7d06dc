"""Linear layers. Weights are allocated uninitialized: every value is overwritten by `load_weights`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_linear_op():
    """oneDNN's linear (the op inductor emits on CPU) and the input dtypes it runs on this CPU, checked
    against F.linear. On the 2-core AMD Zen 4 CI machine it runs SmolLM2's decode projections 1.2-2x faster
    than F.linear (MKL sgemm), in the same float32 arithmetic (only the summation order differs). CPUs
    without AVX-512 have no oneDNN bfloat16 inner product ("could not create a primitive descriptor"):
    bfloat16 takes F.linear there."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    ok = set()
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.ones(2, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype)
        try:
            if op is not None and torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w)):
                ok.add(dtype)
        except RuntimeError:
            pass
    return (op if ok else None), frozenset(ok)


_ONEDNN_LINEAR, _ONEDNN_DTYPES = _onednn_linear_op()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN for CPU float32 / bfloat16 inputs where this CPU runs it."""
    if (
        _ONEDNN_LINEAR is not None
        and not x.is_cuda
        and x.dtype in _ONEDNN_DTYPES
        and x.dtype == weight.dtype
        and weight.is_contiguous()
        and x.numel() > 0
    ):
        if x.dim() == 2 and x.shape[0] == 1:
            # A single row takes oneDNN's matrix-vector path, whose summation order differs from
            # the matrix path every other row count takes; two identical rows keep a token's
            # projection bit-identical whatever its step's batch (quantized KV pages turn such
            # last-bit differences into different indices).
            return _ONEDNN_LINEAR(x.expand(2, -1).contiguous(), weight, bias, "none", [], "")[:1]
        return _ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T + b with W stored as [out_features, in_features] (the HF layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
        """The projections of x, one per shard: one fused matmul, cut into views (on the CPU through
        oneDNN, which runs the fused matmul faster than one MKL matmul per shard)."""
        return self.split(self(x))
