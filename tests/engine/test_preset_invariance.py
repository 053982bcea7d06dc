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
        stats = llm.engine.get_stats()
        assert stats["prefix_cache_hits"] > 0
        if any(f.window for f in llm.engine.runner.formats):
            # Window presets resume from exact-window snapshots cached with the prefix.
            assert stats["window_snapshot_hits"] > 0
        assert out2 == out
    return out


# Known failures, kept visible (strict: a fix turns one into an error to be removed from here).
# tq4s after a prefix-cache hit was one until exact-window snapshots were cached with the prefix:
# recomputing the window from decoded pages flipped its sixth greedy token here. With
# num_window_snapshots=0 that fallback path is still taken (test_prefix_hit_without_snapshots_recomputes).
KNOWN_VARIANT: dict[str, str] = {}
# The per-layer preset that meets the needle goal on this model (docs/kv-quality.md): window bytes
# spent on 4-bit values in three layers.
NEEDLE_PRESET = "tq_k5v3_ncs_s4_w44+v4@7.17.23"


@pytest.mark.parametrize(
    "preset",
    [
        pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=KNOWN_VARIANT[p])) if p in KNOWN_VARIANT else p
        for p in ALL_PRESETS
        if p != "auto"
    ]
    + [NEEDLE_PRESET],
)
def test_preset_invariances(smollm_loaded, preset):
    base = _run(smollm_loaded, preset, PROMPTS)
    assert _run(smollm_loaded, preset, PROMPTS, max_num_batched_tokens=7) == base, "chunk budget 7"
    assert _run(smollm_loaded, preset, PROMPTS, enable_prefix_caching=True) == base, "prefix caching"
    alone = [_run(smollm_loaded, preset, [p])[0] for p in PROMPTS[1:]]
    assert alone == base[1:], "alone vs batched"


def test_prefix_hit_without_snapshots_recomputes(smollm_loaded):
    """With the snapshot pool off, a hit recomputes the window after filling the ring from decoded
    pages (the fallback path; close to, not bit-identical with, the first computation)."""
    llm = LLM(
        loaded=smollm_loaded,
        dtype="float32",
        kv_cache_dtype="tq4s",
        max_model_len=512,
        max_num_seqs=4,
        enable_prefix_caching=True,
        num_window_snapshots=0,
    )
    sched = llm.engine.scheduler
    fills, restores, schedule = [], [], sched.schedule

    def spy():
        out = schedule()
        fills.extend(out.ring_fills)
        restores.extend(out.ring_restores)
        return out

    sched.schedule = spy
    for _ in range(2):
        outs = llm.generate(PROMPTS[1:], GREEDY)
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0
    assert fills and not restores and llm.engine.kv.snaps is None
