"""RequestOutputKind: CUMULATIVE returns every step's output so far, FINAL_ONLY one output when the request
(all n samples) finishes, equal to CUMULATIVE's last; DELTA is refused naming the field."""

from __future__ import annotations

import pytest

from tqserve import LLM, RequestOutputKind, SamplingParams


def _steps(llm: LLM, kind: RequestOutputKind, n: int = 1) -> list:
    params = SamplingParams(temperature=0.0 if n == 1 else 0.8, seed=3, n=n, max_tokens=6, logprobs=2, output_kind=kind)
    llm.engine.add_request("a", llm.get_tokenizer().encode("The capital of France is"), params, prompt="p")
    seen = []
    while llm.engine.has_unfinished_requests():
        seen.extend(llm.engine.step())
    return seen


@pytest.mark.parametrize("n", [1, 2])
def test_final_only_is_cumulative_last(smollm_loaded, n):
    llm = LLM(loaded=smollm_loaded, device="cpu", dtype="float32", max_model_len=256)
    cumulative = _steps(llm, RequestOutputKind.CUMULATIVE, n)
    final = _steps(llm, RequestOutputKind.FINAL_ONLY, n)
    assert len(cumulative) > 1 and not cumulative[0].finished and cumulative[-1].finished
    assert len(final) == 1 and final[0].finished
    a, b = cumulative[-1], final[0]
    assert [(o.token_ids, o.text, o.finish_reason) for o in a.outputs] == [
        (o.token_ids, o.text, o.finish_reason) for o in b.outputs
    ]
    # logprob records grow in place inside the engine: earlier outputs keep their own copies
    assert [len(o.logprobs) for o in cumulative[0].outputs] == [len(o.token_ids) for o in cumulative[0].outputs]
    assert [o.logprobs for o in a.outputs] == [o.logprobs for o in b.outputs]


def test_generate_returns_finished_outputs(smollm_loaded):
    llm = LLM(loaded=smollm_loaded, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    out = llm.generate(["Hello", "The sky is"], params)
    assert [o.finished for o in out] == [True, True] and all(len(o.outputs[0].token_ids) == 5 for o in out)
    assert params.output_kind == RequestOutputKind.CUMULATIVE  # the caller's object is left as it was


def test_delta_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
