"""Query rotation for codebook keys: y = R x for every row of a step's queries, in float32.

TurboQuant keys are stored rotated, so the kernels score q against them as R q (one rotation per
query row, not one inverse rotation per key). For a decode step that is a [T * Hq, d] x [d, d]
float32 product of a few dozen rows, which cuBLAS serves with a split-K SIMT GEMM, a split-K
reduce and a separate bf16 -> float32 cast: three launches, ~14 us on an H100 at one request x
128K, a tenth of that step's attention (docs/benchmarks.md). `rotate_rows` is one launch that
reads the model's dtype directly; float32 FMA dots (IEEE), so float32 models keep full precision.
`rotate_rows_reference` is the torch expression it replaces, and what CPU tensors take (under the
interpreter a launch of many small programs costs seconds per engine step); `rotate_rows_kernel`
runs the kernel on any device (the tests compare the two there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (rows, output columns, warps) per program by the step's row count (tokens x heads), from a sweep on
# the H100 (CUDA-graph replays, ninth session; us, was 16 x 32 with 4 warps): up to SMALL_ROWS rows
# 16 x 8 with 2 warps (d = 128: 32 rows 6.0 -> 3.1, 64 rows 6.0 -> 3.1, 256 rows 6.1 -> 4.4; d = 64,
# 9 rows 3.7 -> 2.1), more rows 16 x 32 with 2 warps (d = 128: 1,024 rows 10.9 -> 7.8, 2,048 rows
# 20.3 -> 13.1; d = 64, 576 rows 3.9 -> 2.9). One warp over 32 or more columns, and 64-column blocks
# with 2 warps, spill (5-30x slower); 64-row blocks spilled ~3,700 instructions offline.
SMALL_ROWS = 256
SMALL_BLOCK = (16, 8, 2)
BLOCK = (16, 32, 2)


def rotate_rows_reference(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [..., d] (any float dtype) -> (R x) for each row, float32, same shape."""
    return (x.float() @ rot.T).view(x.shape)


@triton.jit
def _rotate_kernel(
    x_ptr, r_ptr, y_ptr, M, stride_xt,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """y[m, c] = sum_k x[m, k] * R[c, k] for rows m of this block and columns c of this one; row m
    is head m % H of token m // H (x [T, H, D], heads and dims packed, tokens strided)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    k = tl.arange(0, DP)
    xrow = (m // H).to(tl.int64) * stride_xt + (m % H) * D
    x = tl.load(x_ptr + xrow[:, None] + k[None, :], mask=(m < M)[:, None] & (k < D)[None, :], other=0.0)
    r = tl.load(r_ptr + c[None, :] * D + k[:, None], mask=(c < D)[None, :] & (k < D)[:, None], other=0.0)
    y = tl.dot(x.to(tl.float32), r, input_precision="ieee")
    tl.store(y_ptr + m[:, None].to(tl.int64) * D + c[None, :], y, mask=(m < M)[:, None] & (c < D)[None, :])


def rotate_rows(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """R x for every row of x [T, H, d] or [T, d] (any float dtype), float32 of x's shape: the Triton
    kernel on CUDA tensors, the torch reference on others."""
    if x.device.type != "cuda":
        _check(x, rot)
        return rotate_rows_reference(x, rot).contiguous()
    return rotate_rows_kernel(x, rot)


def _check(x: torch.Tensor, rot: torch.Tensor) -> None:
    d = x.shape[-1]
    if rot.shape != (d, d) or rot.dtype != torch.float32 or not rot.is_contiguous():
        raise ValueError(f"rot must be a contiguous float32 [{d}, {d}] matrix, got {tuple(rot.shape)} {rot.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [tokens, heads, d] or [tokens, d], got {tuple(x.shape)}")


def rotate_rows_kernel(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """`rotate_rows_reference` in one launch: x [T, H, d] or [T, d] (any float dtype; a strided token
    dim is read in place, heads and dims must be packed), rot R [d, d] float32 contiguous; returns
    float32 of x's shape, contiguous."""
    _check(x, rot)
    d = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != d):
        x = x.contiguous()
    m = x.shape[0] * heads
    y = torch.empty(x.shape, device=x.device, dtype=torch.float32)
    if m == 0:
        return y
    dp = max(16, triton.next_power_of_2(d))
    bm, bc, warps = SMALL_BLOCK if m <= SMALL_ROWS else BLOCK
    bc = min(bc, dp)
    grid = (triton.cdiv(m, bm), triton.cdiv(d, bc))
    _rotate_kernel[grid](x, rot, y, m, x.stride(0), H=heads, D=d, DP=dp, BM=bm, BC=bc, num_warps=warps)
    return y
