"""Checkpoint layouts of the hybrid models: per-expert vs fused experts, the multimodal
`model.language_model.` prefix, tied embeddings, MTP weights kept, missing tensors rejected."""

from __future__ import annotations

import os

import hybrid_factory as hf
import pytest
import torch


def _logits(model, ids):
    return hf.Driver(model).step([(1, ids, 0)])


IDS = list(range(3, 40, 2))


def test_fused_and_per_expert_checkpoints_agree(tmp_path):
    m = hf.make_hf_model("qwen3_5_moe")
    a = hf.load_tqserve_model(hf.write_checkpoint(m, str(tmp_path / "per"), per_expert=True))
    b = hf.load_tqserve_model(hf.write_checkpoint(m, str(tmp_path / "fused"), per_expert=False))
    assert torch.equal(_logits(a, IDS), _logits(b, IDS))


def test_language_model_prefix_tied_and_mtp(tmp_path):
    m = hf.make_hf_model("qwen3_5", tie_word_embeddings=True)
    with torch.no_grad():
        m.lm_head.weight = m.model.embed_tokens.weight
    path = hf.write_checkpoint(m, str(tmp_path / "mm"), language_model_prefix=True, with_mtp=True)
    ours = hf.load_tqserve_model(path)
    assert ours.mtp is not None and len(ours.mtp.layers) == 1
    assert ours.lm_head.weight is ours.embed_tokens.weight
    with torch.no_grad():
        ref = m(torch.tensor([IDS])).logits[0]
    got = _logits(ours, IDS)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-4
    assert ours.mtp_kv_layer_specs() == [(2, 16)]


def test_missing_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    m = hf.make_hf_model("qwen3_next")
    path = hf.write_checkpoint(m, str(tmp_path / "next"))
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(ValueError, match="unwritten"):
        hf.load_tqserve_model(path)
