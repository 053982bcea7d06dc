"""Tiny random Llama / Qwen2 / Qwen3 checkpoints: tqserve logits vs transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from model_factory import write_tiny_checkpoint
from paged_runner import PagedRunner, prefill_logits

from tqserve.models.loader import load_model

PROMPT = "the quick brown fox jumps over the lazy dog, then the cat: 日本 😀!"


def tqserve_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """One request prefilled in one step through the reference paged attention backend."""
    return prefill_logits(model, input_ids)


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


def test_chunked_prefill_batching_and_decode_match_single_prefill(tmp_path):
    """Flat layout over real pages: one request prefilled in two chunks, batched with another
    request, then decoded token by token, gives the logits of a single full prefill."""
    write_tiny_checkpoint(tmp_path, "qwen3")
    model, _, tokenizer = load_model(str(tmp_path), torch.float32, "cpu")
    a = tokenizer.encode("hello there, general kenobi")
    b = tokenizer.encode("日本語のテキスト")
    full_a, full_b = tqserve_logits(model, torch.tensor(a)), tqserve_logits(model, torch.tensor(b))
    runner = PagedRunner(model, max_reqs=2)
    cut = 11
    first = runner.step([(0, 0, a[:cut]), (1, 0, b[:-3])])
    second = runner.step([(1, len(b) - 3, b[-3:-2]), (0, cut, a[cut:])])
    decode = [
        runner.step([(0, len(a) + i, [t]), (1, len(b) - 2 + i, [b[len(b) - 2 + i]])]) for i, t in enumerate([5, 6])
    ]
    kw = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(first[:cut], full_a[:cut], **kw)
    torch.testing.assert_close(first[cut:], full_b[:-3], **kw)
    torch.testing.assert_close(second[0], full_b[-3], **kw)
    torch.testing.assert_close(second[1:], full_a[cut:], **kw)
    torch.testing.assert_close(decode[0][1], full_b[-2], **kw)
    torch.testing.assert_close(decode[1][1], full_b[-1], **kw)
    extended = tqserve_logits(model, torch.tensor([*a, 5, 6]))
    torch.testing.assert_close(torch.stack([decode[0][0], decode[1][0]]), extended[-2:], **kw)


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
