"""Sparse mixture of experts with an optional gated shared expert (Qwen3-Next, Qwen3.5-MoE), and the
dense gated MLP it reuses for the shared expert.

Routing: softmax over experts in fp32, top-k, optional renormalisation of the k weights.
Expert weights are held fused, w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I]; checkpoints
may store them fused (`experts.gate_up_proj`, `experts.down_proj`) or per expert
(`experts.{e}.gate_proj/up_proj/down_proj.weight`), both load.

Compute is shape-static (invariant 2): when few (token, expert) pairs exist (decode) the selected
expert matrices are gathered and applied with batched matmuls; otherwise every expert runs over all
tokens and a dense [T, E] combine matrix (zero off the top-k) weights the results. No fused MoE
kernel yet: the dense path costs E/k times the routed FLOPs on large prefill steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tqserve.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> bool:
        proj, _, param = name.partition(".")
        if proj in ("gate_proj", "up_proj"):
            self.gate_up_proj.load_shard(param, 0 if proj == "gate_proj" else 1, tensor)
            return True
        if proj == "down_proj":
            getattr(self.down_proj, param).data.copy_(tensor)
            return True
        return False


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_expert_intermediate_size: int,
        norm_topk_prob: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (
            num_experts,
            top_k,
            norm_topk_prob,
        )
        self.inter = moe_intermediate_size
        self.gate = Linear(hidden_size, num_experts, dtype=dtype)  # the router
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * moe_intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, moe_intermediate_size, dtype=dtype),
            requires_grad=False,
        )
        if shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, dtype=dtype)
            self.shared_expert_gate = Linear(hidden_size, 1, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids

    def _experts_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        h = torch.bmm(self.w13.index_select(0, flat), xs).squeeze(-1)  # [T*k, 2I]
        h = F.silu(h[:, : self.inter]) * h[:, self.inter :]
        y = torch.bmm(self.w2.index_select(0, flat), h.unsqueeze(-1)).squeeze(-1)  # [T*k, H]
        return (y.view(t, k, -1) * weights.unsqueeze(-1)).sum(1)

    def _experts_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        combine.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            h = F.linear(x, self.w13[e])
            h = F.silu(h[:, : self.inter]) * h[:, self.inter :]
            out += F.linear(h, self.w2[e]) * combine[:, e : e + 1]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.shape[0] * self.top_k <= self.num_experts:
            out = self._experts_gathered(x, weights, ids)
        else:
            out = self._experts_dense(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """One checkpoint tensor named relative to `mlp.`."""
        if name.startswith("shared_expert."):
            return self.shared_expert is not None and self.shared_expert.load_hf_weight(name[14:], tensor)
        if name.startswith("shared_expert_gate."):
            self.shared_expert_gate.weight.data.copy_(tensor)
            return True
        if name == "gate.weight":
            self.gate.weight.data.copy_(tensor)
            return True
        if name in ("experts.gate_up_proj", "experts.gate_up_proj.weight"):
            self.w13.data.copy_(tensor)
            return True
        if name in ("experts.down_proj", "experts.down_proj.weight"):
            self.w2.data.copy_(tensor)
            return True
        parts = name.split(".")  # experts.{e}.{proj}.weight
        if len(parts) == 4 and parts[0] == "experts" and parts[3] == "weight":
            e, proj = int(parts[1]), parts[2]
            if proj == "gate_proj":
                self.w13.data[e, : self.inter].copy_(tensor)
            elif proj == "up_proj":
                self.w13.data[e, self.inter :].copy_(tensor)
            elif proj == "down_proj":
                self.w2.data[e].copy_(tensor)
            else:
                return False
            return True
        return False
