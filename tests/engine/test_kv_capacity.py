"""Requests against the KV cache's capacity (CPU, the default model, float32).

A request that outgrows the pages while alone can never be scheduled: preempting it frees nothing another
request holds, so it would be recomputed forever and take the engine's steps with it. The engine refuses
prompts past the capacity (a ValueError, HTTP 400 in the server) and clamps max_tokens to it, so such a
request finishes with "length" at the capacity; the CPU default budget holds a whole max_model_len request.
"""

from __future__ import annotations

import pytest

from tqserve import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _llm(loaded, **kw) -> LLM:
    kw.setdefault("max_model_len", 2048)
    return LLM(loaded=loaded, dtype="float32", max_num_seqs=4, enable_prefix_caching=False, **kw)


def _prompt(n: int, start: int = 100) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def test_prompt_past_the_kv_capacity_is_refused(smollm_loaded):
    llm = _llm(smollm_loaded, num_gpu_blocks_override=12)
    assert llm.engine.max_request_len == 11 * 16  # page 0 is never handed out
    with pytest.raises(ValueError, match="KV cache's 176 tokens"):
        llm.generate([_prompt(176)], SamplingParams(max_tokens=4))
    out = llm.generate([_prompt(40)], SamplingParams(max_tokens=4, **GREEDY))  # the engine still serves
    assert len(out[0].outputs[0].token_ids) == 4


def test_request_that_would_outgrow_the_cache_stops_at_it(smollm_loaded):
    llm = _llm(smollm_loaded, num_gpu_blocks_override=12)
    long, short = llm.generate([_prompt(150), _prompt(40, 500)], SamplingParams(max_tokens=100, **GREEDY))
    assert long.outputs[0].finish_reason == "length"
    assert len(long.outputs[0].token_ids) == 176 - 150
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 100
    # the same tokens as an engine with room for both, run alone (preemption recomputes, it changes nothing)
    (ref,) = _llm(smollm_loaded).generate([_prompt(150)], SamplingParams(max_tokens=26, **GREEDY))
    assert long.outputs[0].token_ids == ref.outputs[0].token_ids


def test_default_cpu_budget_holds_a_whole_context(smollm_loaded):
    llm = _llm(smollm_loaded, max_model_len=8192)
    assert llm.engine.max_request_len == 8192
    assert llm.engine.capacity_report().max_concurrency >= 1.0
