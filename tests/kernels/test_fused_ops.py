"""One-launch elementwise kernels (ops/rms_norm, ops/rope, ops/silu_mul) against the layers' torch
expressions, on strided views as the model hands them over. CPU: TRITON_INTERPRET=1, tiny shapes;
GPU: real model sizes and the layers' dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEV, INTERP, triton_kernels

from tqserve import ops
from tqserve.layers.norm import RMSNorm
from tqserve.layers.rotary import RotaryEmbedding
from tqserve.ops.rms_norm import rms_norm
from tqserve.ops.rope import rope_qk
from tqserve.ops.silu_mul import silu_mul

pytestmark = triton_kernels
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _tol(dtype: torch.dtype, casts: int = 1) -> float:
    """Rounding steps allowed: one per rounding to a 16-bit dtype (`casts`), as the float32 math
    differs from torch's in summation order, rsqrt and exp by a few float32 ulps, which may tip a
    rounding; the CPU interpreter truncates float32 -> bfloat16 (about half of all values land a
    step off), so there every bfloat16 cast may add one more. float32 outputs: those few ulps."""
    if dtype == torch.float32:
        return 16.0
    return casts * (2 if INTERP and dtype == torch.bfloat16 else 1) + 1e-6


def _steps(a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor | None = None) -> float:
    """Largest |a - b| in units of the dtype's rounding step at a's magnitude, or at `magnitude`
    where a result is a difference of larger terms (0: identical)."""
    eps = torch.finfo(a.dtype).eps
    mag = a.float().abs() if magnitude is None else magnitude.float()
    scale = mag.clamp_min(torch.finfo(a.dtype).tiny) * eps
    return ((a.float() - b.float()).abs() / scale).max().item()


def _reference_norm(norm: RMSNorm, x, residual=None):
    saved, ops.FUSED = ops.FUSED, False
    try:
        return norm(x.cpu(), None if residual is None else residual.cpu())
    finally:
        ops.FUSED = saved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 80, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, h, with_residual):
    gen = torch.Generator().manual_seed(h)
    norm = RMSNorm(h, 1e-5, dtype=dtype)
    norm.weight.data.copy_(torch.randn(h, generator=gen) * 0.5 + 1.0)
    big = torch.randn(9, 3 * h, generator=gen) * 3.0
    x = big[:, h : 2 * h].to(dtype)  # a strided view, as the model's projections hand them over
    residual = (torch.randn(9, h, generator=gen) * 2.0).to(dtype) if with_residual else None
    got = rms_norm(x.to(DEV), norm.weight.to(DEV), norm.eps, None if residual is None else residual.to(DEV))
    want = _reference_norm(norm, x, residual)
    if with_residual:
        if INTERP and dtype == torch.bfloat16:
            assert _steps(want[1], got[1]) <= 1.0 + 1e-6
        else:
            assert torch.equal(got[1].cpu(), want[1]), "the residual sum must round as the reference's add"
        got, want = got[0], want[0]
    # only the mean's summation order differs: at most one rounding step of the output dtype
    assert _steps(want, got.cpu()) <= _tol(dtype, 2)


def test_rms_norm_heads_and_batch_invariance():
    """[T, H, d] views (Qwen3's per-head q / k norm) and one token's row alone or in a batch."""
    gen = torch.Generator().manual_seed(5)
    d, heads = 64, 3
    norm = RMSNorm(d, 1e-6, dtype=torch.bfloat16)
    norm.weight.data.copy_(torch.rand(d, generator=gen) + 0.5)
    qkv = (torch.randn(11, (heads + 2) * d, generator=gen) * 2).to(torch.bfloat16)
    q = qkv[:, : heads * d].view(11, heads, d)
    got = rms_norm(q.to(DEV), norm.weight.to(DEV), norm.eps).cpu()
    assert _steps(_reference_norm(norm, q), got) <= _tol(torch.bfloat16, 2)
    one = rms_norm(q[4:5].to(DEV), norm.weight.to(DEV), norm.eps).cpu()
    assert torch.equal(one[0], got[4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rotary_dim", [(64, 64), (64, 32), (128, 128)])
def test_rope_matches_reference(dtype, d, rotary_dim):
    gen = torch.Generator().manual_seed(d + rotary_dim)
    hq, hkv, t = 5, 2, 7
    rope = RotaryEmbedding(d, 4096, 10000.0, rotary_dim=rotary_dim)
    positions = torch.randint(0, 4096, (t,), generator=gen)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    cos, sin = rope.table(positions)
    want_q, want_k = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)
    got_q, got_k = rope_qk(q.to(DEV), k.to(DEV), cos.to(DEV), sin.to(DEV), rotary_dim)
    for x, want, got in ((q, want_q, got_q.cpu()), (k, want_k, got_k.cpu())):
        # the products may fuse into an fma: a float32 rounding of the pair's magnitude apart (an
        # output near zero is a difference of two larger products), then one cast
        half = rotary_dim // 2
        pair = x[..., :half].float().hypot(x[..., half:rotary_dim].float())
        assert _steps(want[..., :rotary_dim], got[..., :rotary_dim], pair.repeat(1, 1, 2)) <= _tol(dtype)
        assert torch.equal(want[..., rotary_dim:], got[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1536])
def test_silu_mul_matches_reference(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(6, 2 * inter + 8, generator=gen) * 3).to(dtype)[:, : 2 * inter]  # strided rows
    gate, up = x.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = silu_mul(x.to(DEV)).cpu()
    assert _steps(want, got) <= _tol(dtype, 2)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul(torch.zeros(2, 7, device=DEV))
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_qk(torch.zeros(1, 2, 64, device=DEV), torch.zeros(1, 1, 64, device=DEV), None, None, 48)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(torch.zeros(2, 8, device=DEV), torch.ones(8, device=DEV), 1e-6, torch.zeros(3, 8, device=DEV))


@pytest.mark.gpu
def test_layers_dispatch_to_the_kernels_on_cuda(monkeypatch):
    """The layers call the kernels on CUDA tensors (and the torch expressions with ops.FUSED off); both
    agree to one rounding step at SmolLM2's sizes."""
    calls = []
    from tqserve.ops import rms_norm as norm_mod
    from tqserve.ops import rope as rope_mod

    monkeypatch.setattr(norm_mod, "rms_norm", lambda *a: calls.append("norm") or rms_norm(*a))
    monkeypatch.setattr(rope_mod, "rope_qk", lambda *a: calls.append("rope") or rope_qk(*a))
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5, dtype=torch.bfloat16).cuda()
    x = (torch.randn(64, 576, generator=gen)).to("cuda", torch.bfloat16)
    rope = RotaryEmbedding(64, 8192, 100000.0).cuda()
    pos = torch.randint(0, 8192, (64,), generator=gen).cuda()
    q = torch.randn(64, 9, 64, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(64, 3, 64, generator=gen).to("cuda", torch.bfloat16)
    fused_out = (norm(x), *rope(pos, q, k))
    assert calls == ["norm", "rope"]
    monkeypatch.setattr(ops, "FUSED", False)
    plain = (norm(x), *rope(pos, q, k))
    assert calls == ["norm", "rope"]
    for a, b in zip(plain, fused_out):
        assert _steps(a, b) <= 1.0 + 1e-6
