"""Asynchronous output processing (`LLMEngine.async_output_proc`: step N's outputs are processed while
step N + 1 runs and returned one step later) and async scheduling (`LLMEngine.async_scheduling`: step
N + 1 is scheduled and launched before step N is read back, its decode tokens written on the device
from step N's samples). With either or both, every request must end exactly as on the plain engine
(tokens, text, finish and stop reasons, logprobs), each request's stream of outputs must be the same
sequence, and a request that a stop string, EOS or a stop id ends must not gain the token of the step
that was already running. Both switches are on for CUDA engines; here they are forced on the CPU,
where the same code runs (the device copies of deferred tokens included)."""

from __future__ import annotations

import pytest

from tqserve import LLM, SamplingParams

# (async output processing, async scheduling)
MODES = {"async-output": (True, False), "async-scheduling": (False, True), "both": (True, True)}


def _llm(loaded, mode: tuple[bool, bool], **kw) -> LLM:
    llm = LLM(loaded=loaded, device="cpu", dtype="float32", max_model_len=256, **kw)
    llm.engine.async_output_proc, llm.engine.async_scheduling = mode
    return llm


def _run(llm: LLM, requests: list[tuple[str, list[int], SamplingParams]], abort_at: dict[str, int] | None = None):
    """Add the requests, step until done; returns (per-request list of outputs in order, steps)."""
    eng = llm.engine
    for rid, ids, params in requests:
        eng.add_request(rid, ids, params, prompt=rid)
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
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks - 1  # every page back (prefix cache included)
    assert not any(r.num_pending_output for r in eng.scheduler.requests.values())
    return streams, steps


def _final(o) -> list[tuple]:
    """What must match exactly. Logprob values are compared apart (`_logprobs_close`): async scheduling
    changes which requests share a step (a finished request rides along once), and float32 GEMMs of
    other shapes round differently in the last bits; the tokens do not change."""
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            None if c.logprobs is None else [sorted(e) for e in c.logprobs],
        )
        for c in o.outputs
    ]


def _states(stream: list) -> list:
    states = []
    for o in stream:
        f = _final(o)
        if not states or states[-1] != f:
            states.append(f)
    return states


def _logprobs_close(a, b) -> bool:
    for ca, cb in zip(a.outputs, b.outputs):
        for ea, eb in zip(ca.logprobs or [], cb.logprobs or []):
            if any(abs(ea[t].logprob - eb[t].logprob) > 1e-4 for t in ea):
                return False
    return True


