"""Output processing detokenizes a FINAL_ONLY sample without stop strings once, when it finishes
(`output_processor._lazy_text`): the outputs equal the eager (token by token) path's, for finished,
stopped-by-token and aborted samples."""

from __future__ import annotations

import pytest
from model_factory import make_tiny_tokenizer

from tqserve.engine.output_processor import OutputProcessor, ParentState, SampleState
from tqserve.outputs import CompletionOutput
from tqserve.request import Request, RequestStatus
from tqserve.sampling_params import RequestOutputKind, SamplingParams
from tqserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(make_tiny_tokenizer())


def _run(tokenizer, kind, ids, end: RequestStatus, prompt, skip=True, abort_at=None):
    proc = OutputProcessor(tokenizer)
    sp = SamplingParams(temperature=0.0, max_tokens=len(ids), output_kind=kind, skip_special_tokens=skip)
    req = Request("r", prompt, sp, len(ids), frozenset({tokenizer.eos_token_id}), parent_id="r")
    state = SampleState(req, tokenizer.detokenizer(prompt, skip_special_tokens=skip), CompletionOutput(index=0))
    proc.add(ParentState("r", None, prompt, [state]))
    outs = []
    for i, tok in enumerate(ids):
        if abort_at is not None and i == abort_at:
            req.status = RequestStatus.FINISHED_ABORTED
            return proc.abort("r")
        req.output_token_ids.append(tok)
        if i == len(ids) - 1:
            req.status = end
            if end == RequestStatus.FINISHED_STOPPED:
                req.stop_reason = tok  # as `Scheduler._check_stop` sets it for a stop token id
        outs.extend(proc.process([req], {}, {})[0])
    return outs[-1]


@pytest.mark.parametrize("text", ["plain ascii", "emoji 😀👍🏽 mid", "日本語のテキスト", "hi 😀<|im_end|>"])
@pytest.mark.parametrize("end", [RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED])
def test_lazy_text_equals_eager(tokenizer, text, end):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("question: 日本", add_special_tokens=False)
    for skip in (True, False):
        eager = _run(tokenizer, RequestOutputKind.CUMULATIVE, ids, end, prompt, skip)
        lazy = _run(tokenizer, RequestOutputKind.FINAL_ONLY, ids, end, prompt, skip)
        assert lazy.finished and eager.finished
        got = [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in lazy.outputs]
        assert got == [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in eager.outputs]
        assert lazy.outputs[0].stop_reason == (ids[-1] if end == RequestStatus.FINISHED_STOPPED else None)
        assert lazy.outputs[0].text  # the text is there, not left empty


@pytest.mark.parametrize("abort_at", [1, 3, 6])
def test_lazy_text_of_an_aborted_sample(tokenizer, abort_at):
    """An abort keeps the text an eager sample had at that point (complete characters only)."""
    ids = tokenizer.encode("a😀 b日本 c", add_special_tokens=False)
    eager = _run(tokenizer, RequestOutputKind.CUMULATIVE, ids, RequestStatus.FINISHED_LENGTH, [], abort_at=abort_at)
    lazy = _run(tokenizer, RequestOutputKind.FINAL_ONLY, ids, RequestStatus.FINISHED_LENGTH, [], abort_at=abort_at)
    assert [(o.text, o.token_ids, o.finish_reason) for o in lazy.outputs] == [
        (o.text, o.token_ids, o.finish_reason) for o in eager.outputs
    ]


def test_lazy_sample_decodes_once(tokenizer, monkeypatch):
    """A lazy sample costs two decodes in all (the window with and without its tokens), not two per token;
    a sample with a stop string stays incremental (the stop string is searched in the growing text)."""
    ids = tokenizer.encode("some plain words to decode at the end", add_special_tokens=False)
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    _run(tokenizer, RequestOutputKind.FINAL_ONLY, ids, RequestStatus.FINISHED_LENGTH, [])
    assert len(calls) == 2
    calls.clear()
    _run(tokenizer, RequestOutputKind.CUMULATIVE, ids, RequestStatus.FINISHED_LENGTH, [])
    assert len(calls) >= 2 * len(ids)
