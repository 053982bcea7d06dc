"""Randomized Hadamard rotation: y = H (s * x) / sqrt(n) per power-of-two block.

A head size that is not a power of two is split into power-of-two blocks, largest first
(80 = 64 + 16, 96 = 64 + 32), and each block is rotated on its own, so the rotation stays
orthogonal and costs d log d. The signs come from a seeded generator, a different seed per
layer, so every engine, kernel and test rebuilds the same rotation from (layer_idx, seed).

Ordering is Sylvester's natural order: H[i, j] = (-1) ** popcount(i & j); the kernels use the
dense matrix from `Rotation.matrix` or the same butterfly.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

DEFAULT_SEED = 0x7155  # base seed of the sign vectors; the layer index is mixed in


def hadamard_blocks(d: int) -> list[int]:
    """Power-of-two block sizes that add up to d, largest first (binary decomposition)."""
    if d <= 0:
        raise ValueError(f"head_dim must be positive, got {d}")
    return [1 << i for i in reversed(range(d.bit_length())) if d >> i & 1]


def layer_seed(layer_idx: int, seed: int = DEFAULT_SEED) -> int:
    # A large odd multiplier keeps neighbouring layers' generators far apart.
    return (seed * 1_000_003 + layer_idx * 7_919 + 1) % (2**62)


def sign_vector(d: int, layer_idx: int, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """The +-1 signs s [d] (float32, CPU) of one layer's rotation."""
    gen = torch.Generator().manual_seed(layer_seed(layer_idx, seed))
    return torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two size, got {n}")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    if n == 1:
        return y.clone().reshape(*lead, n)
    # Two buffers taken in turn (x itself is never written): each stage writes its sums and differences in
    # place of a stack of two temporaries, the same operations in the same order, so the same bits.
    bufs = (torch.empty_like(y), torch.empty_like(y))
    h, stage = 1, 0
    while h < n:
        # Pair element i with i + h inside every 2h-long group: (a, b) -> (a + b, a - b).
        src = y.view(-1, n // (2 * h), 2, h)
        dst = bufs[stage % 2].view(-1, n // (2 * h), 2, h)
        torch.add(src[:, :, 0], src[:, :, 1], out=dst[:, :, 0])
        torch.sub(src[:, :, 0], src[:, :, 1], out=dst[:, :, 1])
        y = bufs[stage % 2]
        h, stage = 2 * h, stage + 1
    return y.reshape(*lead, n)


def _blockwise(x: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    if len(blocks) == 1:
        return fwht(x) / math.sqrt(blocks[0])
    parts = torch.split(x, blocks, dim=-1)
    return torch.cat([fwht(p) / math.sqrt(n) for p, n in zip(parts, blocks)], dim=-1)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """y = R x over the last dim: per block H (s * x) / sqrt(n)."""
    return _blockwise(x * signs.to(x.dtype), hadamard_blocks(x.shape[-1]))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x = R^T y: H is symmetric and H H = n I, so the inverse is s * H y / sqrt(n)."""
    return _blockwise(y, hadamard_blocks(y.shape[-1])) * signs.to(y.dtype)


@lru_cache(maxsize=256)
def _dense(d: int, layer_idx: int, seed: int) -> torch.Tensor:
    signs = sign_vector(d, layer_idx, seed)
    return rotate(torch.eye(d), signs).T.contiguous()  # column j = R e_j


class Rotation:
    """One layer's rotation. `matrix` is R [d, d] with y = R x (for row vectors: y = x @ R.T)."""

    def __init__(self, head_dim: int, layer_idx: int, seed: int = DEFAULT_SEED) -> None:
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.seed = seed
        self.blocks = hadamard_blocks(head_dim)
        self.signs = sign_vector(head_dim, layer_idx, seed)

    @property
    def matrix(self) -> torch.Tensor:
        return _dense(self.head_dim, self.layer_idx, self.seed).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.signs.to(x.device))

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return unrotate(y, self.signs.to(y.device))