def _requests(tok, stop: str) -> list[tuple[str, list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12)

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)

    return [
        ("plain", tok.encode("The capital of France is"), greedy),
        ("short", tok.encode("Once upon a time"), SamplingParams(temperature=0.0, max_tokens=3)),
        ("stop", tok.encode("Write a list of fruits:"), SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])),
        ("logprobs", tok.encode("Hello, my name is"), SamplingParams(temperature=0.0, max_tokens=7, logprobs=3)),
        ("seeded", tok.encode("The weather today"), SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=9)),
        # chat answers end with EOS before max_tokens; min_tokens holds EOS off for a while
        ("eos", chat("Say hi."), SamplingParams(temperature=0.0, max_tokens=40)),
        ("eos-min", chat("Say hi."), SamplingParams(temperature=0.0, max_tokens=40, min_tokens=8)),
        ("stop-id", tok.encode("1, 2, 3,"), SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[28])),
        # penalties count every output token, the one still on the device included (`count_deferred_tokens`)
        ("penalty", tok.encode("Repeat after me: la la la"), SamplingParams(temperature=0.0, max_tokens=10,
                                                                           repetition_penalty=1.3)),
        ("freq", tok.encode("List: a, a, a,"), SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=0.8,
                                                             presence_penalty=0.4)),
        ("long", tok.encode("Tell me a story about a dragon. " * 6), SamplingParams(temperature=0.0, max_tokens=16)),
        # prompt logprobs are read back with their step; no step is scheduled ahead of one that has them
        ("prompt-lp", tok.encode("The quick brown fox jumps over the lazy dog and"),
         SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2)),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def stop_string(smollm_loaded) -> str:
    """A stop string the greedy continuation of the fruit prompt reaches after a few tokens."""
    llm = _llm(smollm_loaded, (False, False))
    text = llm.generate(["Write a list of fruits:"], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    assert len(text) > 30
    return text[12:16]


@pytest.fixture(scope="module")
def plain_run(smollm_loaded, stop_string):
    # a small token budget: the long prompt prefills in chunks while the others decode
    llm = _llm(smollm_loaded, (False, False), max_num_batched_tokens=24)
    return _run(llm, _requests(llm.get_tokenizer(), stop_string))


@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_equal_plain_engine(smollm_loaded, stop_string, plain_run, mode):
    plain, plain_steps = plain_run
    llm = _llm(smollm_loaded, MODES[mode], max_num_batched_tokens=24)
    got, steps = _run(llm, _requests(llm.get_tokenizer(), stop_string))
    assert plain.keys() == got.keys()
    for rid in plain:
        a, b = plain[rid], got[rid]
        assert a[-1].finished and b[-1].finished
        assert _final(a[-1]) == _final(b[-1]), rid
        assert _logprobs_close(a[-1], b[-1]), rid
        pa, pb = a[-1].prompt_logprobs, b[-1].prompt_logprobs
        assert (pa is None) == (pb is None) and [sorted(e or {}) for e in pa or []] == [
            sorted(e or {}) for e in pb or []
        ]
        for ea, eb in zip(pa or [], pb or []):
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea or {}), rid
        # the same stream of states, in the same order (one output per step; with async scheduling a
        # long prompt's chunks may split differently, a request about to finish taking a token of the
        # budget once more, so the outputs of prefill chunks without a new token are not counted)
        assert _states(a) == _states(b), rid
    # the cases mean what they say
    outs = {rid: plain[rid][-1].outputs[0] for rid in plain}
    assert outs["stop"].finish_reason == "stop" and outs["stop"].stop_reason == stop_string
    assert outs["eos"].finish_reason == "stop" and len(outs["eos"].token_ids) < 40
    assert len(outs["eos-min"].token_ids) >= 8
    assert outs["stop-id"].stop_reason == 28 and len(outs["stop-id"].token_ids) < 30
    assert len(plain["prompt-lp"][-1].prompt_logprobs) == len(plain["prompt-lp"][-1].prompt_token_ids)
    if mode == "async-output":
        assert steps == plain_steps + 1  # the last call only processes the outputs of the one before
    if MODES[mode][1]:
        assert llm.engine.runner.builder.deferred.np.any(), "no step ran with deferred tokens"


@pytest.mark.parametrize("mode", ["both"])
def test_stopped_request_leaves_the_batch(smollm_loaded, stop_string, mode):
    """The step running when a stop string is found still computes the stopped request; its token is
    dropped and the request is no longer scheduled or held by the scheduler."""
    llm = _llm(smollm_loaded, MODES[mode])
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_string])
    eng.add_request("stop", llm.get_tokenizer().encode("Write a list of fruits:"), params)
    eng.add_request("long", llm.get_tokenizer().encode("Count to twenty: 1, 2,"), SamplingParams(max_tokens=20))
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
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks - 1


@pytest.mark.parametrize("mode", ["both"])
def test_abort(smollm_loaded, stop_string, mode):
    """An abort between steps ends the request at once; the others finish as on the plain engine."""
    results = []
    for m in ((False, False), MODES[mode]):
        llm = _llm(smollm_loaded, m)
        streams, _ = _run(llm, _requests(llm.get_tokenizer(), stop_string), abort_at={"plain": 4, "seeded": 2})
        results.append(streams)
    plain, got = results
    for rid in plain:
        if rid in ("plain", "seeded"):
            for s in (plain, got):
                assert s[rid][-1].finished and {o.finish_reason for o in s[rid][-1].outputs} == {"abort"}
                assert len([o for o in s[rid] if o.finished]) == 1
            continue
        assert _final(plain[rid][-1]) == _final(got[rid][-1]), rid


