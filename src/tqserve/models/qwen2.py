"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q/k/v (none on o)."""

from __future__ import annotations

from tqserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _attention_biases(self, cfg) -> tuple[bool, bool]:
        return True, False
