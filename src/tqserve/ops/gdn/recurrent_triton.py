"""Triton decode step of Gated DeltaNet: conv update + fused gating / L2-norm / delta-rule update, reading
and writing the StatePool in place through per-request slot indices.

One token per request (decode): row b of the inputs belongs to request b, whose states live at
`slots[b]`. Slot 0 (null, padding rows of a captured batch) is skipped: its output is zero and no
state is touched. A request whose `seq_lens[b] == 1` has no context: it starts from zero state
whatever the slot holds (decided in-kernel, no host sync). Shapes are static, nothing is allocated
that depends on the data, so the two launches are CUDA-graph capturable once compiled.

Reference: ops/gdn/reference.py (`causal_conv1d`, `recurrent_gated_delta_rule`, `gdn_gates`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [B, D] (row stride stride_x)
    stride_x,
    w_ptr,  # [D, K]
    state_ptr,  # [S, D, K] fp32
    stride_state,
    slots_ptr,  # [B] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, D]
    D,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = offs < D
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot <= 0:
        tl.store(out_ptr + b * D + offs, tl.zeros([BLOCK_D], dtype=tl.float32), mask=m_d)
        return
    has_ctx = tl.load(seq_lens_ptr + b) > 1
    cols = tl.arange(0, KP)
    base = state_ptr + slot * stride_state + offs[:, None] * K
    # Shift the window left by one: new column j is old column j + 1; the last one is this token.
    prev = tl.load(base + cols[None, :] + 1, mask=m_d[:, None] & (cols[None, :] + 1 < K), other=0.0)
    prev = tl.where(has_ctx, prev, 0.0)
    x = tl.load(x_ptr + b * stride_x + offs, mask=m_d, other=0.0).to(tl.float32)
    window = tl.where(cols[None, :] == K - 1, x[:, None], prev)
    w = tl.load(
        w_ptr + offs[:, None] * K + cols[None, :],
        mask=m_d[:, None] & (cols[None, :] < K),
        other=0.0,
    )
    acc = tl.sum(window * w.to(tl.float32), axis=1)
    acc = acc * tl.sigmoid(acc)  # SiLU
    tl.store(base + cols[None, :], window, mask=m_d[:, None] & (cols[None, :] < K))
    tl.store(out_ptr + b * D + offs, acc.to(out_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _recurrent_update_kernel(
    qkv_ptr,  # [B, D]: conv output, columns [q heads | k heads | v heads]
    a_ptr,  # [B, HV] (row stride stride_ab)
    b_ptr,
    stride_ab,
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    ssm_ptr,  # [S, HV, DK, DV] fp32
    stride_ssm,
    slots_ptr,
    seq_lens_ptr,
    o_ptr,  # [B, HV, DV] fp32
    scale,
    D,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    m_v = vv < DV
    o_row = o_ptr + (b * HV + hv) * DV
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot <= 0:
        tl.store(o_row + vv, tl.zeros([BV], dtype=tl.float32), mask=m_v)
        return
    has_ctx = tl.load(seq_lens_ptr + b) > 1
    hk = hv // (HV // HK)
    kk = tl.arange(0, BK)
    m_k = kk < DK
    row = qkv_ptr + b * D
    q = tl.load(row + hk * DK + kk, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(row + HK * DK + hk * DK + kk, mask=m_k, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * HK * DK + hv * DV + vv, mask=m_v, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    # Gates: g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus threshold 20), beta = sigmoid(b).
    x = tl.load(a_ptr + b * stride_ab + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    g = -tl.exp(tl.load(A_log_ptr + hv).to(tl.float32)) * softplus
    beta = tl.sigmoid(tl.load(b_ptr + b * stride_ab + hv).to(tl.float32))
    p_s = ssm_ptr + slot * stride_ssm + hv * DK * DV + kk[:, None] * DV + vv[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    s = tl.where(has_ctx, tl.load(p_s, mask=m_s, other=0.0), 0.0)
    s = s * tl.exp(g)
    delta = beta * (v - tl.sum(k[:, None] * s, axis=0))
    s = s + k[:, None] * delta[None, :]
    tl.store(p_s, s, mask=m_s)
    tl.store(o_row + vv, tl.sum(q[:, None] * s, axis=0), mask=m_v)


def conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """x: [B, D] (rows may be strided); weight [D, K]; conv_pool [S, D, K] fp32. Returns SiLU(conv) [B, D]."""
    bsz, d = x.shape
    k = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_pool.is_contiguous()
    out = torch.empty(bsz, d, dtype=x.dtype, device=x.device)
    block_d = 128
    _conv_update_kernel[(bsz, triton.cdiv(d, block_d))](
        x, x.stride(0), weight, conv_pool, conv_pool.stride(0), slots, seq_lens, out, d,
        K=k, KP=triton.next_power_of_2(k), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def recurrent_update(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """qkv: [B, D] contiguous conv output; a, b: [B, Hv] (same row stride); ssm_pool [S, Hv, dk, dv] fp32.
    Returns the core output [B, Hv, dv] fp32."""
    hk, dk, hv, dv = dims
    bsz, d = qkv.shape
    assert qkv.is_contiguous() and ssm_pool.is_contiguous() and a.stride(1) == 1 and a.stride() == b.stride()
    out = torch.empty(bsz, hv, dv, dtype=torch.float32, device=qkv.device)
    bv = min(32, triton.next_power_of_2(dv))
    _recurrent_update_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        qkv, a, b, a.stride(0), A_log, dt_bias, ssm_pool, ssm_pool.stride(0), slots, seq_lens, out,
        dk**-0.5, d, HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
    )  # fmt: skip
    return out


def gdn_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """One decode token per row: conv update then recurrent update. Returns [B, Hv, dv] fp32."""
    x = conv_update(mixed_qkv, conv_weight, conv_pool, slots, seq_lens)
    return recurrent_update(x, a, b, A_log, dt_bias, ssm_pool, slots, seq_lens, dims)