@pytest.mark.parametrize("mode", ["both"])
def test_preemption_and_prefix_hits(smollm_loaded, mode):
    """Few pages: requests are preempted (some while their token is being sampled) and recomputed; a
    second round hits the prefix cache. Outputs equal the plain engine's."""
    prompts = [f"Story number {i}: once upon a time in a land far away" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=28)
    outs = []
    for m in ((False, False), MODES[mode]):
        llm = _llm(smollm_loaded, m, num_gpu_blocks_override=24, max_num_seqs=8)
        rounds = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
        assert rounds[0] == rounds[1]
        outs.append(rounds[0])
        assert llm.engine.scheduler.num_preemptions > 0, "the case must preempt"
        assert llm.engine.kv.prefix_hits > 0
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.5),
     SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.5)],
)  # fmt: skip
def test_penalties_scheduled_ahead(smollm_loaded, params):
    """Steps of requests with penalties are scheduled ahead too: the token the step in flight samples
    is counted on the device. A prompt that invites repetition makes the penalties change the greedy
    tokens, and the tokens equal the plain engine's; without the device count they do not."""
    prompt = [{"prompt_token_ids": smollm_loaded[2].encode("Say it again and again: yes yes yes yes yes")}]
    outs, ahead = [], []
    for mode in ((False, False), MODES["both"]):
        llm = _llm(smollm_loaded, mode)
        eng = llm.engine
        eng.runner.launch = lambda *a, _launch=eng.runner.launch, **kw: (
            ahead.append(kw.get("prev") is not None),
            _launch(*a, **kw),
        )[1]
        outs.append(llm.generate(prompt, params)[0].outputs[0].token_ids)
    unpenalized = _llm(smollm_loaded, (False, False)).generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))
    assert unpenalized[0].outputs[0].token_ids != outs[0], "the penalties must matter for this prompt"
    assert sum(ahead) > 10, "steps were not scheduled ahead"
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_gpu_async_equals_plain():
    """On the GPU (CUDA graphs, pinned read-backs, deferred tokens copied on the device): the float32
    model's greedy tokens with both switches equal the plain engine's. Requests end by length only,
    which the scheduler predicts, so both engines run the same batches and every token must match."""
    import torch

    from tqserve.models.default_model import default_model_path
    from tqserve.models.loader import load_gguf_file

    # load_model serves bfloat16 on CUDA; float32 (the smallest rounding) loads the file directly
    loaded = load_gguf_file(default_model_path(), torch.float32, torch.device("cuda"))
    tok = loaded[2]
    prompts = [tok.encode(f"Item {i}: the history of the number {i * 7} is") for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(12)]
    outs = []
    for mode in ((False, False), (True, True)):
        # a bounded cache, as the other GPU engine tests take: 90% of the card would starve parallel workers
        kw = dict(max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=1 << 28)
        llm = LLM(loaded=loaded, device="cuda", dtype="float32", **kw)
        llm.engine.async_output_proc, llm.engine.async_scheduling = mode
        outs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
        if mode[1]:
            assert llm.engine.runner.builder.deferred.host.any()
        del llm
    assert outs[0] == outs[1]


def test_window_preset_multi_turn(smollm_loaded, monkeypatch):
    """tq3 keeps an exact window, snapshotted at block boundaries while decoding for prefix hits. With
    async scheduling a decode step ending on a boundary is scheduled before its last token is known:
    its snapshot slot is reserved then and named by the block's hash once the token is read back
    (`WindowSnapshots.reserve` / `key`). Tokens, prefix hits and snapshot hits equal the plain
    engine's over a multi-turn chat."""
    from tqserve.core.window_snapshots import WindowSnapshots

    reserved = []
    reserve = WindowSnapshots.reserve

    def counting(self, request_id, boundary):
        slot = reserve(self, request_id, boundary)
        reserved.append(slot)
        return slot

    monkeypatch.setattr(WindowSnapshots, "reserve", counting)
    results = []
    for mode in ((False, False), MODES["both"]):
        llm = _llm(smollm_loaded, mode, kv_cache_dtype="tq3", max_num_batched_tokens=64)
        tok = llm.get_tokenizer()
        conv = [tok.encode(f"Tell me about the number {i}. It is") for i in (3, 7)]
        answers = []
        for turn in range(2):  # the second turn resumes from the first one's decode snapshots
            params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": c} for c in conv], params)
            answers.append([o.outputs[0].token_ids for o in outs])
            conv = [c + a + tok.encode(f" And then {turn}?") for c, a in zip(conv, answers[-1])]
        kv = llm.engine.kv
        results.append((answers, kv.prefix_hits, kv.snapshot_hits))
        assert not kv.snaps.unkeyed  # every reservation named or released
        if not mode[1]:
            assert not reserved  # the plain engine knows every token it snapshots
    assert results[0] == results[1]
    assert results[0][2] > 0, "the chat must hit window snapshots"
    assert any(slot is not None for slot in reserved), "async scheduling must reserve decode snapshots"
