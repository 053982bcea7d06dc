"""Lloyd-Max scalar codebooks for the rotated coordinates.

After a random rotation each coordinate of a unit vector is close to N(0, 1/d), so one codebook
for N(0, 1), scaled by 1/sqrt(d), serves every head size (what TurboQuant and vLLM use). The exact
marginal of one coordinate of a uniform unit vector, scaled by sqrt(d), has density proportional
to (1 - t^2/d)^((d-3)/2); `sphere_codebook(bits, d)` solves for it too (slightly narrower tails).

Everything is computed in float64 torch once and cached; callers get copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

SQRT2 = math.sqrt(2.0)
INV_SQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class Codebook:
    """2^b centroids (ascending) and the 2^b - 1 decision boundaries (midpoints), unit variance."""

    bits: int
    centroids: torch.Tensor  # [2^b] float64
    boundaries: torch.Tensor  # [2^b - 1] float64
    distortion: float  # E (t - c(t))^2 for t of unit variance = E ||u - u_hat||^2 per unit vector

    def scaled(self, head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(centroids, boundaries) for coordinates of a unit vector in head_dim dimensions."""
        s = 1.0 / math.sqrt(head_dim)
        return (self.centroids * s).to(dtype), (self.boundaries * s).to(dtype)


def _phi(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * INV_SQRT2PI


def _cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x / SQRT2))


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"codebook bits must be in 1..8, got {bits}")


@lru_cache(maxsize=16)
def _gaussian(bits: int) -> Codebook:
    _check_bits(bits)
    levels = 1 << bits
    # Start from the cell midpoints in probability (quantiles), then alternate the two Lloyd-Max
    # conditions: boundaries at midpoints, centroids at the conditional means of their cells.
    p = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = SQRT2 * torch.erfinv(2 * p - 1)
    inf = torch.full((1,), math.inf, dtype=torch.float64)
    for _ in range(20_000):
        b = 0.5 * (c[1:] + c[:-1])
        edges = torch.cat((-inf, b, inf))
        lo, hi = edges[:-1], edges[1:]
        mass = _cdf(hi) - _cdf(lo)
        new = (_phi(lo) - _phi(hi)) / mass
        if (new - c).abs().max() < 1e-11:
            c = new
            break
        c = new
    b = 0.5 * (c[1:] + c[:-1])
    edges = torch.cat((-inf, b, inf))
    mass = _cdf(edges[1:]) - _cdf(edges[:-1])
    # With conditional-mean centroids, E (t - c)^2 = E t^2 - E c^2 = 1 - sum p_i c_i^2.
    distortion = float(1.0 - (mass * c * c).sum())
    return Codebook(bits, c, b, distortion)


def gaussian_codebook(bits: int) -> Codebook:
    """Lloyd-Max codebook for N(0, 1) with `bits` bits (1..8)."""
    cb = _gaussian(bits)
    return Codebook(cb.bits, cb.centroids.clone(), cb.boundaries.clone(), cb.distortion)


