"""The attention layer models call: projections live in the model, this hands q/k/v to the backend."""

from __future__ import annotations

import torch
from torch import nn

from tqserve.attention.backend import AttentionMetadata


class ForwardContext:
    """What one forward needs besides tensors: the backend and this step's metadata.

    Models pass it down unchanged; they never look inside (invariant 7).
    """

    def __init__(self, backend, meta: AttentionMetadata) -> None:
        self.backend = backend
        self.meta = meta


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Index among the model's *attention* layers (its KV-cache layer), not the decoder layer index.
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = ctx.backend.forward(self.layer_idx, q, k, v, ctx.meta, self.scale)
        return out.reshape(t, self.num_heads * self.head_dim)
