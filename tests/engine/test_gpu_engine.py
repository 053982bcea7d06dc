"""GPU engine checks (run on the device): for each invariance configuration of the core tests
(chunk budgets, batching, prefix-cache hits, preemption), the Triton backend gives the same
greedy tokens as the torch reference backend, for bf16 pages and TurboQuant presets."""

from __future__ import annotations

import pytest
import torch
from test_invariance import GREEDY, mixed_prompts

from tqserve import LLM

pytestmark = pytest.mark.gpu

CONFIGS = {
    "chunk7": dict(max_num_batched_tokens=7),
    "chunk64": dict(max_num_batched_tokens=64),
    "chunk4096": dict(max_num_batched_tokens=4096),
    "prefix_hits": dict(max_num_batched_tokens=256, enable_prefix_caching=True),
    "preemption": dict(max_num_batched_tokens=512, num_gpu_blocks_override=40),
}


@pytest.fixture(scope="module")
def loaded_gpu():
    from tqserve.models.loader import load_model

    return load_model(None, torch.bfloat16, "cuda")


def run(loaded, prompts, backend, kv, cfg):
    kw = dict(enable_prefix_caching=False, max_num_seqs=16)
    kw.update(cfg)
    llm = LLM(
        loaded=loaded,
        device="cuda",
        dtype="bfloat16",
        attention_backend=backend,
        kv_cache_dtype=kv,
        max_model_len=1024,
        **kw,
    )
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    if kw["enable_prefix_caching"]:  # a second round served from the prefix cache
        first += [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    if "num_gpu_blocks_override" in kw:
        assert llm.engine.get_stats()["num_preemptions"] > 0
    return first, llm


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("kv", ["auto", "tq4", "turboquant_4bit_nc"])
def test_triton_matches_reference(loaded_gpu, kv, cfg):
    prompts = mixed_prompts()
    ref, _ = run(loaded_gpu, prompts, "reference", kv, CONFIGS[cfg])
    got, llm = run(loaded_gpu, prompts, "triton", kv, CONFIGS[cfg])
    assert type(llm.engine.runner.backend).__name__ == "TritonAttentionBackend"
    same = sum(a == b for a, b in zip(got, ref))
    assert got == ref, f"{same}/{len(ref)} sequences identical"
