"""Pure-torch encode / decode of one K or V vector per token and KV head: the ground truth the
GPU store and attention kernels must reproduce bit for bit (indices) and to rounding (floats).

Every function works on x [..., d] and treats each row (one token, one KV head) on its own.

TurboQuant MSE (`tq_encode`): n = ||x||, u = x / n, y = R u, idx_j = #{boundaries < y_j} over the
Lloyd-Max N(0,1) boundaries scaled 1/sqrt(d); decode x_hat = scale * R^T c[idx] with c the
centroids scaled 1/sqrt(d). y is computed in fixed point so that any summation order gives it bit
for bit (`tq_rotate`): the row is scaled by the power of two that puts its largest |x| below
2^FIX_BITS and rounded to integers xi (half a unit is 2^-12 of the row's max; its error is below
1e-5 of ||x||^2 unless one coordinate is 20x the row's rms, ~1e-3 of the 4-bit codec's error), the
Hadamard sums of xi (<= 2^19) and ||xi||^2 (<= 2^30) are exact integers, and y = z / sqrt(block *
||xi||^2) takes a fixed sequence of IEEE float32 operations. The scales' sums (||c||^2, <y, c>) add
terms rounded to multiples of 2^-SCALE_QS, exact integers too. The GPU store kernel forms the same
integers on tensor cores (one fp16 dot: xi and +-1 are exact in fp16), so both write the same bytes.
The stored fp16 scale depends on the scale mode:
  plain     scale = n                       (MSE-only; shrinks <x, x_hat> by about 1 - D)
  nc        scale = n / ||c[idx]||          (vLLM's norm correction: ||x_hat|| = ||x||)
  unbiased  scale = n / <y, c[idx]>         (tqserve: <x, x_hat> = ||x||^2 exactly, so scores with
                                             queries along x are not shrunk)
Gain search (`search=True`, preset modes `ubs` / `ncs`): the decoder is unchanged (scale * c[idx])
but the encoder picks idx = nearest centroids of s * y for the s in `SEARCH_GAINS` that maximizes
cos(y, c[idx]) (s = 1, the plain nearest-centroid indices, wins ties), then stores the scale of the
mode for those indices. Every scale mode's error is a decreasing function of that cosine
(nc: 2 (1 - cos), unbiased: 1/cos^2 - 1), so the search never does worse than plain indices; on
random unit vectors at d = 64 it cuts the error by about 2 / 10 / 21 / 28% at 2 / 3 / 4 / 5 bits.
The Triton store kernel implements the same search (indices equal except at float-rounding ties).
fp8 with scale: scale = amax / 448 (fp16), q = e4m3(x / scale). fp8 cast: q = e4m3(clamp(x)).
Min-max (vLLM's values): zero = min, scale = (max - min) / (2^b - 1), both fp16,
idx = floor((x - zero) / scale + 0.5) clamped to [0, 2^b - 1]; decode zero + idx * scale.
Scales are rounded to fp16 *before* quantizing, so the encoder sees what the decoder will use.
Stored TurboQuant codes: the encoder's indices are sorted (idx = #{boundaries < y}); 4-bit pages store
them sign-magnitude (`SIGN_MAGNITUDE_BITS`, `to_codes`): code 8 + r is the r-th positive centroid and
code r the r-th negative one by magnitude, so a decoder of the symmetric codebook looks the magnitude up
in one 8-entry table by bits 0-2 and takes the sign from bit 3. Every decoder reads `tq_code_table`.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from tqserve.kvquant.codebooks import GRID_BITS, gaussian_codebook, grid_codebook
from tqserve.kvquant.packing import pack_bits, unpack_bits
from tqserve.kvquant.rotation import Rotation, fwht

FP8_MAX = 448.0
FP16_MAX = 65504.0
FP8_DTYPE = torch.float8_e4m3fn
SCALE_MODES = ("plain", "nc", "unbiased")
# Fixed point of `tq_rotate`: |xi| <= 2^11 (exact in fp16), so a 64-column tile sums to <= 2^17 and a
# Hadamard block of up to 256 to <= 2^19 (exact in float32), ||xi||^2 <= 2^30. FIX_BIAS - e is the
# float32 exponent field of p = 2^k (k = FIX_BIAS - 127 - e); FIX_MIN_EXP: rows whose max |x| is below
# 2^-99 count as zero (keeps p a normal float32).
FIX_BITS = 11
FIX_BIAS = 127 + FIX_BITS + 126
FIX_MIN_EXP = 28
# The scales' sums add round(term * 2^SCALE_QS): each term is below 2^22 there (|c| < 1.4, |y| <= 1.01),
# so the kernel rounds it with one float32 fma against 1.5 * 2^23, and a sum of <= 256 is an int32.
SCALE_QS = 21
# Gains tried by the search encoder: 1 first (ties keep the plain indices), then 0.75..1.35 in 1/80 steps.
SEARCH_GAINS = (1.0,) + tuple(round(0.75 + i / 80, 6) for i in range(49) if i != 20)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def _div(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d rounded as IEEE division, on every device: torch's CUDA division by a Python number
    multiplies by its rounded reciprocal, one ulp off now and then (seen to move an fp16 min-max
    scale by one step on the H100), where the kernels divide exactly."""
    return x / torch.full_like(x, d)


