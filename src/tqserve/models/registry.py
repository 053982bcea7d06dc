"""HF architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

import importlib

# Lazy: importing a model module costs nothing until that architecture is asked for.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tqserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tqserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tqserve.models.qwen3", "Qwen3ForCausalLM"),
    # Hybrid (Gated DeltaNet + gated attention) models.
    "Qwen3NextForCausalLM": ("tqserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("tqserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("tqserve.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("tqserve.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("tqserve.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def register_model(arch: str, module: str, class_name: str) -> None:
    """Add an architecture (other model families register theirs without editing this table)."""
    _MODELS[arch] = (module, class_name)


def get_model_class(arch: str) -> type:
    if arch not in _MODELS:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: {', '.join(supported_architectures())}")
    module, class_name = _MODELS[arch]
    return getattr(importlib.import_module(module), class_name)


def model_class_for_config(hf_config) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            return get_model_class(arch)
    return get_model_class(archs[0] if archs else f"<none; model_type={getattr(hf_config, 'model_type', '?')}>")
