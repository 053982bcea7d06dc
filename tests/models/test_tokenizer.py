"""Tokenizer wrapper: chat template, stop tokens, and UTF-8-safe incremental detokenization."""

from __future__ import annotations

import json

import pytest
from model_factory import make_tiny_tokenizer

from tqserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "plain ascii, then the end",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧 in the middle",
    "日本語のテキストと中文混合 한국어",
    "accents: café naïve — “quotes” …",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(make_tiny_tokenizer())


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add_token(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


def assert_streams_exactly(tok: Tokenizer, text: str, skip_special_tokens: bool = False) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok.detokenizer(skip_special_tokens=skip_special_tokens), ids)
    for d in deltas:
        assert "\ufffd" not in d, f"incomplete UTF-8 emitted: {d!r}"
        d.encode("utf-8")  # a lone surrogate would raise
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer(tokenizer, text):
    assert_streams_exactly(tokenizer, text)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) == 5  # byte-level: 'a' + four bytes of the emoji
    detok = tokenizer.detokenizer()
    assert [detok.add_token(t) for t in ids] == ["a", "", "", "", "😀"]


def test_special_tokens_in_stream(tokenizer):
    text = "<|im_start|>assistant\nhi 😀<|im_end|>"
    assert_streams_exactly(tokenizer, text)
    assert_streams_exactly(tokenizer, text, skip_special_tokens=True)


def test_prompt_context_does_not_leak(tokenizer):
    prompt = tokenizer.encode("question: 日本", add_special_tokens=False)
    ids = tokenizer.encode(" answer 😀", add_special_tokens=False)
    assert "".join(stream(tokenizer.detokenizer(prompt), ids)) == " answer 😀"


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == text


def test_chat_template_override_and_missing_template():
    hf = make_tiny_tokenizer()
    hf.chat_template = None
    tok = Tokenizer(hf)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(messages)
    assert tok.apply_chat_template(messages, chat_template="{{ messages[0]['content'] }}!") == "hi!"


def test_stop_tokens_include_generation_config(tmp_path):
    hf = make_tiny_tokenizer()
    hf.save_pretrained(str(tmp_path))
    extra = hf.convert_tokens_to_ids("<|endoftext|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [hf.eos_token_id, extra]}))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_id == hf.eos_token_id
    assert tok.stop_token_ids == [hf.eos_token_id, extra]


def test_backend_decode_equals_transformers_decode(tokenizer):
    """Fast tokenizers decode through the Rust backend directly; it must give transformers'
    `decode` (without space clean-up) on any window of ids, special tokens kept or skipped."""
    import random

    assert tokenizer._backend_decode is not None
    hf = tokenizer.hf
    rng = random.Random(0)
    ids = [rng.randrange(len(hf)) for _ in range(3000)]
    ids[::97] = [hf.eos_token_id] * len(ids[::97])
    for i in range(0, len(ids), 5):
        window = ids[i : i + rng.randrange(1, 9)]
        for skip in (False, True):
            want = hf.decode(window, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert tokenizer.decode(window, skip_special_tokens=skip) == want


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("text", [*TEXTS, "<|im_start|>assistant\nhi 😀<|im_end|> tail"])
def test_add_final_equals_token_by_token(tokenizer, text, skip):
    """The lazy path's one decode (`add_final`) gives the same text as feeding the tokens one at a
    time and flushing, with and without a prompt's left context, at every cut into the sequence
    (a multi-byte character split at the end included)."""
    prompt = tokenizer.encode("question: 日本", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for context in ([], prompt):
        for cut in range(len(ids) + 1):
            eager = tokenizer.detokenizer(context, skip_special_tokens=skip)
            want = "".join(stream(eager, ids[:cut]))
            lazy = tokenizer.detokenizer(context, skip_special_tokens=skip)
            assert lazy.add_final(ids[:cut]) == want
