"""The hybrid model through the engine on CUDA (fla prefill chunks + Triton GDN decode + the engine's
CUDA attention backend), float32: equal to the CPU reference path, whatever the chunk budget, with
decode steps replaying CUDA graphs and with `enforce_eager`."""

from __future__ import annotations

import importlib.util

import hybrid_factory as hf
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core"),
]


def test_engine_cuda_matches_cpu_reference(tmp_path):
    import model_factory

    from tqserve import LLM, SamplingParams

    path = hf.write_checkpoint(hf.make_hf_model("qwen3_next", seed=5, linear_key_head_dim=16), str(tmp_path / "m"))
    model_factory.make_tiny_tokenizer().save_pretrained(path)
    prompts = [
        torch.randint(0, hf.VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 70, 17, 130)
    ]
    expected = hf.Driver(hf.load_tqserve_model(path)).generate(prompts, max_new=12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from tqserve.tokenizer import Tokenizer

    # The engine's loader allows only bfloat16 on CUDA; hand it a float32 model directly.
    model = hf.load_tqserve_model(path, device="cuda")
    loaded = (model, model.config, Tokenizer.from_pretrained(path))
    for budget, eager in ((5, False), (4096, False), (4096, True)):
        llm = LLM(
            loaded=loaded,
            dtype="float32",
            max_model_len=256,
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=256 << 20,
            enforce_eager=eager,
        )
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert got == expected, (budget, eager)
        # decode steps replayed CUDA graphs (GDN state slots and attention pages read in place)
        assert (llm.engine.get_stats()["cuda_graph_replays"] > 0) != eager
