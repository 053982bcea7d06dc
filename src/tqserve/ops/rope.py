"""Rotary embedding of q and k in one launch (GPU), NeoX / HF "rotate half" layout.

`layers.rotary.RotaryEmbedding._rotate` is the reference (and what CPU tensors take): per call and
tensor a cast, a concatenation, two multiplies, an add, a cast and, with partial rotary, another
concatenation - about a dozen launches per layer for q and k. Here one program per (token, block of
heads) reads the token's cos / sin once from the step's table (`RotaryEmbedding.table`, computed
once per step) and writes [x1 cos - x2 sin, x2 cos + x1 sin] in float32, rounded to the model dtype,
and the coordinates past rotary_dim unchanged. The products may fuse into an fma, so a value can
differ from the reference in the last bit of float32 (never more than one model-dtype step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BH: tl.constexpr,
    HALF: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Heads [h0, h0 + BH) of token t over q's HQ heads then k's HKV; outputs packed [T, H, D]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    is_q = h < HQ
    live = h < HQ + HKV
    hk = tl.where(is_q, 0, h - HQ)
    src = tl.where(is_q, q_ptr + t * stride_qt + h * stride_qh, k_ptr + t * stride_kt + hk * stride_kh)
    dst = tl.where(is_q, qo_ptr + (t * HQ + h) * D, ko_ptr + (t * HKV + hk) * D)
    j = tl.arange(0, HALF)  # RD / 2, a power of two (the launcher checks)
    m = live[:, None] & (j < RD // 2)[None, :]
    # the table holds [cos, cos] and [-sin, sin] over RD: the first half of cos, the second of sin
    c = tl.load(cos_ptr + t * stride_ct + j)[None, :]
    s = tl.load(sin_ptr + t * stride_ct + RD // 2 + j)[None, :]
    x1 = tl.load(src[:, None] + j[None, :], mask=m, other=0.0)
    x2 = tl.load(src[:, None] + RD // 2 + j[None, :], mask=m, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst[:, None] + j[None, :], (a * c - b * s).to(x1.dtype), mask=m)
    tl.store(dst[:, None] + RD // 2 + j[None, :], (b * c + a * s).to(x1.dtype), mask=m)
    if RD < D:  # partial rotary: the other coordinates pass through
        e = RD + tl.arange(0, BD)
        me = live[:, None] & (e < D)[None, :]
        tl.store(dst[:, None] + e[None, :], tl.load(src[:, None] + e[None, :], mask=me), mask=me)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RoPE(q), RoPE(k)) for q [T, Hq, D], k [T, Hkv, D] (last dim contiguous, any token / head
    strides) with the step's table (cos, sin), each [T, 1, rotary_dim] float32 as
    `RotaryEmbedding.table` gives them. Outputs are packed, in q's / k's dtype."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != T or k.shape[2] != d or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not match")
    half = rotary_dim // 2
    if rotary_dim % 2 or half & (half - 1) or rotary_dim > d:
        raise ValueError(f"rotary_dim must be an even power of two <= head_dim, got {rotary_dim} of {d}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos, sin = cos.reshape(T, rotary_dim), sin.reshape(T, rotary_dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((T, hq, d), device=q.device, dtype=q.dtype)
    ko = torch.empty((T, hkv, d), device=k.device, dtype=k.dtype)
    if T == 0:
        return qo, ko
    bh = min(16, triton.next_power_of_2(hq + hkv))
    _rope_kernel[(T, triton.cdiv(hq + hkv, bh))](
        q, k, qo, ko, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HQ=hq, HKV=hkv, D=d, RD=rotary_dim, BH=bh, HALF=half, BD=triton.next_power_of_2(max(1, d - rotary_dim)),
    )  # fmt: skip
    return qo, ko
