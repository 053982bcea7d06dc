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
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_dtype=kv, max_num_seqs=4)
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
