"""Greedy generation of 64 tokens for 8 prompts equals transformers' greedy `generate` (float32, CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from tqserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Explain photosynthesis in one sentence:",
    "List three prime numbers:",
    "import numpy as np\nx = np.",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from tqserve.models.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    )
    return model.eval()


def test_greedy_matches_transformers(smollm_loaded, hf_model):
    tok = smollm_loaded[2]
    llm = LLM(loaded=smollm_loaded, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            # No EOS for either side: ignore_eos lets our engine emit EOS and go on; transformers
            # does the same when it knows no EOS (min_new_tokens would ban EOS instead).
            ref = hf_model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == ref[0, ids.shape[1] :].tolist(), prompt
