"""Invariance of a hybrid model (Qwen3-Next tiny: GDN + gated attention + MoE) through the engine:
greedy output identical whatever the chunk budget, batch composition, prefix-cache hits (state
checkpoints restored) or preemption (states rebuilt from zero), and with a TurboQuant preset on the
attention layers across chunk budgets. float32, CPU reference backend."""

from __future__ import annotations

import hybrid_factory as hf
import pytest
import torch

from tqserve import LLM, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENGTHS = [3, 70, 17, 41, 9, 100, 33, 5]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import model_factory

    hf_model = hf.make_hf_model("qwen3_next", seed=5)
    path = hf.write_checkpoint(hf_model, str(tmp_path_factory.mktemp("hybrid_engine")))
    model_factory.make_tiny_tokenizer().save_pretrained(path)
    prompts = [
        torch.randint(0, hf.VOCAB, (n,), generator=torch.Generator().manual_seed(100 + n)).tolist() for n in LENGTHS
    ]
    return path, hf_model, prompts


def run(path, prompts, **kwargs):
    kwargs.setdefault("enable_prefix_caching", False)
    kwargs.setdefault("max_num_batched_tokens", 4096)
    llm = LLM(model=path, dtype="float32", max_model_len=256, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def expected(ckpt):
    """Each prompt alone, whole prompt in one step; checked against transformers' greedy output."""
    path, hf_model, prompts = ckpt
    out = [run(path, [p])[0][0] for p in prompts]
    hf_model.generation_config.eos_token_id = None
    for p, toks in zip(prompts[:3], out[:3]):
        ref = hf_model.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
        assert toks == ref[0, len(p) :].tolist()
    return out


@pytest.mark.parametrize("budget", [5, 64, 4096])
def test_chunk_budget_and_batching(ckpt, expected, budget):
    path, _, prompts = ckpt
    assert run(path, prompts, max_num_batched_tokens=budget, max_num_seqs=8)[0] == expected


def test_prefix_cache_hits(ckpt, expected):
    path, _, prompts = ckpt
    llm = LLM(
        model=path, dtype="float32", max_model_len=256, enable_prefix_caching=True,
        max_num_batched_tokens=64, mamba_checkpoint_interval=16,
    )  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)] == expected
    before = llm.engine.get_stats()
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)] == expected
    after = llm.engine.get_stats()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    # Shared prefixes with new tails: resume from a state checkpoint, then diverge.
    tails = [p + [7, 8, 9, 10, 11] for p in prompts[1::2]]
    alone = [run(path, [t])[0][0] for t in tails]
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": t} for t in tails], GREEDY)] == alone


def test_preemption(ckpt, expected):
    path, _, prompts = ckpt
    got, llm = run(
        path,
        prompts,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=16,
        max_num_seqs=8,
    )
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert got == expected


def test_turboquant_preset_chunk_invariance(ckpt):
    path, _, prompts = ckpt
    prompts = prompts[:4]  # the TurboQuant reference codec is slow on CPU
    whole = run(path, prompts, kv_cache_dtype="tq4", max_num_batched_tokens=4096)[0]
    chunked = run(path, prompts, kv_cache_dtype="tq4", max_num_batched_tokens=5)[0]
    assert chunked == whole


def test_multi_turn_chat_hits_state_checkpoints(ckpt, capsys):
    """Each turn's prompt is the previous conversation (prompt + answer) plus a new message: the
    state checkpoint at the previous prompt's last full block gives hits, and the answers equal a
    run without prefix caching."""
    path, _, prompts = ckpt
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    cached = LLM(model=path, dtype="float32", max_model_len=256, enable_prefix_caching=True, max_num_batched_tokens=64)
    plain = LLM(model=path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    conv = list(prompts[5][:40])
    for turn in range(4):
        a = cached.generate([{"prompt_token_ids": conv}], params)[0].outputs[0].token_ids
        b = plain.generate([{"prompt_token_ids": conv}], params)[0].outputs[0].token_ids
        assert a == b, turn
        conv = conv + a + [11 + turn, 12 + turn, 13 + turn]  # the answer, then the next user message
    stats = cached.engine.get_stats()
    rate = stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
    with capsys.disabled():
        print(f"\nhybrid multi-turn prefix-cache hit rate: {rate:.1%} over 4 turns")
    assert rate > 0.4


def test_async_scheduling_multi_turn(ckpt):
    """Async output processing and async scheduling forced on (the CUDA defaults): multi-turn chats with
    prefix caching and state checkpoints every block give the tokens and the cache hits of the plain
    engine. A decode step that would save a checkpoint keyed by a token still on its way back waits
    for it (`KVCacheManager.needs_known_tokens`), so the same checkpoints are taken."""
    path, _, prompts = ckpt
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = []
    for mode in ((False, False), (True, True)):
        llm = LLM(
            model=path, dtype="float32", max_model_len=256, enable_prefix_caching=True, max_num_batched_tokens=64,
            mamba_checkpoint_interval=16,
        )  # fmt: skip
        llm.engine.async_output_proc, llm.engine.async_scheduling = mode
        conv = [list(p[:30]) for p in prompts[3:6]]
        answers = []
        for turn in range(3):
            outs = llm.generate([{"prompt_token_ids": c} for c in conv], params)
            answers.append([o.outputs[0].token_ids for o in outs])
            conv = [c + a + [11 + turn, 12 + turn] for c, a in zip(conv, answers[-1])]
        results.append((answers, llm.engine.kv.prefix_hits, llm.engine.kv.prefix_queries))
    assert results[0] == results[1]
    assert results[0][1] > 0
