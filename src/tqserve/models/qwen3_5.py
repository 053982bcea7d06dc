"""Qwen3.5 / Qwen3.6 (config model_type qwen3_5 / qwen3_5_moe): GDN with flat split projections
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and gated attention; dense MLP in every layer
(Qwen3.5) or MoE with a shared expert in every layer (Qwen3.5-MoE, always renormalised top-k).

The multimodal checkpoints (`*ForConditionalGeneration`) nest the text config under `text_config` and
prefix weights with `model.language_model.`; the vision tower is skipped (text only).
"""

from __future__ import annotations

from tqserve.models.hybrid_common import HybridForCausalLM


class Qwen3_5ForCausalLM(HybridForCausalLM):
    gdn_layout = "qwen3_5"

    @staticmethod
    def is_moe_layer(cfg, idx: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    """Its config has no `norm_topk_prob`: the layer default (True) is the renormalising router."""

    gdn_layout = "qwen3_5"

    @staticmethod
    def is_moe_layer(cfg, idx: int) -> bool:
        return True


# Multimodal checkpoints: same language model, text-only here.
Qwen3_5ForConditionalGeneration = Qwen3_5ForCausalLM
Qwen3_5MoeForConditionalGeneration = Qwen3_5MoeForCausalLM
