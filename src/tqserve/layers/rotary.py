"""Rotary position embedding (NeoX / HF "rotate half" layout), with default, linear, llama3 scaling
and GGUF per-frequency factors.

The cos/sin table is built once at init for every position up to max_position_embeddings and
gathered by `positions` in forward, so applying RoPE needs no host sync and no per-step allocation
that depends on the data (invariant 2).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tqserve.ops import fused


def rope_parameters(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict) from an HF config, old style (`rope_theta` + `rope_scaling`) or
    transformers v5 style (`rope_parameters`). The scaling dict always has a "rope_type"."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", 10000.0)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    return float(theta), scaling


def _inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band between them interpolated smoothly."""
    factor = scaling["factor"]
    low, high = (scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0))
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None, rotary_dim: int | None = None
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        scaling = scaling or {"rope_type": "default"}
        rope_type = scaling.get("rope_type", "default")
        inv_freq = _inv_freq(self.rotary_dim, theta)
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "freq_factors":
            # Per-frequency divisors stored in a GGUF file (llama.cpp's rope_freqs tensor, which is
            # how Llama 3.1+ GGUFs carry their llama3 scaling).
            inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
        elif rope_type != "default":
            raise NotImplementedError(
                f"rope_type {rope_type!r} is not supported (default, linear, llama3, freq_factors)"
            )
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, rotary_dim]: cos in the first half, sin in the second, float32 whatever the model dtype.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `positions`, each [T, 1, rotary_dim], laid out for `_rotate`: cos repeated
        for both halves, sin negated on the first half. Compute once per step and pass it to every
        layer instead of the positions (the gather and the two concatenations are then shared)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, head_dim]. [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], bit for bit, as
        # x * [cos, cos] + [x2, x1] * [-sin, sin].
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = (rot * cos + torch.cat([x2, x1], dim=-1) * sin).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def forward(
        self, positions: torch.Tensor | tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, head_dim], k: [T, Hkv, head_dim]; positions: [T] int64, or `table(positions)`."""
        cos, sin = self.table(positions) if isinstance(positions, torch.Tensor) else positions
        half = self.rotary_dim // 2
        if fused(q) and self.rotary_dim % 2 == 0 and half & (half - 1) == 0 and q.dtype == k.dtype:
            from tqserve.ops.rope import rope_qk  # Triton: imported on the CUDA path only

            return rope_qk(q, k, cos, sin, self.rotary_dim)  # one launch for both (ops/rope.py)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
