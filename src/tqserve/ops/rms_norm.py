"""RMSNorm in one launch (GPU): the optional residual add, the float32 norm and the weight.

The torch expression it replaces is `layers.norm.RMSNorm` (the reference, and what CPU tensors
take): about eight launches per call there (add, cast, square, mean, rsqrt, two multiplies, cast),
sixteen per decoder layer. A decode step of SmolLM2 (30 layers) spent more GPU time in such
elementwise launches than in attention, and every node costs the CUDA-graph launch host time
(docs/benchmarks.md, sixteenth session). Same roundings as the reference: the residual sum rounds
to the model dtype, the norm is float32, x * rsqrt(mean(x^2) + eps) rounds to the model dtype
before the weight multiplies it (in float32, rounded once). Only the mean's summation order differs.
Each row is reduced by one program with the same tile whatever the row count, so a token's output
does not depend on its step's batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, rows, inner, stride_xo, stride_xi, stride_ro, stride_ri, eps,
    H: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Rows r = o * inner + i of x [outer, inner, H] (strided), y and sum packed [rows, H]."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, BH)
    m = (r < rows)[:, None] & (c < H)[None, :]
    o, i = (r // inner).to(tl.int64), (r % inner).to(tl.int64)
    x = tl.load(x_ptr + (o * stride_xo + i * stride_xi)[:, None] + c[None, :], mask=m, other=0.0)
    packed = r.to(tl.int64)[:, None] * H + c[None, :]
    if RESIDUAL:
        res = tl.load(res_ptr + (o * stride_ro + i * stride_ri)[:, None] + c[None, :], mask=m, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounds as the reference's add
        tl.store(sum_ptr + packed, x, mask=m)
    xf = x.to(tl.float32)
    rs = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 1) / H + eps)
    n = (xf * rs[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    tl.store(y_ptr + packed, (n * w[None, :]).to(y_ptr.dtype.element_ty), mask=m)


def _views(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(outer, inner, outer stride, inner stride) of x [..., H] with at most two leading dims."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"rms_norm takes [rows, H] or [outer, inner, H], got {tuple(x.shape)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward` in one launch: norm(x), or with `residual` (norm(x + residual), x + residual).
    x / residual: [rows, H] or [outer, inner, H], last dim contiguous, any other strides; outputs
    are packed, in x's dtype."""
    h = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    outer, inner, sxo, sxi = _views(x)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        _, _, sro, sri = _views(residual)
        total = torch.empty_like(y)
    else:
        residual, total, sro, sri = x, y, 0, 0
    rows = outer * inner
    if rows == 0:
        return y if total is y else (y, total)
    bh = triton.next_power_of_2(h)
    br = max(1, min(16, 4096 // bh))  # rows per program: ~4K elements, one tile shape per H
    _rms_norm_kernel[(triton.cdiv(rows, br),)](
        x, residual, weight, y, total, rows, inner, sxo, sxi, sro, sri, eps,
        H=h, BH=bh, BR=br, RESIDUAL=total is not y, num_warps=4,
    )  # fmt: skip
    return y if total is y else (y, total)