def tq_codebook(bits: int, head_dim: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [2^b], boundaries [2^b - 1]) float32 for unit vectors of size head_dim: Lloyd-Max for
    N(0, 1) scaled by 1 / sqrt(head_dim), on the int8 half-step grid at GRID_BITS (`grid_codebook`)."""
    cb = grid_codebook(bits)[0] if bits in GRID_BITS else gaussian_codebook(bits)
    c, b = cb.scaled(head_dim)
    return c.to(device), b.to(device)


# Code widths whose pages hold sign-magnitude codes (module docstring). Only the 4-bit codebook is on the
# int8 grid, whose decoder this serves (paged_decode_narrow.i8_keys_ptx: one table of 8 magnitudes, 9
# integer instructions per 8 codes where sorted codes took 11 and two tables).
SIGN_MAGNITUDE_BITS = (4,)


def code_order(bits: int) -> list[int]:
    """perm[i] = the stored code of sorted index i. An involution (perm[perm[i]] = i), so it also maps a
    code to its sorted index: sign-magnitude at SIGN_MAGNITUDE_BITS (i >= h: i; i < h: h - 1 - i, with h =
    2^(b - 1)), the identity at other widths."""
    n = 1 << bits
    if bits not in SIGN_MAGNITUDE_BITS:
        return list(range(n))
    h = n // 2
    return [i if i >= h else h - 1 - i for i in range(n)]


def to_codes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Sorted indices -> stored codes (`code_order`; the same map takes codes back to indices)."""
    if bits not in SIGN_MAGNITUDE_BITS:
        return idx
    h = 1 << (bits - 1)
    return torch.where(idx >= h, idx, h - 1 - idx)


@lru_cache(maxsize=64)
def _code_table(bits: int, head_dim: int) -> torch.Tensor:
    return tq_codebook(bits, head_dim)[0][code_order(bits)].contiguous()


@lru_cache(maxsize=64)
def _squared_terms(bits: int, head_dim: int) -> torch.Tensor:
    """round(c^2 2^SCALE_QS) float64 [2^b] by sorted index: `fixed_sum`'s terms of ||c||^2 (integers, so
    their sum is exact in any order)."""
    c = tq_codebook(bits, head_dim)[0].double()
    return torch.round(c * c * 2.0**SCALE_QS)


def tq_code_table(bits: int, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The centroids float32 [2^b] indexed by stored code: what every decoder of the pages looks up (a copy of
    a table built once per width and head size: the CPU reference decodes pages with it every step)."""
    return _code_table(bits, head_dim).to(device, copy=True)


def tq_int8_codes(bits: int, head_dim: int) -> tuple[list[int], float]:
    """`tq_int8_grid`'s int8 numbers indexed by stored code (the int8 key path's table), and the step."""
    x, g = tq_int8_grid(bits, head_dim)
    return [x[i] for i in code_order(bits)], g


def tq_int8_grid(bits: int, head_dim: int) -> tuple[list[int], float]:
    """(x [2^b] ints, g): the codec's centroids for unit vectors of size head_dim are (x + 1/2) g, g =
    step / sqrt(head_dim) (bits in GRID_BITS). The int8 key path of the narrow decode kernel decodes to x."""
    if bits not in GRID_BITS:
        raise ValueError(f"no int8 grid for {bits}-bit codebooks (grid widths: {GRID_BITS})")
    _, x, step = grid_codebook(bits)
    return [int(v) for v in x], step / math.sqrt(head_dim)


def tq_quantize_rotated(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Nearest-centroid indices of rotated unit vectors y [..., d] (int64)."""
    _, bounds = tq_codebook(bits, y.shape[-1], y.device)
    return torch.bucketize(y.float().contiguous(), bounds)  # = number of boundaries strictly below y


