"""Qwen3-Next (e.g. Qwen3-Next-80B-A3B): GDN + gated attention, MoE with a shared expert.

GDN projections come grouped per key head (`in_proj_qkvz`, `in_proj_ba`); a layer is MoE when it is not
in `mlp_only_layers`, experts exist and (idx + 1) % decoder_sparse_step == 0.
"""

from __future__ import annotations

from tqserve.models.hybrid_common import HybridForCausalLM


class Qwen3NextForCausalLM(HybridForCausalLM):
    gdn_layout = "qwen3_next"

    @staticmethod
    def is_moe_layer(cfg, idx: int) -> bool:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        return (
            idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and getattr(cfg, "num_experts", 0) > 0
            and (idx + 1) % step == 0
        )
