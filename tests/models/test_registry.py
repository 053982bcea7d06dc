from __future__ import annotations

import pytest

from tqserve.models import default_model
from tqserve.models.registry import get_model_class, supported_architectures


def test_known_architectures():
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert get_model_class(arch).__name__ == arch
        assert arch in supported_architectures()


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "tqserve-no-such-package")
    with pytest.raises(FileNotFoundError, match="pip install"):
        default_model.default_model_path()
