"""Gated full attention of Qwen3-Next / Qwen3.5: q/k RMSNorm, partial RoPE, a sigmoid output gate.

q_proj emits, per head, the query and its gate side by side ([q_h | gate_h], 2*head_dim per head);
the attention output is multiplied by sigmoid(gate) before o_proj. q_norm / k_norm are the
zero-centred RMSNorm (scale 1 + w) over head_dim, applied before RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from tqserve.layers.attention import Attention, ForwardContext
from tqserve.layers.linear import Linear, MergedLinear
from tqserve.layers.rotary import RotaryEmbedding


class ZeroCenteredRMSNorm(nn.Module):
    """out = rmsnorm(x in fp32) * (1 + w) in fp32, cast back: Qwen3-Next's RMSNorm, whose checkpoint
    weight is stored centred on zero."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        rotary: list[RotaryEmbedding],
        attn_layer_idx: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            num_heads,
            num_kv_heads,
            head_dim,
        )
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Fused q(+gate) / k / v projection; shard 0 keeps the checkpoint's per-head [q | gate] interleave.
        self.qkv_proj = MergedLinear(hidden_size, [2 * q_size, kv_size, kv_size], bias=bias, dtype=dtype)
        self.o_proj = Linear(q_size, hidden_size, bias=bias, dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, rms_norm_eps, dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, rms_norm_eps, dtype=dtype)
        self.rotary = rotary  # shared table, kept out of the module tree
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, attn_layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotary[0](positions, q, k)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, ctx)
        out = out * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load one checkpoint tensor named relative to `self_attn.`; returns the key it filled."""
        proj, _, param = name.partition(".")
        shards = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        if proj in shards:
            self.qkv_proj.load_shard(param, shards[proj], tensor)
            return f"qkv_proj.{param}#{shards[proj]}"
        return None
