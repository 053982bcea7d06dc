"""Gated DeltaNet token mixer (the linear-attention layers of Qwen3-Next and Qwen3.5/3.6).

in_proj -> causal conv1d (kernel K, SiLU) over [q | k | v] -> gated delta rule -> gated RMSNorm with z
-> out_proj. The per-request conv and recurrent states live in the StatePool (ctx.state_pool) at the
slot `meta.seq_slots[i]`, read and written in place; a request without context starts from zero.

Checkpoint layouts (both are loaded into one fused projection with rows [q | k | v | z | b | a],
each part ordered head after head):
  Qwen3-Next: in_proj_qkvz [Hk * (2dk + 2r*dv), H] grouped per key head, in_proj_ba [Hk * 2r, H]
              (r = Hv / Hk), regrouped at load time;
  Qwen3.5:    in_proj_qkv (already [q | k | v]), in_proj_z, in_proj_b, in_proj_a.

Paths: CPU -> the torch reference (ops/gdn/reference.py, host loop over requests); CUDA decode-only
steps (max_query_len == 1) -> our Triton kernels with slot indices; CUDA steps with prefill chunks ->
fla-core chunk kernels (gather / scatter of pool slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tqserve.attention.backend import AttentionMetadata
from tqserve.layers.linear import Linear, MergedLinear
from tqserve.ops.gdn import reference as ref


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w (plain weight, not 1 + w), then * silu(z) in fp32: norm before gate."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return (out * F.silu(z.float())).to(x.dtype)


@dataclass
class GdnStepInfo:
    """Per-step facts every GDN layer needs, built once per forward by the model."""

    meta: AttentionMetadata
    has_context: torch.Tensor  # [num_reqs] bool on device: the request continues a stored state
    slots: torch.Tensor  # [num_reqs] int64 on device
    num_real_tokens: int  # host int
    fla: dict | None = None  # cu_seqlens / chunk_indices for the fla prefill path

    @classmethod
    def build(cls, meta: AttentionMetadata, device: torch.device) -> GdnStepInfo:
        n = meta.num_reqs
        qsl = meta.query_start_loc[: n + 1]
        # Context length = seq_len - query_len, all on device (no host sync).
        has_context = (meta.seq_lens[:n] - (qsl[1:] - qsl[:-1])) > 0
        real = meta.query_start_loc_cpu[n] if len(meta.query_start_loc_cpu) > n else meta.num_tokens
        info = cls(meta, has_context, meta.seq_slots[:n].long(), real)
        if device.type == "cuda" and meta.max_query_len > 1:
            from tqserve.ops.gdn.fla_ops import step_chunk_metadata

            info.fla = step_chunk_metadata(meta, device)
        return info


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        rms_norm_eps: float,
        state_idx: int,
        layout: str,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of key heads {num_k_heads}")
        if layout not in ("qwen3_next", "qwen3_5"):
            raise ValueError(f"unknown GDN checkpoint layout {layout!r}")
        self.hk, self.hv, self.dk, self.dv = (
            num_k_heads,
            num_v_heads,
            head_k_dim,
            head_v_dim,
        )
        self.key_dim, self.value_dim = (
            num_k_heads * head_k_dim,
            num_v_heads * head_v_dim,
        )
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.state_idx = state_idx  # index among the model's GDN layers (its StatePool layer)
        self.layout = layout
        sizes = [
            self.key_dim,
            self.key_dim,
            self.value_dim,
            self.value_dim,
            num_v_heads,
            num_v_heads,
        ]
        self.in_proj = MergedLinear(hidden_size, sizes, dtype=dtype)  # [q | k | v | z | b | a]
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, dtype=dtype)

    def state_spec(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return (self.conv_dim, self.conv_kernel), (self.hv, self.dk, self.dv)

    # ---- forward ---------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ctx, info: GdnStepInfo) -> torch.Tensor:
        t = x.shape[0]
        proj = self.in_proj(x)
        mixed_qkv = proj[:, : self.conv_dim]
        z = proj[:, self.conv_dim : self.conv_dim + self.value_dim]
        b = proj[:, self.conv_dim + self.value_dim : self.conv_dim + self.value_dim + self.hv]
        a = proj[:, self.conv_dim + self.value_dim + self.hv :]
        pool = ctx.state_pool
        conv_pool, ssm_pool = pool.conv[self.state_idx], pool.ssm[self.state_idx]
        if x.is_cuda and info.meta.max_query_len == 1:
            from tqserve.ops.gdn.recurrent_triton import gdn_decode

            # One row per request; rows past num_reqs (padding of a captured batch) stay zero.
            n = info.meta.num_reqs
            core = gdn_decode(
                mixed_qkv[:n], a[:n], b[:n], self.conv_weight, self.A_log, self.dt_bias, conv_pool, ssm_pool,
                info.meta.seq_slots[:n], info.meta.seq_lens[:n], (self.hk, self.dk, self.hv, self.dv),
            )  # fmt: skip
            if n < t:
                core = torch.cat([core, core.new_zeros(t - n, self.hv, self.dv)])
        elif x.is_cuda and info.fla is not None:
            from tqserve.ops.gdn.fla_ops import gdn_prefill_fla

            core = gdn_prefill_fla(
                mixed_qkv, a, b, self.conv_weight, self.A_log, self.dt_bias, conv_pool, ssm_pool,
                info, (self.hk, self.dk, self.hv, self.dv),
            )  # fmt: skip
        else:
            meta = info.meta
            core = ref.gdn_varlen_reference(
                mixed_qkv, a, b, self.conv_weight, None, self.A_log, self.dt_bias, conv_pool, ssm_pool,
                (self.hk, self.dk, self.hv, self.dv), meta.query_start_loc_cpu, meta.seq_lens_cpu,
                meta.seq_slots_cpu,
            )  # fmt: skip
        core = core.to(x.dtype).reshape(t * self.hv, self.dv)
        out = self.norm(core, z.reshape(t * self.hv, self.dv))
        return self.out_proj(out.reshape(t, self.value_dim))

    # ---- loading ---------------------------------------------------------------------------------

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """One checkpoint tensor named relative to `linear_attn.`."""
        direct = {
            "A_log": self.A_log,
            "dt_bias": self.dt_bias,
            "norm.weight": self.norm.weight,
        }
        if name in direct:
            direct[name].data.copy_(tensor)
        elif name == "conv1d.weight":
            self.conv_weight.data.copy_(tensor.reshape(self.conv_dim, self.conv_kernel))
        elif name == "out_proj.weight":
            self.out_proj.weight.data.copy_(tensor)
        elif name == "in_proj_qkv.weight":
            q, k, v = tensor.split([self.key_dim, self.key_dim, self.value_dim], dim=0)
            for shard, part in enumerate((q, k, v)):
                self.in_proj.load_shard("weight", shard, part)
        elif name in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
            self.in_proj.load_shard("weight", {"z": 3, "b": 4, "a": 5}[name[8]], tensor)
        elif name == "in_proj_qkvz.weight":
            r = self.hv // self.hk
            grouped = tensor.reshape(self.hk, 2 * self.dk + 2 * r * self.dv, -1)
            parts = grouped.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=1)
            for shard, part in enumerate(parts):  # [Hk, rows_per_head, H] -> flat, head after head
                self.in_proj.load_shard("weight", shard, part.reshape(-1, part.shape[-1]))
        elif name == "in_proj_ba.weight":
            r = self.hv // self.hk
            b, a = tensor.reshape(self.hk, 2 * r, -1).split([r, r], dim=1)
            self.in_proj.load_shard("weight", 4, b.reshape(self.hv, -1))
            self.in_proj.load_shard("weight", 5, a.reshape(self.hv, -1))
        else:
            return False
        return True
