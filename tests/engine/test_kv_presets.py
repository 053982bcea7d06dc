"""Every KV preset through the engine (default model, float32, CPU reference backend)."""

from __future__ import annotations

import pytest
import torch

from tqserve import LLM, SamplingParams
from tqserve.kvquant.presets import ALL_PRESETS, describe_preset

PROMPT = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 14  # ~240 tokens, > window
# Upper bounds on mean KL vs the exact cache over the prompt (measured values are 3-10x lower):
# they catch a broken codec or a format the engine reads wrongly, not small quality changes.
KL_BOUND = {
    "bfloat16": 1e-3,  # exact pages in the model dtype
    "fp8": 0.02,
    "turboquant_k8v4": 0.05,
    "turboquant_4bit_nc": 0.3,
    "turboquant_k3v4_nc": 0.6,
    "turboquant_3bit_nc": 1.0,
    "tq4": 0.1,
    "tq3": 0.3,
    "tq4s": 0.1,
    "tq3s": 0.3,
}


def _llm(loaded, preset, **kw):
    kw.setdefault("max_num_batched_tokens", 4096)
    return LLM(
        loaded=loaded, dtype="float32", kv_cache_dtype=preset, max_model_len=1024, enable_prefix_caching=False, **kw
    )


@pytest.fixture(scope="module")
def prompt_ids(smollm_loaded):
    return smollm_loaded[2].encode(PROMPT)


@pytest.fixture(scope="module")
def exact_logprobs(smollm_loaded, prompt_ids):
    return _llm(smollm_loaded, "auto").prompt_logprobs_full(prompt_ids)


@pytest.mark.parametrize("preset", [p for p in ALL_PRESETS if p != "auto"])
def test_preset_runs_and_stays_close(smollm_loaded, prompt_ids, exact_logprobs, preset):
    llm = _llm(smollm_loaded, preset)
    fmt = llm.engine.runner.formats[3]
    hkv, d = fmt.num_kv_heads, fmt.head_dim
    assert fmt.page_bytes_per_token() == describe_preset(preset, d)["page_bytes_per_token_head"] * hkv
    lp = llm.prompt_logprobs_full(prompt_ids)
    kl = (exact_logprobs.exp() * (exact_logprobs - lp)).sum(-1).mean().item()
    assert kl < KL_BOUND[preset], (preset, kl)
    assert kl > 0 or preset == "bfloat16"  # the preset really quantizes what attention reads


def test_window_preset_is_chunking_invariant(smollm_loaded, prompt_ids):
    """tq4 keeps an exact window of 128: greedy output must not depend on the prefill chunk size."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for budget in (4096, 37):
        llm = _llm(smollm_loaded, "tq4", max_num_batched_tokens=budget)
        outs.append(llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_skip_all_layers_is_exact(smollm_loaded, prompt_ids, exact_logprobs):
    n = len(smollm_loaded[0].kv_layer_specs())
    llm = _llm(smollm_loaded, "turboquant_3bit_nc", kv_cache_dtype_skip_layers=list(range(n)))
    assert torch.allclose(llm.prompt_logprobs_full(prompt_ids), exact_logprobs, atol=1e-4)
