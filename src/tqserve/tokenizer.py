"""A thin wrapper over an HF tokenizer: encode/decode, chat template, stop tokens, and incremental
detokenization that only ever emits complete UTF-8 text."""

from __future__ import annotations

import os
from collections.abc import Iterable

_REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 byte sequence yields


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class Tokenizer:
    def __init__(self, hf_tokenizer, extra_stop_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids = _as_id_list(hf_tokenizer.eos_token_id) + list(extra_stop_token_ids)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        # Any of these ends a request (unless ignore_eos): the tokenizer's eos plus the generation
        # config's list (Llama 3 instruct stops on <|eot_id|> as well as <|end_of_text|>).
        self.stop_token_ids: list[int] = list(dict.fromkeys(ids))
        # Fast (Rust) tokenizers: decode through the backend directly. transformers' wrapper adds
        # ~2.5 us of Python per call around the same backend call (and space clean-up, which is off
        # here), and the incremental detokenizer decodes twice per generated token of every request.
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None, extra_stop_token_ids: Iterable[int] = ()):
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        hf = AutoTokenizer.from_pretrained(path, **kwargs)
        stops = list(extra_stop_token_ids)
        if gguf_file is None and os.path.exists(os.path.join(path, "generation_config.json")):
            from transformers import GenerationConfig

            stops += _as_id_list(GenerationConfig.from_pretrained(path).eos_token_id)
        return cls(hf, stops)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # No space clean-up: it is not compositional, and incremental output must concatenate
        # to exactly this string.
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False, **kwargs
    ) -> str | list[int]:
        """Render a conversation with the model's chat template: the prompt text, or its token ids
        with `tokenize=True` (the template already contains any special tokens, so none are added)."""
        if self.hf.chat_template is None and kwargs.get("chat_template") is None:
            raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
        text = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def detokenizer(self, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas.

    Each step decodes a short window of recent tokens twice: up to the last emitted token and up to
    the new one; the delta is the difference. The window starts a few tokens back so that
    tokenizers whose decoding depends on the left context (SentencePiece's leading space) decode
    the same way as in the full string. If the new text ends in U+FFFD, the last token is an
    incomplete UTF-8 sequence: nothing is emitted until a later token completes it.
    Concatenated deltas (plus `flush()`) equal `decode(generated ids)`.
    """

    _CONTEXT = 5  # prompt tokens used as left context for the first generated tokens

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids)[-self._CONTEXT :]
        self.ids: list[int] = context
        self.prefix_offset = 0  # window start
        self.read_offset = len(context)  # tokens before this are emitted
        self.num_context = len(context)
        self.text = ""  # emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._step(final=False)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def add_final(self, token_ids: Iterable[int]) -> str:
        """The text of the last tokens of a sequence, decoded once, including what `flush` would
        emit: the same string as `add_tokens(token_ids) + flush()` (both are the difference between
        the decoding of the window with and without the new tokens), at two decodes instead of two
        per token."""
        self.ids.extend(int(t) for t in token_ids)
        return self._step(final=True)

    def flush(self) -> str:
        """Emit whatever is held back (a sequence that really ends in U+FFFD or broken bytes)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if not final and new_text.endswith(_REPLACEMENT):
            return ""
        consistent = len(new_text) > len(prefix_text) and new_text.startswith(prefix_text)
        if not final and not consistent:
            return ""  # nothing new yet, or the window decoded inconsistently: wait for more tokens
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
