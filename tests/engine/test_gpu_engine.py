"""GPU engine checks (run on the device): the Triton backend gives the reference backend's greedy
tokens, and the invariance tests of the core hold with it, for bf16 pages and a TurboQuant preset."""

from __future__ import annotations

import pytest
import torch

from tqserve import LLM
from test_invariance import GREEDY, mixed_prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def loaded_gpu():
    from tqserve.models.loader import load_model

    return load_model(None, torch.bfloat16, "cuda")


def run(loaded, prompts, backend="triton", kv="auto", **kw):
    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("max_num_seqs", 16)
    llm = LLM(
        loaded=loaded, device="cuda", dtype="bfloat16", attention_backend=backend, kv_cache_dtype=kv, max_model_len=1024, **kw
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


@pytest.mark.parametrize("kv", ["auto", "tq4", "turboquant_4bit_nc"])
def test_triton_matches_reference(loaded_gpu, kv):
    prompts = mixed_prompts()
    ref, _ = run(loaded_gpu, prompts, backend="reference", kv=kv, max_num_batched_tokens=4096)
    for budget in (7, 64, 4096):
        got, llm = run(loaded_gpu, prompts, kv=kv, max_num_batched_tokens=budget)
        assert type(llm.engine.runner.backend).__name__ != "ReferenceBackend"
        assert got == ref, f"kv={kv} budget={budget}"


@pytest.mark.parametrize("kv", ["auto", "tq4"])
def test_triton_invariance(loaded_gpu, kv):
    prompts = mixed_prompts()
    alone = [run(loaded_gpu, [p], kv=kv, max_num_batched_tokens=4096)[0][0] for p in prompts]
    batched, _ = run(loaded_gpu, prompts, kv=kv, max_num_batched_tokens=64)
    assert batched == alone
    cached, llm = run(loaded_gpu, prompts, kv=kv, max_num_batched_tokens=256, enable_prefix_caching=True)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert cached == alone and again == alone
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    small, llm = run(loaded_gpu, prompts, kv=kv, max_num_batched_tokens=512, num_gpu_blocks_override=40)
    assert llm.engine.get_stats()["num_preemptions"] > 0
    assert small == alone
