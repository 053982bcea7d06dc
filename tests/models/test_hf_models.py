"""Tiny random Llama / Qwen2 / Qwen3 checkpoints: tqserve logits vs transformers on the same weights."""

from __future__ import annotations

from types import SimpleNamespace

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
        return model.compute_logits(model(input_ids, positions, ctx))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    err = relative_error(ours, ref)
    assert err <= rel, f"relative error {err:.3g}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "top-1 token differs"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_matches_transformers(tmp_path, arch):
    hf_model = write_tiny_checkpoint(tmp_path / "a", arch)
    model, hf_config, tokenizer = load_model(str(tmp_path / "a"), torch.float32, "cpu")
    assert hf_config.architectures == [type(model).__name__]
    ids = torch.tensor(tokenizer.encode(PROMPT), dtype=torch.int64)
    assert ids.numel() > 40
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0].float()
    ours = tqserve_logits(model, ids)
    assert_logits_match(ours, ref)
    # Control: another seed's weights are far off, so the comparison above can fail.
    write_tiny_checkpoint(tmp_path / "b", arch, seed=1)
    other = tqserve_logits(load_model(str(tmp_path / "b"), torch.float32, "cpu")[0], ids)
    assert relative_error(other, ref) > 1e-2


def test_batched_requests_match_single(tmp_path):
    """Flat layout: two requests concatenated in one step give each request's own logits."""
    write_tiny_checkpoint(tmp_path, "qwen3")
    model, _, tokenizer = load_model(str(tmp_path), torch.float32, "cpu")
    a = torch.tensor(tokenizer.encode("hello there"), dtype=torch.int64)
    b = torch.tensor(tokenizer.encode("日本語のテキスト"), dtype=torch.int64)

    # The test backend reads only the host copy of the request boundaries.
    meta = SimpleNamespace(query_start_loc_cpu=[0, a.numel(), a.numel() + b.numel()])

    ids = torch.cat([a, b])
    positions = torch.cat([torch.arange(a.numel()), torch.arange(b.numel())])
    with torch.no_grad():
        both = model.compute_logits(model(ids, positions, ForwardContext(PrefillSDPABackend(), meta)))
    torch.testing.assert_close(both[: a.numel()], tqserve_logits(model, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[a.numel() :], tqserve_logits(model, b), rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_float32(tmp_path):
    write_tiny_checkpoint(tmp_path, "llama")
    ids = torch.arange(3, 40, dtype=torch.int64)
    ref = tqserve_logits(load_model(str(tmp_path), torch.float32, "cpu")[0], ids)
    model_bf16 = load_model(str(tmp_path), torch.bfloat16, "cpu")[0]
    assert model_bf16.embed_tokens.weight.dtype == torch.bfloat16
    ours = tqserve_logits(model_bf16, ids)
    assert ours.dtype == torch.float32
    assert relative_error(ours, ref) < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
