"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): tqserve vs transformers reading the same file."""

from __future__ import annotations

import os

import pytest
import torch
from test_hf_models import assert_logits_match, tqserve_logits

from tqserve.models.default_model import default_model_path
from tqserve.models.loader import load_model

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None, torch.float32, "cpu")


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


def test_logits_match_transformers(smollm2, hf_reference):
    model, _, tokenizer = smollm2
    ids = torch.tensor(tokenizer.apply_chat_template(MESSAGES, tokenize=True), dtype=torch.int64)
    with torch.no_grad():
        ref = hf_reference(ids[None]).logits[0].float()
    assert_logits_match(tqserve_logits(model, ids), ref)


def test_greedy_answer_is_sensible(smollm2):
    model, _, tokenizer = smollm2
    ids = torch.tensor(tokenizer.apply_chat_template(MESSAGES, tokenize=True), dtype=torch.int64)
    for _ in range(8):
        ids = torch.cat([ids, tqserve_logits(model, ids)[-1].argmax().view(1)])
    assert "Paris" in tokenizer.decode(ids[-8:])  # "The capital of France is Paris."


@pytest.mark.parametrize("text", ["Hello 😀👍🏽 world", "日本語のテキストと中文混合 한국어 café"])
def test_incremental_detokenizer_real_vocab(smollm2, text):
    from test_tokenizer import assert_streams_exactly

    assert_streams_exactly(smollm2[2], text)
