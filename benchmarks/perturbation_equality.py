"""Can greedy tokens on TurboQuant pages survive float rounding? The CPU reference backend against itself
with every attention output multiplied by (1 + eps * n), n standard normal per element - the size of the
difference between the Triton kernels and the torch reference on the same float32 call
(tests/engine/test_gpu_backend_agreement.py) - on the default model in float32 and the invariance prompts.

PYTHONPATH=src:tests:tests/engine python benchmarks/perturbation_equality.py --eps 1e-6 \\
    --kv auto,turboquant_4bit_nc,tq_k6v6_nc
"""

from __future__ import annotations

import argparse

import torch
from test_invariance import GREEDY, mixed_prompts

from tqserve import LLM
from tqserve.attention import reference
from tqserve.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", type=float, default=1e-6, help="relative size of the perturbation")
    ap.add_argument("--kv", default="auto,turboquant_4bit_nc", help="comma-separated KV cache dtypes / presets")
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    loaded = load_model(None, torch.float32, "cpu")
    prompts = mixed_prompts(args.prompts)
    plain = reference.ReferenceBackend.forward

    def perturbed(self, layer_idx, q, k, v, meta, scale):
        out = plain(self, layer_idx, q, k, v, meta, scale)
        gen = torch.Generator().manual_seed(1234 + layer_idx + 1000 * out.shape[0])  # the same in every run
        return out * (1 + args.eps * torch.randn(out.shape, generator=gen)).to(out.dtype)

    def run(kv: str, forward) -> list[list[int]]:
        reference.ReferenceBackend.forward = forward
        try:
            kw = dict(dtype="float32", max_model_len=1024, kv_cache_dtype=kv, enable_prefix_caching=False)
            llm = LLM(loaded=loaded, **kw)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        finally:
            reference.ReferenceBackend.forward = plain

    for kv in args.kv.split(","):
        a, b = run(kv, plain), run(kv, perturbed)
        same = sum(x == y for x, y in zip(a, b))
        print(f"{kv:28s} eps {args.eps:g}: {same}/{len(a)} sequences identical", flush=True)


if __name__ == "__main__":
    main()
