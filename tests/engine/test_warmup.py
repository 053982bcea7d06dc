"""The kernel warm-up (run at startup on CUDA) writes throw-away steps into pages, sequence and
sink slots and the recurrent state pool; a request served afterwards must not see any of it. Run on
the CPU by calling the warm-up directly, then compared token for token with a fresh engine."""

from __future__ import annotations

import hybrid_factory as hf
import model_factory
import pytest
import torch

from tqserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _outputs(path, kv: str, warm: bool, prompts) -> list[list[int]]:
    # the CPU whatever the machine has: float32 models run there (a GPU engine serves 16-bit ones)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_dtype=kv, max_num_seqs=4)
    if warm:
        llm.engine.runner._warmup_kernels()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kv", ["auto", "tq4"])
def test_warmup_leaves_no_trace_dense(tmp_path, kv):
    model_factory.write_tiny_checkpoint(str(tmp_path), "llama")
    prompts = [{"prompt_token_ids": [(7 + 31 * i + 17 * j) % 200 for j in range(n)]} for i, n in enumerate((3, 40, 70))]
    assert _outputs(str(tmp_path), kv, True, prompts) == _outputs(str(tmp_path), kv, False, prompts)


def test_warmup_leaves_no_trace_hybrid(tmp_path):
    path = hf.write_checkpoint(hf.make_hf_model("qwen3_next", seed=5), str(tmp_path / "m"))
    model_factory.make_tiny_tokenizer().save_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, hf.VOCAB, (n,), generator=gen).tolist()} for n in (3, 70, 17)]
    assert _outputs(path, "tq4", True, prompts) == _outputs(path, "tq4", False, prompts)


@pytest.mark.parametrize(
    "kv,heads,d",
    [
        ("auto", (9, 3), 64),  # SmolLM2's attention shape
        ("turboquant_4bit_nc", (9, 3), 64),
        ("tq4", (9, 3), 64),  # sink + window, rotated values
        ("turboquant_4bit_nc", (16, 4), 128),  # sliced decode kernel
        ("tq3", (16, 4), 128),
    ],
)
def test_warmup_compiles_every_kernel_a_long_batch_needs(tmp_path, monkeypatch, kv, heads, d):
    """After the startup warm-up, prefilling and decoding a batch of long prompts (chunked prefill,
    split-K and plain decode) needs no Triton binary that the warm-up did not already build. Kernels
    are not run: `LaunchRecorder` records each launch's compile key (constexprs, dtypes, alignment,
    integer classes, warps) the way Triton does, with an H100's SM count for the split-K choice."""
    from launch_recorder import LaunchRecorder

    from tqserve.attention import paged, paged_decode, paged_extend

    for mod in (paged, paged_decode, paged_extend):
        monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
    hq, hkv = heads
    # A narrow residual stream (a multiple of 16, as real models have: Triton specializes on it); the attention
    # shapes are what the kernels see. At hidden_size = hq * d the bf16 projections of the long batch cost ~4 min
    # a case on a CPU without AVX-512, ~45 s now.
    model_factory.write_tiny_checkpoint(
        str(tmp_path), "llama", hidden_size=16 * hq, head_dim=d, num_attention_heads=hq, num_key_value_heads=hkv,
        max_position_embeddings=4096, intermediate_size=128,
    )  # fmt: skip
    with LaunchRecorder() as rec:
        llm = LLM(
            str(tmp_path), dtype="bfloat16", max_model_len=2100, kv_cache_dtype=kv, max_num_seqs=32,
            attention_backend="triton", kv_cache_memory_bytes=1 << 29, max_num_batched_tokens=1024,
        )  # fmt: skip
        llm.engine.runner._warmup_kernels()
        warm = rec.take()
        assert warm, "the warm-up launched no kernel"
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        for i in range(32):
            llm.engine.add_request(f"r{i}", [(7 + 31 * i + 17 * j) % 200 for j in range(2048 - 37 * i)], params)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        new = rec.take() - warm
    assert not new, f"{len(new)} kernel specializations first needed after the warm-up: {sorted(new, key=str)[:2]}"
