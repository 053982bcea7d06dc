"""Every KV preset keeps the engine's invariances (issue 3): greedy tokens do not depend on the
prefill chunk budget (7 vs 4096), on prefix-cache hits, or on being batched with other requests.
Default model, float32, CPU (torch backend: the reference for prefill chunks and window presets,
the batched path for decode)."""

from __future__ import annotations

import pytest

from tqserve import LLM, SamplingParams
from tqserve.kvquant.presets import ALL_PRESETS

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Shared ~150-token prefix (longer than any preset's sink + window, so packed pages are read) and
# different tails; the first prompt is short (all of it inside the exact window).
PREFIX = "Alice was beginning to get very tired of sitting by her sister on the bank. " * 8
PROMPTS = ["Hello there, how are", PREFIX + "Then the White Rabbit", PREFIX + "Down, down, down. Would the fall"]


def _run(loaded, preset: str, prompts, **kw) -> list[list[int]]:
    kw.setdefault("max_num_batched_tokens", 4096)
    kw.setdefault("enable_prefix_caching", False)
    llm = LLM(loaded=loaded, dtype="float32", kv_cache_dtype=preset, max_model_len=512, max_num_seqs=4, **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    if kw["enable_prefix_caching"]:
        # Second round: every prompt is served from cached pages (and recomputes its exact window).
        out2 = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.engine.get_stats()["prefix_cache_hits"] > 0
        assert out2 == out
    return out


# Known failure, kept visible (strict: a fix turns it into an error to be removed from here). On a
# prefix-cache hit a window preset recomputes the last W cached positions (the design); the
# first of them attend to keys just before the resume point, which they saw exact the first time
# but which now exist only as pages (the ring is filled from the decoded pages, see
# KVCacheStore.fill_ring_from_pages). Their outputs differ in the last bits, and with tq4s's
# 3-bit values this prompt's sixth greedy token flips. Bit-identical hits would need the exact
# window cached with the prefix.
KNOWN_VARIANT = {"tq4s": "prefix-cache hit: positions before the resume point are read from pages, not exact"}


@pytest.mark.parametrize(
    "preset",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN_VARIANT[p])) if p in KNOWN_VARIANT else p
        for p in ALL_PRESETS
        if p != "auto"
    ],
)
def test_preset_invariances(smollm_loaded, preset):
    base = _run(smollm_loaded, preset, PROMPTS)
    assert _run(smollm_loaded, preset, PROMPTS, max_num_batched_tokens=7) == base, "chunk budget 7"
    assert _run(smollm_loaded, preset, PROMPTS, enable_prefix_caching=True) == base, "prefix caching"
    alone = [_run(smollm_loaded, preset, [p])[0] for p in PROMPTS[1:]]
    assert alone == base[1:], "alone vs batched"
