"""Asynchronous output processing (`LLMEngine.async_output_proc`): step N's outputs are processed while
step N + 1 runs, and returned one step later. Every request must end exactly as without it (tokens,
text, finish and stop reasons, logprobs), each request's stream of outputs must be the same sequence,
and a request that a stop string ends must not gain the token of the step that was already running.
The switch is on for CUDA engines; here it is forced on the CPU, where the same code runs."""

from __future__ import annotations

import pytest

from tqserve import LLM, SamplingParams


def _llm(loaded, async_on: bool, **kw) -> LLM:
    llm = LLM(loaded=loaded, device="cpu", dtype="float32", max_model_len=256, **kw)
    llm.engine.async_output_proc = async_on
    return llm


def _run(llm: LLM, requests: list[tuple[str, str, SamplingParams]], abort_at: dict[str, int] | None = None):
    """Add the requests, step until done; returns (per-request list of outputs in order, steps)."""
    eng = llm.engine
    tok = llm.get_tokenizer()
    for rid, prompt, params in requests:
        eng.add_request(rid, tok.encode(prompt), params, prompt=prompt)
    streams: dict[str, list] = {rid: [] for rid, _, _ in requests}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            streams[out.request_id].append(out)
        steps += 1
        for rid, at in (abort_at or {}).items():
            if steps == at:
                for out in eng.abort_request([rid]):
                    streams[out.request_id].append(out)
        assert steps < 500
    return streams, steps


def _final(o) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]


def _requests(stop: str) -> list[tuple[str, str, SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    return [
        ("plain", "The capital of France is", greedy),
        ("short", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=3)),
        ("stop", "Write a list of fruits:", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])),
        ("logprobs", "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=7, logprobs=3)),
        ("seeded", "The weather today", SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=9)),
    ]


def _stop_string(loaded) -> str:
    """A stop string the greedy continuation of the fruit prompt reaches after a few tokens."""
    llm = _llm(loaded, False)
    text = llm.generate(["Write a list of fruits:"], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    assert len(text) > 30
    return text[12:16]


def test_async_outputs_equal_sync(smollm_loaded):
    stop = _stop_string(smollm_loaded)
    sync, sync_steps = _run(_llm(smollm_loaded, False), _requests(stop))
    asyn, async_steps = _run(_llm(smollm_loaded, True), _requests(stop))
    assert sync.keys() == asyn.keys()
    for rid in sync:
        a, b = sync[rid], asyn[rid]
        assert b[-1].finished and a[-1].finished
        assert _final(a[-1]) == _final(b[-1]), rid
        # the same stream: one output per step, in the same order (the async one a step later)
        assert [_final(o) for o in a] == [_final(o) for o in b], rid
    s = sync["stop"][-1].outputs[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop and stop not in s.text
    assert len(s.token_ids) < 24  # the stop string ended it, not max_tokens
    # the last async step only processes the outputs of the one before it
    assert async_steps == sync_steps + 1


def test_stopped_request_leaves_the_batch(smollm_loaded):
    """The step running when a stop string is found still computes the stopped request; its token is
    dropped and the request is no longer scheduled or held by the scheduler."""
    stop = _stop_string(smollm_loaded)
    llm = _llm(smollm_loaded, True)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    eng.add_request("stop", llm.get_tokenizer().encode("Write a list of fruits:"), params)
    eng.add_request("long", llm.get_tokenizer().encode("Count to twenty: 1, 2,"), SamplingParams(max_tokens=40))
    done = None
    while done is None:
        for out in eng.step():
            if out.request_id == "stop" and out.finished:
                done = out
    assert "stop" not in eng.scheduler.requests
    assert all(r.request_id != "stop" for r in eng.scheduler.running)
    n_tokens = len(done.outputs[0].token_ids)
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id != "stop"
    assert len(done.outputs[0].token_ids) == n_tokens
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks - 1  # every page back (prefix cache included)


def test_async_abort(smollm_loaded):
    """An abort between steps ends the request at once; the others finish as without the switch."""
    stop = _stop_string(smollm_loaded)
    results = []
    for async_on in (False, True):
        streams, _ = _run(_llm(smollm_loaded, async_on), _requests(stop), abort_at={"plain": 4})
        results.append(streams)
    sync, asyn = results
    for rid in sync:
        if rid == "plain":
            for s in (sync, asyn):
                assert s[rid][-1].finished and s[rid][-1].outputs[0].finish_reason == "abort"
                assert len([o for o in s[rid] if o.finished]) == 1
            continue
        assert _final(sync[rid][-1]) == _final(asyn[rid][-1]), rid


@pytest.mark.parametrize("blocks", [24])
def test_async_preemption(smollm_loaded, blocks):
    """Few pages: requests are preempted and recomputed; outputs equal the synchronous engine's."""
    prompts = [f"Story number {i}: once upon a time in a land far away" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = []
    for async_on in (False, True):
        llm = _llm(smollm_loaded, async_on, num_gpu_blocks_override=blocks, max_num_seqs=8)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        preempted = llm.engine.scheduler.num_preemptions
        assert preempted > 0, "the case must preempt"
    assert outs[0] == outs[1]
