"""silu(gate) * up in one launch (GPU) from the fused [gate | up] projection output.

The reference is the torch expression `F.silu(gate) * up` (two launches, and what CPU tensors take).
Same roundings: silu in float32 rounded to the model dtype, then the product in float32 rounded
once. exp may differ from torch's in the last float32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_x, I: tl.constexpr, B: tl.constexpr):  # noqa: E741
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * B + tl.arange(0, B)
    m = c < I
    g = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0)
    u = tl.load(x_ptr + t * stride_x + I + c, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(y_ptr + t * I + c, (s * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 I] = [gate | up] (last dim contiguous, any row stride) -> silu(gate) * up [T, I], packed."""
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"the last dim must hold gate and up of equal size, got {two_i}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    inter = two_i // 2
    y = torch.empty((T, inter), device=x.device, dtype=x.dtype)
    if T:
        b = min(BLOCK, triton.next_power_of_2(inter))
        _silu_mul_kernel[(T, triton.cdiv(inter, b))](x, y, x.stride(0), I=inter, B=b, num_warps=4)
    return y
