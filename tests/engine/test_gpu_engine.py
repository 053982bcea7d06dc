"""GPU engine checks (run on the device): for each invariance configuration of the core tests
(chunk budgets, batching, prefix-cache hits, preemption), the Triton backend gives the same
greedy tokens as the torch reference backend, for bf16 pages and TurboQuant presets, with the
model in bfloat16 (the serving dtype) and in float32 (where attention rounding is smallest).

What holds: the float32 model on unquantized pages, every configuration, up to floating-point
near-ties (H100; docs/benchmarks.md): a sequence may take the other of two tokens whose logprobs
are within NEAR_TIE nats in a clean run, which `near_tie_report` measures for every divergence
(bf16 page rounding turns ~1e-6 differences into whole bf16 steps now and then; the sixteenth
session saw one such sequence, 0.004 nats apart). The float32 model on the needle preset's
TurboQuant pages (`tq_k5v3_ncs_s4_w44+v4@7.17.23`: packed keys and values beyond a sink of 4 and a
window of 44) holds in all five configurations (H200, thirty-ninth session), as tq4 (window 32) did
on the H100. What does not hold and is expected to fail here: the bfloat16 model (logit ties), and
turboquant_4bit_nc, the preset without an exact window, so even a token's nearest keys are read
packed: the store writes the reference's bytes for the same inputs and the kernels agree with the
reference to ~1e-6 (test_gpu_backend_agreement.py), but those 1e-6 differences reach the next
layer's K / V, where a quantization boundary turns them into a different index now and then, which
moves logits by far more than a near-tie. benchmarks/engine_gpu.sh runs the subset that holds by default."""

from __future__ import annotations

import pytest
import torch
from test_invariance import GREEDY, mixed_prompts

from tqserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

CONFIGS = {
    "chunk7": dict(max_num_batched_tokens=7),
    "chunk64": dict(max_num_batched_tokens=64),
    "chunk4096": dict(max_num_batched_tokens=4096),
    "prefix_hits": dict(max_num_batched_tokens=256, enable_prefix_caching=True),
    "preemption": dict(max_num_batched_tokens=512, num_gpu_blocks_override=40),
}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def loaded_gpu(request):
    from tqserve.models.default_model import default_model_path
    from tqserve.models.loader import load_gguf_file

    # load_model allows only bfloat16 on CUDA; the float32 comparison loads the file directly.
    dtype = getattr(torch, request.param)
    return request.param, load_gguf_file(default_model_path(), dtype, torch.device("cuda"))


def run(loaded, prompts, backend, kv, cfg):
    dtype, model = loaded
    kw = dict(enable_prefix_caching=False, max_num_seqs=16, kv_cache_memory_bytes=1 << 30)
    kw.update(cfg)
    llm = LLM(
        loaded=model, device="cuda", dtype=dtype, attention_backend=backend, kv_cache_dtype=kv, max_model_len=1024, **kw
    )
    outs = llm.generate(prompts, GREEDY)
    if kw["enable_prefix_caching"]:  # a second round served from the prefix cache
        outs += llm.generate(prompts, GREEDY)
        assert llm.engine.get_stats()["prefix_cache_hits"] > 0
        if any(f.window for f in llm.engine.runner.formats):  # hits restore exact-window snapshots
            assert llm.engine.get_stats()["window_snapshot_hits"] > 0
    if "num_gpu_blocks_override" in kw:
        assert llm.engine.get_stats()["num_preemptions"] > 0
    backend_name = type(llm.engine.runner.backend).__name__
    del llm
    torch.cuda.empty_cache()
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs], backend_name


# A divergence counts as a floating-point near-tie when, in a clean run of the prompt plus the common
# prefix (no chunking, no preemption), the two tokens are within this many nats in the reference
# backend's logprobs. H100, sixteenth session: the float32 model on bf16 pages with preemption diverged
# in 1 of 16 sequences where the top two were 0.004 nats apart (-2.5522 / -2.5563), and the reference
# backend itself picks the other token there without preemption; bf16 page rounding turns ~1e-6
# differences of a recomputed K / V into whole bf16 steps now and then.
NEAR_TIE = 0.02


def near_tie_report(loaded, kv, ref, got) -> tuple[list[str], list[str]]:
    """(near ties, other divergences) of the sequences whose greedy tokens differ, judged at their
    first differing position from both backends' top-5 logprobs in a clean run."""
    dtype, model = loaded
    probes = []
    for (prompt, r), (_, g) in zip(ref, got):
        if r != g:
            j = next(j for j, (a, b) in enumerate(zip(r, g)) if a != b)
            probes.append((prompt + r[:j], j, r[j], g[j]))
    tops = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            loaded=model, device="cuda", dtype=dtype, attention_backend=backend, kv_cache_dtype=kv,
            max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=1 << 30,
        )  # fmt: skip
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids, *_ in probes], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        )
        tops[backend] = [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
        del llm
        torch.cuda.empty_cache()
    ties, others = [], []
    for (_, j, r, g), lr, lt in zip(probes, tops["reference"], tops["triton"]):
        desc = f"token {j}: reference {r} / triton {g}; logprobs of the two: reference {lr.get(r)} / {lr.get(g)}"
        desc += f", triton {lt.get(r)} / {lt.get(g)}"
        tie = r in lr and g in lr and abs(lr[r] - lr[g]) <= NEAR_TIE
        (ties if tie else others).append(desc)
    return ties, others


class DivergedFromReference(AssertionError):
    """Greedy tokens that differ from the reference backend's beyond near-ties."""


# What the module docstring says does not hold, with why (kept running: xfail, not strict, and only for
# the divergence itself: a crash, another backend or a failed stats check still fails these cases)
BF16_DIVERGENT = "bfloat16 model: logit ties and bf16 page rounding move greedy tokens"
EXPECTED_DIVERGENT = {
    "turboquant_4bit_nc": "no exact window: ~1e-6 differences flip a packed index of the next layer's K / V",
}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("kv", ["auto", "bfloat16", "tq4", "turboquant_4bit_nc", "tq_k5v3_ncs_s4_w44+v4@7.17.23"])
def test_triton_matches_reference(loaded_gpu, kv, cfg, request):
    if loaded_gpu[0] == "bfloat16" or kv in EXPECTED_DIVERGENT:
        # run and reported (a pass shows as XPASS), not counted as a failure: see the module docstring
        reason = EXPECTED_DIVERGENT.get(kv, BF16_DIVERGENT)
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False, raises=DivergedFromReference))
    prompts = mixed_prompts()
    ref, _ = run(loaded_gpu, prompts, "reference", kv, CONFIGS[cfg])
    got, name = run(loaded_gpu, prompts, "triton", kv, CONFIGS[cfg])
    assert name == "TritonAttentionBackend"
    same = sum(a == b for a, b in zip(got, ref))
    tokens = sum(len(r) for _, r in ref)
    agree = sum(x == y for (_, a), (_, b) in zip(got, ref) for x, y in zip(a, b))
    print(f"\n{loaded_gpu[0]} kv={kv} {cfg}: {same}/{len(ref)} sequences, {agree}/{tokens} tokens identical")
    if got != ref:
        # Every divergence must be a measured floating-point near-tie; anything else is a bug.
        ties, others = near_tie_report(loaded_gpu, kv, ref, got)
        for t in ties:
            print(f"  near tie, {t}")
        if others:
            msg = f"{same}/{len(ref)} sequences identical; divergences that are not near-ties: {others}"
            raise DivergedFromReference(msg)
