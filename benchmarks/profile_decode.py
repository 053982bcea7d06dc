"""Profile a few decode steps of the engine (GPU): where a step's time goes, per KV preset.

python benchmarks/profile_decode.py --batch 64 --prompt-len 4096 --kv auto turboquant_4bit_nc
python benchmarks/profile_decode.py --hybrid-layers 4 --batch 32 --prompt-len 256 --kv auto tq4   (Qwen3.5-4B-shaped)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from tqserve import LLM, SamplingParams
from tqserve.models.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--kv", nargs="+", default=["auto"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cprofile", action="store_true", help="also print a cProfile of the steps (host time)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (per-kernel GPU times in the table)")
    p.add_argument("--hybrid-layers", type=int, default=0, help="random Qwen3.5-4B-shaped model of this many layers")
    args = p.parse_args()
    if args.hybrid_layers:
        import model_factory
        from hybrid_bench import qwen35_4b_config

        from tqserve.models.qwen3_5 import Qwen3_5ForCausalLM
        from tqserve.tokenizer import Tokenizer

        cfg = qwen35_4b_config(args.hybrid_layers)
        with torch.device("cuda"):
            model = Qwen3_5ForCausalLM(cfg, torch.bfloat16)
        for prm in model.parameters():
            prm.data.normal_(0, 0.02)
        loaded = (model, cfg, Tokenizer(model_factory.make_tiny_tokenizer()))
    else:
        loaded = load_model(None, torch.bfloat16, "cuda")
    for kv in args.kv:
        llm = LLM(
            loaded=loaded,
            device="cuda",
            dtype="bfloat16",
            kv_cache_dtype=kv,
            max_model_len=args.prompt_len + 64,
            max_num_seqs=args.batch,
            # one prefill step for the whole batch: every request then decodes in every timed step
            max_num_batched_tokens=max(8192, args.batch * args.prompt_len),
            gpu_memory_utilization=0.5,
            enforce_eager=args.enforce_eager,
        )
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
        vocab = eng.model_config.vocab_size
        for i in range(args.batch):
            eng.add_request(f"r{i}", [(7 + 31 * i + 17 * j) % vocab for j in range(args.prompt_len)], params)
        while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
            eng.step()
        for _ in range(3):  # per-step times: a compile inside a step shows up here
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            print(f"kv={kv} step {(time.perf_counter() - t) * 1e3:.1f} ms", flush=True)
        graphs = eng.runner.graphs
        size = min((b for b in graphs.sizes if b >= len(eng.scheduler.running)), default=0) if graphs else 0
        if size:
            # GPU time of the forward alone: the graph the last step replayed (its inputs are still in
            # the buffers: it rewrites the same slots), back to back; the step's remainder is host
            # work (scheduling, input building, sampling, output processing).
            g = graphs.graphs[size]
            g.replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            print(f"kv={kv} graph replay (forward only) {(time.perf_counter() - t) / 20 * 1e3:.2f} ms", flush=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(args.steps):
                eng.step()
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.steps
        print(f"=== kv={kv}: {dt * 1e3:.1f} ms per decode step (batch {args.batch}, ctx {args.prompt_len})")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
        if args.cprofile:
            # Host side: which Python functions a decode step spends its wall time in.
            prof_py = cProfile.Profile()
            prof_py.enable()
            for _ in range(args.steps):
                eng.step()
            torch.cuda.synchronize()
            prof_py.disable()
            stats = pstats.Stats(prof_py)
            stats.sort_stats("cumulative").print_stats(30)
            stats.sort_stats("tottime").print_stats(25)
        del llm, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
