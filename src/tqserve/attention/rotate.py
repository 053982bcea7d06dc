"""Query rotation for codebook keys: y = R x for every row of a step's queries, in float32.

TurboQuant keys are stored rotated, so the kernels score q against them as R q (one rotation per
query row, not one inverse rotation per key). For a decode step that is a [T * Hq, d] x [d, d]
float32 product of a few dozen rows, which cuBLAS serves with a split-K SIMT GEMM, a split-K
reduce and a separate bf16 -> float32 cast: three launches, ~14 us on an H100 at one request x
128K, a tenth of that step's attention (docs/benchmarks.md). `rotate_rows` is one launch that
reads the model's dtype directly: tensor-core `tf32x3` dots for 16-bit rows (exact in tf32, so only
R's hi / lo split rounds: ~5e-7), IEEE FMA dots for float32 rows, so float32 models keep full precision.
Where R is one randomized Hadamard block (`hadamard=True`: R = H diag(s) / sqrt(d), d a power of two) 16-bit
rows take one 16-bit dot instead of three tf32 ones: s * x is exact in the rows' dtype and H's +-1 in any,
so only the float32 sums and the final 1 / sqrt(d) round.
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
# 16-bit rows against a Hadamard R (`hadamard=True`) take `_hadamard_kernel` (0: the tf32x3 dots, A/B). The
# query rotation of a 32 x 5 x 32K verify step (5,120 rows, d = 128): 5.4 us with tf32x3, 4.7 us this way (H200,
# forty-second session, `kernel_probe.py`).
HADAMARD16 = 1
_HADAMARD: dict[tuple, torch.Tensor] = {}


def hadamard_table(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Sylvester's [n, n] Hadamard matrix in `dtype` on `device`, built once (the engine's warm-up steps
    reach it before any graph capture): the 16-bit rotation dots load it as their operand. The key names the
    device with its index, as tensors report it, so a table built for `cuda` serves launches on `cuda:0`."""
    key = (n, dtype, _device_name(device))
    if key not in _HADAMARD:
        from tqserve.kvquant.rotation import fwht

        _HADAMARD[key] = fwht(torch.eye(n)).to(device=device, dtype=dtype).contiguous()
    return _HADAMARD[key]


def _device_name(device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def hadamard16(d: int, dtype: torch.dtype) -> bool:
    """Whether rows of `dtype` at head size d rotate by 16-bit dots against a Hadamard R (`HADAMARD16`; the
    callers' `hadamard=True` says R is one): 16-bit rows, a power-of-two d of at least the dots' 16."""
    return bool(HADAMARD16) and dtype in (torch.float16, torch.bfloat16) and d >= 16 and d & (d - 1) == 0


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


@triton.jit
def _hadamard_kernel(
    x_ptr, r_ptr, h_ptr, y_ptr, M, stride_xt, scale,
    H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """`_rotate_kernel` for R = Had diag(s) / sqrt(D) and 16-bit rows: y = (s * x) @ Had * scale, one 16-bit
    dot per K chunk (Had is symmetric), the signs s those of R's first row (Had's first row is all ones)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    xrow = (m // H).to(tl.int64) * stride_xt + (m % H) * D
    y = tl.zeros((BM, BC), dtype=tl.float32)
    for k0 in tl.static_range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + xrow[:, None] + k[None, :], mask=(m < M)[:, None], other=0.0)
        x = tl.where((tl.load(r_ptr + k) < 0.0)[None, :], -x, x)
        h = tl.load(h_ptr + k[:, None] * D + c[None, :])
        y = tl.dot(x, h, y)
    tl.store(y_ptr + m[:, None].to(tl.int64) * D + c[None, :], y * scale, mask=(m < M)[:, None])


def rotate_rows(x: torch.Tensor, rot: torch.Tensor, hadamard: bool = False) -> torch.Tensor:
    """R x for every row of x [T, H, d] or [T, d] (any float dtype), float32 of x's shape: the Triton
    kernel on CUDA tensors, the torch reference on others. `hadamard`: R is one randomized Hadamard
    block (`kvquant.rotation.Rotation` at a power-of-two d), which 16-bit rows rotate by 16-bit dots."""
    if x.device.type != "cuda":
        _check(x, rot)
        return rotate_rows_reference(x, rot).contiguous()
    return rotate_rows_kernel(x, rot, hadamard)


def _check(x: torch.Tensor, rot: torch.Tensor) -> None:
    d = x.shape[-1]
    if rot.shape != (d, d) or rot.dtype != torch.float32 or not rot.is_contiguous():
        raise ValueError(f"rot must be a contiguous float32 [{d}, {d}] matrix, got {tuple(rot.shape)} {rot.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [tokens, heads, d] or [tokens, d], got {tuple(x.shape)}")


def rotate_rows_kernel(x: torch.Tensor, rot: torch.Tensor, hadamard: bool = False) -> torch.Tensor:
    """`rotate_rows_reference` in one launch: x [T, H, d] or [T, d] (any float dtype; a strided token
    dim is read in place, heads and dims must be packed), rot R [d, d] float32 contiguous; returns
    float32 of x's shape, contiguous. `hadamard` as in `rotate_rows` (not under the interpreter, whose
    16-bit dots are wrong)."""
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
    from tqserve.attention.paged import _interpreting  # (paged imports this module)

    if hadamard and hadamard16(d, x.dtype) and not _interpreting():
        htab = hadamard_table(d, x.dtype, x.device)
        _hadamard_kernel[grid](
            x, rot, htab, y, m, x.stride(0), d**-0.5, H=heads, D=d, BK=min(d, BLOCK_K), BM=bm, BC=bc, num_warps=warps
        )
        return y
    prec = "ieee" if f32 else "tf32x3"  # 16-bit rows are exact in tf32: R's hi / lo split carries it
    _rotate_kernel[grid](
        x, rot, y, m, x.stride(0), H=heads, D=d, DP=dp, BK=min(dp, BLOCK_K), BM=bm, BC=bc, PREC=prec, num_warps=warps
    )
    return y
