"""Invariant 1 end to end: greedy output is identical whatever the chunk size, batch composition,
prefix-cache hits or preemption (default model, float32, CPU reference backend)."""

from __future__ import annotations

import pytest

from tqserve import LLM, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

_TOPICS = [
    "the history of the printing press",
    "how bees communicate",
    "a recipe for bread",
    "the rules of chess",
    "why the sky is blue",
    "the water cycle",
    "the life of a lighthouse keeper",
    "how compilers work",
]


def mixed_prompts(n: int = 16) -> list[str]:
    """Prompts from a few words to a few hundred tokens, all different."""
    out = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        body = " ".join(f"Fact {j} about {topic} is worth noting." for j in range(i * i % 37))
        out.append(f"Question {i}: tell me about {topic}. {body} Answer:")
    return out


def generate(loaded, prompts, **kwargs) -> list[list[int]]:
    kwargs.setdefault("enable_prefix_caching", False)
    llm = LLM(loaded=loaded, dtype="float32", max_model_len=1024, **kwargs)
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference(smollm_loaded):
    """The plain path: every prompt alone, whole prompt in one step, no prefix cache."""
    prompts = mixed_prompts()
    return prompts, [generate(smollm_loaded, [p], max_num_batched_tokens=4096)[0][0] for p in prompts]


@pytest.mark.parametrize("budget", [7, 64, 4096])
def test_chunk_budget_invariance(smollm_loaded, reference, budget):
    prompts, expected = reference
    got, _ = generate(smollm_loaded, prompts, max_num_batched_tokens=budget)
    assert got == expected


def test_batched_equals_alone(smollm_loaded, reference):
    prompts, expected = reference
    got, _ = generate(smollm_loaded, prompts, max_num_batched_tokens=4096, max_num_seqs=16)
    assert got == expected


def test_prefix_cache_hits_change_nothing(smollm_loaded, reference, capsys):
    prompts, expected = reference
    llm = LLM(loaded=smollm_loaded, dtype="float32", max_model_len=1024, max_num_batched_tokens=256)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert first == expected
    stats0 = llm.engine.get_stats()
    # Second round: the same prompts again plus shared-prefix variants.
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert again == expected
    stats1 = llm.engine.get_stats()
    hits = stats1["prefix_cache_hits"] - stats0["prefix_cache_hits"]
    queries = stats1["prefix_cache_queries"] - stats0["prefix_cache_queries"]
    rate = hits / queries
    with capsys.disabled():
        print(f"\nprefix-cache hit rate, second round: {rate:.1%} ({hits}/{queries} tokens)")
    assert rate > 0.5
    variants = [p + " Please be brief." for p in prompts[8:]]
    alone = [generate(smollm_loaded, [v], max_num_batched_tokens=4096)[0][0] for v in variants]
    assert [o.outputs[0].token_ids for o in llm.generate(variants, GREEDY)] == alone


def test_preemption_changes_nothing(smollm_loaded, reference):
    prompts, expected = reference
    got, llm = generate(smollm_loaded, prompts, max_num_batched_tokens=512, num_gpu_blocks_override=40, max_num_seqs=16)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert got == expected
    assert llm.engine.get_stats()["num_free_blocks"] == 39
