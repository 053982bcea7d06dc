"""Tiny random Llama / Qwen2 / Qwen3 checkpoints: tqserve logits vs transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from model_factory import write_tiny_checkpoint
from sdpa_backend import PrefillSDPABackend

from tqserve.layers.attention import ForwardContext
from tqserve.models.loader import load_model

PROMPT = "the quick brown fox jumps over the lazy dog, then the cat: 日本 😀!"


def tqserve_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[0], dtype=torch.int64)
    ctx = ForwardContext(PrefillSDPABackend(), None)
    with torch.no_grad():
        hidden = model(input_ids, positions, ctx)
        return model.compute_logits(hidden)


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err <= rel, f"relative error {err:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "top-1 token differs"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_matches_transformers(tmp_path, arch):
    hf_model = write_tiny_checkpoint(tmp_path, arch)
    model, hf_config, tokenizer = load_model(str(tmp_path), torch.float32, "cpu")
    ids = torch.tensor(tokenizer.encode(PROMPT), dtype=torch.int64)
    assert ids.numel() > 40
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0].float()
    ours = tqserve_logits(model, ids)
    assert_logits_match(ours, ref)
    # Different weights must give different logits (the comparison can fail).
    assert not torch.allclose(
        ours, tqserve_logits(load_model(str(write_tiny_other(tmp_path, arch)), torch.float32, "cpu")[0], ids)
    )


def write_tiny_other(tmp_path, arch):
    other = tmp_path / "other"
    write_tiny_checkpoint(other, arch, seed=1)
    return other
