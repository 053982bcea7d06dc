"""Qwen3 dense: the Llama decoder with per-head RMSNorm on q and k before RoPE (head_dim comes
from the config, not hidden_size / heads; `attention_bias` as in Llama)."""

from __future__ import annotations

from tqserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