def _sphere_grid(d: int, points: int = 200_001) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid and normalized weights of t = sqrt(d) * u_1 for u uniform on the sphere S^(d-1)."""
    r = math.sqrt(d)
    t = torch.linspace(-r, r, points, dtype=torch.float64)[1:-1]
    logw = 0.5 * (d - 3) * torch.log1p(-(t * t) / d)
    w = torch.exp(logw - logw.max())
    return t, w / w.sum()


@lru_cache(maxsize=32)
def _sphere(bits: int, d: int) -> Codebook:
    _check_bits(bits)
    if d < 3:
        raise ValueError("the sphere marginal needs d >= 3")
    t, w = _sphere_grid(d)
    c = _gaussian(bits).centroids.clone()
    levels = 1 << bits
    for _ in range(5_000):
        b = 0.5 * (c[1:] + c[:-1])
        cell = torch.bucketize(t, b)
        mass = torch.zeros(levels, dtype=torch.float64).scatter_add_(0, cell, w)
        first = torch.zeros(levels, dtype=torch.float64).scatter_add_(0, cell, w * t)
        new = first / mass.clamp_min(1e-300)
        if (new - c).abs().max() < 1e-12:
            c = new
            break
        c = new
    b = 0.5 * (c[1:] + c[:-1])
    err = t - c[torch.bucketize(t, b)]
    return Codebook(bits, c, b, float((w * err * err).sum() / (w * t * t).sum()))


def sphere_codebook(bits: int, d: int) -> Codebook:
    """Lloyd-Max codebook for the exact coordinate marginal of a unit vector in d dims (x sqrt(d))."""
    cb = _sphere(bits, d)
    return Codebook(cb.bits, cb.centroids.clone(), cb.boundaries.clone(), cb.distortion)


@lru_cache(maxsize=64)
def expected_sphere_distortion(bits: int, d: int) -> float:
    """E ||u - u_hat||^2 for u uniform on S^(d-1) quantized with the N(0, 1) codebook scaled 1/sqrt(d):
    the theory a codec using `gaussian_codebook` must match at head size d."""
    t, w = _sphere_grid(d)
    cb = _gaussian(bits)
    err = t - cb.centroids[torch.bucketize(t, cb.boundaries)]
    return float((w * err * err).sum() / (w * t * t).sum())


# ---- the codec's codebooks: Lloyd-Max on a grid of int8 half-steps ------------------------------------

# Bit widths whose codec codebook lies on the grid (x + 1/2) * step, x an int8 (`grid_codebook`): the narrow
# decode kernel then reads keys as int8 centroid numbers (four per byte permute) and scores them with integer
# tensor-core dots against a 15-bit fixed-point query, exactly (`attention/paged_decode_narrow.py`, KI8). 4 bits
# only, where a kernel reads the grid: at 3 bits it moved turboquant_3bit_nc's perplexity on one 2K window of
# SmolLM2 from +34.4% to +37.0% (CPU, float32; 4-bit presets moved within noise, docs/kv-quality.md).
GRID_BITS = (4,)
GRID_MAX = 127  # the largest x: the top centroid is (127 + 1/2) step at most


def _gauss_cell_moments(edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mass, first moment, second moment) of N(0, 1) over the cells between consecutive edges."""
    lo, hi = edges[:-1], edges[1:]
    phi_lo = torch.where(torch.isinf(lo), torch.zeros_like(lo), _phi(lo))
    phi_hi = torch.where(torch.isinf(hi), torch.zeros_like(hi), _phi(hi))
    mass = _cdf(hi) - _cdf(lo)
    first = phi_lo - phi_hi
    lo_t = torch.where(torch.isinf(lo), torch.zeros_like(lo), lo * phi_lo)
    hi_t = torch.where(torch.isinf(hi), torch.zeros_like(hi), hi * phi_hi)
    return mass, first, mass + lo_t - hi_t


def _grid_solve(bits: int, step: float) -> tuple[torch.Tensor, float]:
    """Lloyd-Max with every centroid on (x + 1/2) step: boundaries at midpoints, each centroid the grid point
    nearest its cell's conditional mean (optimal for the cell), until nothing moves. Symmetric by
    construction (x_i = -1 - x_(L-1-i)). Returns (x int64 [2^b], distortion)."""
    c = _gaussian(bits).centroids.clone()
    inf = torch.full((1,), math.inf, dtype=torch.float64)
    x = torch.round(c / step - 0.5)
    for _ in range(200):
        v = (x + 0.5) * step
        edges = torch.cat((-inf, 0.5 * (v[1:] + v[:-1]), inf))
        mass, first, _ = _gauss_cell_moments(edges)
        new = torch.round(first / mass / step - 0.5)
        half = new.numel() // 2
        new = torch.cat((-1.0 - new[half:].flip(0), new[half:]))  # keep the exact symmetry
        if torch.equal(new, x):
            break
        x = new
    v = (x + 0.5) * step
    edges = torch.cat((-inf, 0.5 * (v[1:] + v[:-1]), inf))
    mass, first, second = _gauss_cell_moments(edges)
    distortion = float((second - 2 * v * first + v * v * mass).sum())
    return x.long(), distortion


@lru_cache(maxsize=8)
def _grid(bits: int) -> tuple[tuple[int, ...], float, float]:
    _check_bits(bits)
    top = float(_gaussian(bits).centroids[-1])
    best = None
    # the finest step that keeps x within int8 is near top / 127.5; a slightly coarser one can round better
    for i in range(400):
        step = top / (GRID_MAX + 0.5) * (1.0 + i / 2000)
        x, dist = _grid_solve(bits, step)
        if int(x.max()) > GRID_MAX or int(x.min()) < -GRID_MAX - 1:
            continue
        if best is None or dist < best[2] - 1e-15:
            best = (tuple(int(v) for v in x), step, dist)
    assert best is not None
    return best


def grid_codebook(bits: int) -> tuple[Codebook, torch.Tensor, float]:
    """(codebook, x int64 [2^b], step) of the Lloyd-Max quantizer for N(0, 1) whose centroids are (x + 1/2) step
    with int8 x (ascending; symmetric: x_i = ~x_(2^b - 1 - i)). Its distortion is within 0.05% of the free
    optimum's at 3 and 4 bits (the grid's half-step is ~0.011 of the unit variance)."""
    xs, step, dist = _grid(bits)
    x = torch.tensor(xs, dtype=torch.int64)
    c = (x.double() + 0.5) * step
    return Codebook(bits, c, 0.5 * (c[1:] + c[:-1]), dist), x, step
