"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): tqserve vs transformers reading the same file."""

from __future__ import annotations

import os

import pytest
import torch
from test_hf_models import assert_logits_match, tqserve_logits

from tqserve.models.default_model import default_model_path

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def smollm2(smollm_loaded):
    """(model, hf_config, tokenizer) of the default model, float32, loaded once per session
    by `load_model(None, ...)` (tests/conftest.py)."""
    return smollm_loaded


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' own GGUF path (config, name mapping, q/k un-permutation, dequantization).
    Built by hand instead of `from_pretrained(gguf_file=...)`, which insists on `accelerate`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    directory, filename = os.path.split(path)
    cfg = AutoConfig.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def test_config_and_tokenizer(smollm2):
    model, cfg, tokenizer = smollm2
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.kv_layer_specs() == [(3, 64)] * 30
    prompt = tokenizer.apply_chat_template(MESSAGES)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id in tokenizer.stop_token_ids
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    assert tokenizer.decode(ids) == prompt


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    """The chat prompt plus the start of the expected answer (teacher forcing: one forward)."""
    tokenizer = smollm2[2]
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    ids += tokenizer.encode("The capital of France is", add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.int64)


def test_logits_match_transformers(smollm2, hf_reference, prompt_ids):
    model, cfg, tokenizer = smollm2
    for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "rms_norm_eps", "vocab_size"):
        assert getattr(cfg, key) == getattr(hf_reference.config, key), key
    assert cfg.rope_parameters["rope_theta"] == hf_reference.config.rope_parameters["rope_theta"]
    with torch.no_grad():
        ref = hf_reference(prompt_ids[None]).logits[0].float()
    ours = tqserve_logits(model, prompt_ids)
    assert_logits_match(ours, ref)
    # The dequantized, un-permuted model answers the question.
    assert tokenizer.decode([int(ours[-1].argmax())]) == " Paris"


@pytest.mark.parametrize("text", ["Hello 😀👍🏽 world", "日本語のテキストと中文混合 한국어 café"])
def test_incremental_detokenizer_real_vocab(smollm2, text):
    from test_tokenizer import assert_streams_exactly

    assert_streams_exactly(smollm2[2], text)


def test_gguf_tokenizer_cache(tmp_path, monkeypatch, smollm2):
    """The tokenizer converted from the GGUF file is saved once and reloaded identically."""
    from tqserve.models import gguf_loader
    from tqserve.models.gguf_reader import GGUFFile
    from tqserve.tokenizer import Tokenizer

    session_tokenizer = smollm2[2]
    real_from_pretrained = Tokenizer.from_pretrained
    conversions = []

    def from_pretrained(path, gguf_file=None, extra_stop_token_ids=()):
        if gguf_file is None:
            return real_from_pretrained(path, extra_stop_token_ids=extra_stop_token_ids)
        conversions.append(gguf_file)  # the session fixture already paid for a real conversion
        return session_tokenizer

    monkeypatch.setattr(Tokenizer, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setenv("TQSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    reader = GGUFFile(path)
    gguf_loader.load_gguf_tokenizer(path, reader)
    entry = gguf_loader._tokenizer_cache_dir(path)
    assert os.path.isfile(os.path.join(entry, "tokenizer.json"))
    cached = gguf_loader.load_gguf_tokenizer(path, reader)
    assert len(conversions) == 1 and cached is not session_tokenizer
    text = "Hello world 😀 日本語 <|im_end|>"
    assert cached.encode(text) == session_tokenizer.encode(text)
    assert cached.apply_chat_template(MESSAGES) == session_tokenizer.apply_chat_template(MESSAGES)
    assert (cached.eos_token_id, cached.bos_token_id, cached.stop_token_ids) == (2, 1, [2])
