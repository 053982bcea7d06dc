"""Query rotation for codebook keys: y = R x for every row of a step's queries, in float32.

TurboQuant keys are stored rotated, so the kernels score q against them as R q (one rotation per
query row, not one inverse rotation per key). For a decode step that is a [T * Hq, d] x [d, d]
float32 product of a few dozen rows, which cuBLAS serves with a split-K SIMT GEMM, a split-K
reduce and a separate bf16 -> float32 cast: three launches, ~14 us on an H100 at one request x
128K, a tenth of that step's attention (docs/benchmarks.md). `rotate_rows` is one launch that
reads the model's dtype directly: tensor-core `tf32x3` dots for 16-bit rows (exact in tf32, so only
R's hi / lo split rounds: ~5e-7), IEEE FMA dots for float32 rows, so float32 models keep full precision.
`rotate_rows_reference` is the torch expression it replaces, and what CPU tensors take (under the
interpreter a launch of many small programs costs seconds per engine step); `rotate_rows_kernel`
runs the kernel on any device (the tests compare the two there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (rows, output columns, warps) per program by the step's row count (tokens x heads). 16-bit rows
# (exact in tf32) take tensor-core `tf32x3` dots, error ~5e-7 of the largest output (R's hi / lo
# split), float32 rows IEEE FMA dots. H100, eleventh session, CUDA-graph replays with launch (us,
# IEEE 16 x 32 x 2 warps -> tf32x3): d = 128, 5,120 rows (a 32 x 5 verify step) 32.6 -> 9.6 at
# 64 x 32 x 4 warps (16 x 32: 13.7); 1,024 rows 11.7 -> 8.2; d = 256, 4,096 rows 97.5 -> 14.9 at
# 64 x 64 (64 x 32: 19.1); up to SMALL_ROWS rows every shape is within a microsecond, 16 x 8 x 2.
SMALL_ROWS = 256
SMALL_BLOCK = (16, 8, 2)
BLOCK = (64, 32, 4)
WIDE_BLOCK = (64, 64, 4)  # d > 128
IEEE_BLOCK = (16, 32, 2)  # float32 rows, more than SMALL_ROWS (ninth session's sweep of the FMA dot)
BLOCK_K = 64  # rows of R per dot


def rotate_rows_reference(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [..., d] (any float dtype) -> (R x) for each row, float32, same shape."""
    return (x.float() @ rot.T).view(x.shape)


@triton.jit
def _rotate_kernel(
    x_ptr, r_ptr, y_ptr, M, stride_xt,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """y[m, c] = sum_k x[m, k] * R[c, k] for rows m of this block and columns c of this one; row m
    is head m % H of token m // H (x [T, H, D], heads and dims packed, tokens strided)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    xrow = (m // H).to(tl.int64) * stride_xt + (m % H) * D
    y = tl.zeros((BM, BC), dtype=tl.float32)
    for k0 in tl.static_range(0, DP, BK):  # K chunks bound the registers at d = 256
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + xrow[:, None] + k[None, :], mask=(m < M)[:, None] & (k < D)[None, :], other=0.0)
        r = tl.load(r_ptr + c[None, :] * D + k[:, None], mask=(c < D)[None, :] & (k < D)[:, None], other=0.0)
        y = tl.dot(x.to(tl.float32), r, y, input_precision=PREC)
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
    f32 = x.dtype == torch.float32
    bm, bc, warps = SMALL_BLOCK if m <= SMALL_ROWS else IEEE_BLOCK if f32 else WIDE_BLOCK if d > 128 else BLOCK
    bc = min(bc, dp)
    grid = (triton.cdiv(m, bm), triton.cdiv(d, bc))
    prec = "ieee" if f32 else "tf32x3"  # 16-bit rows are exact in tf32: R's hi / lo split carries it
    _rotate_kernel[grid](
        x, rot, y, m, x.stride(0), H=heads, D=d, DP=dp, BK=min(dp, BLOCK_K), BM=bm, BC=bc, PREC=prec, num_warps=warps
    )
    return y
