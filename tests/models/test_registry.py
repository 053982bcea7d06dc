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


def test_load_model_rejects_bad_input(tmp_path):
    import torch

    from tqserve.models.loader import check_dtype, load_model

    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nope"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), torch.float16, "cpu")
    with pytest.raises(ValueError, match="bfloat16"):
        check_dtype(torch.float32, torch.device("cuda"))
    check_dtype(torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="no config.json and 0 .gguf"):
        load_model(str(tmp_path), torch.float32, "cpu")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model(str(tmp_path / "weights.bin"), torch.float32, "cpu")