def tq_search_indices(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices of rotated unit vectors y [..., d] that maximize cos(y, c[idx]) over the gains in
    SEARCH_GAINS (idx = nearest centroids of gain * y); the first gain (1) wins ties."""
    cents, bounds = tq_codebook(bits, y.shape[-1], y.device)
    y = y.float()
    gains = torch.tensor(SEARCH_GAINS, dtype=torch.float32, device=y.device)
    cand = torch.bucketize((y.unsqueeze(-2) * gains[:, None]).contiguous(), bounds)  # [..., G, d]
    c = cents[cand]
    cos = (y.unsqueeze(-2) * c).sum(-1) / c.norm(dim=-1).clamp_min(1e-30)  # [..., G]
    best = cos.argmax(-1, keepdim=True)  # first maximum: gain 1 on ties
    return cand.gather(-2, best.unsqueeze(-1).expand(*best.shape, y.shape[-1])).squeeze(-2)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root, as IEEE and the kernels' `sqrt_rn` define it. torch's
    CPU float32 sqrt is not (one ulp off for ~19% of inputs in this build): a float64 root rounded
    to float32 is at most one ulp off, and exact float64 compares of x with the squares of the
    midpoints to its neighbours (25 significant bits, so the squares are exact) correct it."""
    x = x.float()
    s = torch.sqrt(x.double()).float()
    lo = torch.nextafter(s, torch.zeros_like(s))
    hi = torch.nextafter(s, torch.full_like(s, math.inf))
    xd, sd = x.double(), s.double()
    mlo, mhi = (sd + lo.double()) / 2, (sd + hi.double()) / 2
    return torch.where(xd < mlo * mlo, lo, torch.where(xd > mhi * mhi, hi, s))


def fixed_point(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xi int64 [..., d], p, 1 / p float32 [...]): xi = x * p rounded half to even, p = 2^k the power
    of two that puts the row's largest |x| below 2^FIX_BITS, found from its float32 exponent field e.
    Rows whose max is below 2^-99 (e < 28) get p = 0: all-zero rows, as the kernel forms them. x * p is
    exact (a power of two) wherever it is >= 1/2, so the rounding sees the same value on every device."""
    x = x.float()
    e = (x.abs().amax(-1).view(torch.int32) >> 23) & 0xFF
    live = e >= FIX_MIN_EXP
    p = torch.where(live, ((FIX_BIAS - e) << 23).view(torch.float32), 0.0)
    rp = torch.where(live, ((e - FIX_BIAS + 254) << 23).view(torch.float32), 0.0)
    return torch.round(x * p.unsqueeze(-1)).to(torch.int64), p, rp


def fixed_sum(terms: torch.Tensor) -> torch.Tensor:
    """sum(round(terms * 2^SCALE_QS)) * 2^-SCALE_QS over the last dim, float32: terms are exact float64
    products of float32 values, rounded half to even once, as the kernel's fma does; the sum is an
    integer, so its order does not show."""
    q = torch.round(terms * 2.0**SCALE_QS).sum(-1)
    return q.float() * 2.0**-SCALE_QS


def tq_rotate(x: torch.Tensor, rotation: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
    """(y = R x / ||x|| float32 [..., d], ||x|| float32 [...]) in fixed point (module docstring): the
    Hadamard sums are exact integers, then per block of size b y = float32(z) * (1 / sqrt(b * n2)) and
    ||x|| = sqrt(n2) / p, each an IEEE float32 operation (n2 = ||xi||^2, exact in float32 below 2^24
    and rounded once above)."""
    xi, _, rp = fixed_point(x)
    n2 = (xi * xi).sum(-1).float()
    # float32 holds the integers exactly: |xi| < 2^FIX_BITS, so every butterfly sum of a block of up to 2^13
    # stays below 2^24; the same values as an int64 transform, about twice as fast on a CPU
    z = xi.float() * rotation.signs.to(xi.device)
    ys, o = [], 0
    for b in rotation.blocks:
        f = torch.where(n2 > 0, 1.0 / sqrt_rn(n2 * b), 0.0)
        ys.append(fwht(z[..., o : o + b]) * f.unsqueeze(-1))
        o += b
    y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
    return y, sqrt_rn(n2) * rp


def tq_encode(
    x: torch.Tensor, rotation: Rotation, bits: int, scale_mode: str = "nc", search: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (packed codes uint8 [..., d*bits/8] (`to_codes` of the indices), scale fp16 [...])."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if search and scale_mode == "plain":
        raise ValueError("the gain search needs a scale fitted to the indices (nc or unbiased), not plain")
    y, n = tq_rotate(x, rotation)
    idx = tq_search_indices(y, bits) if search else tq_quantize_rotated(y, bits)
    if scale_mode == "plain":
        scale = n
    else:
        if scale_mode == "nc":
            # ||c[idx]||^2 as `fixed_sum` forms it: each term round(c^2 2^SCALE_QS) depends on the index only
            q = _squared_terms(bits, x.shape[-1]).to(x.device)[idx].sum(-1)
            scale = n / sqrt_rn(q.float() * 2.0**-SCALE_QS).clamp_min(1e-30)
        else:
            cents, _ = tq_codebook(bits, x.shape[-1], x.device)
            scale = n / fixed_sum(y.double() * cents[idx].double()).clamp_min(1e-30)
    return pack_bits(to_codes(idx, bits), bits), _fp16(scale)


def tq_decode_rotated(packed: torch.Tensor, scale: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """scale * c[code]: the reconstruction in the rotated space (what the kernels accumulate), float32."""
    cents = tq_code_table(bits, head_dim, packed.device)
    return cents[unpack_bits(packed, bits, head_dim)] * scale.float().unsqueeze(-1)


def tq_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    rotation: Rotation,
    bits: int,
    head_dim: int,
) -> torch.Tensor:
    return rotation.inverse(tq_decode_rotated(packed, scale, bits, head_dim))


def fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled e4m3: (q float8_e4m3fn [..., d], scale fp16 [...])."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = _fp16(_div(amax, FP8_MAX).clamp_min(2.0**-24))
    q = (x / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_decode(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(-1)


def fp8_cast(x: torch.Tensor) -> torch.Tensor:
    """Plain e4m3 cast without scale (vLLM's k8v4 keys); saturates at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def minmax_encode(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row uniform b-bit: (packed uint8 [..., d*bits/8], scale fp16 [...], zero fp16 [...])."""
    x = x.float()
    levels = (1 << bits) - 1
    lo, hi = x.amin(-1), x.amax(-1)
    zero = _fp16(lo)
    # float32 steps the store kernel takes as they are (one rounding each, no fused multiply-add):
    # the range times RN(1 / levels), the row's IEEE reciprocal of the scale and offset 0.5 - zero /
    # scale, then per element one multiply and one add; no per-element division
    scale = _fp16(((hi - zero.float()) * torch.tensor(1.0 / levels, dtype=torch.float32)).clamp_min(2.0**-24))
    inv = torch.ones_like(scale, dtype=torch.float32) / scale.float()
    off = 0.5 - zero.float() * inv
    t = x * inv.unsqueeze(-1) + off.unsqueeze(-1)
    idx = torch.floor(t).clamp(0, levels).long()
    return pack_bits(idx, bits), scale, zero


def minmax_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    head_dim: int,
) -> torch.Tensor:
    idx = unpack_bits(packed, bits, head_dim).float()
    return zero.float().unsqueeze(-1) + idx * scale.float().unsqueeze(-1)


def theory_inner_product_ratio(distortion: float, scale_mode: str) -> float:
    """Expected <x, x_hat> / ||x||^2 of tq_encode for a codebook of distortion D: with conditional-mean
    centroids <y, c> ~ ||c||^2 ~ 1 - D, so plain gives 1 - D, nc sqrt(1 - D), unbiased exactly 1."""
    return {
        "plain": 1.0 - distortion,
        "nc": math.sqrt(1.0 - distortion),
        "unbiased": 1.0,
    }[scale_mode]
