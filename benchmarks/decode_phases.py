"""Host phases of the decode steps where a whole batch decodes (GPU): where a step's wall time goes.

PYTHONPATH=src python benchmarks/decode_phases.py --batch 64 --prompt-len 4096 --kv auto turboquant_4bit_nc

Times (medians over the timed steps, ms) the engine's own calls: schedule, launch (the input build, then
the forward, logits and sampling enqueued), the read-back that waits for the GPU, scheduler update and
output processing. With asynchronous output processing and async scheduling (the CUDA defaults) the
output processing and the next step's schedule and launch run while a step is on the device, and the
read-back waits less.
One engine per KV preset, built and freed in turn in one process, as `tqserve bench throughput` builds them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import time

import torch

from tqserve import LLM, RequestOutputKind, SamplingParams
from tqserve.models.loader import load_model


def _timed(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        acc[key].append(time.perf_counter() - t)
        return out

    setattr(obj, name, wrapper)


def _timed_launch(runner, acc: dict) -> None:
    """`launch` and the read-back (`StepHandle.collect`) of the step it returns, timed apart."""
    launch = runner.launch

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        handle = launch(*args, **kwargs)
        acc["launch"].append(time.perf_counter() - t)
        collect = handle.collect

        def timed_collect():
            t = time.perf_counter()
            out = collect()
            acc["read-back"].append(time.perf_counter() - t)
            return out

        handle.collect = timed_collect
        return handle

    runner.launch = wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kv", nargs="+", default=["auto", "turboquant_4bit_nc"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--disable-async-output-proc", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    loaded = load_model(None, dtype, torch.device(args.device))
    b, n = args.batch, args.prompt_len
    for kv in args.kv:
        llm = LLM(
            loaded=loaded, device=args.device, dtype=str(dtype).removeprefix("torch."),
            max_model_len=n + args.new_tokens + 16,
            max_num_seqs=b, kv_cache_dtype=kv, max_num_batched_tokens=b * n,
            disable_async_output_proc=args.disable_async_output_proc,
            async_scheduling=args.async_scheduling,
        )  # fmt: skip
        eng = llm.engine
        acc: dict[str, list[float]] = collections.defaultdict(list)
        _timed(eng.scheduler, "schedule", acc, "schedule")
        _timed(eng.runner.builder, "build", acc, "input build")
        _timed_launch(eng.runner, acc)
        _timed(eng.scheduler, "update", acc, "update")
        _timed(eng.processor, "process", acc, "output processing")
        vocab = eng.model_config.vocab_size
        params = SamplingParams(
            temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        for i in range(b):
            eng.add_request(f"r{i}", [(7 + 31 * i + 17 * j) % vocab for j in range(n)], params)
        while any(q.num_output_tokens == 0 for q in eng.scheduler.requests.values()):
            eng.step()  # prefill (one step) and the first token
        acc.clear()
        steps = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        phases = "  ".join(f"{k} {statistics.median(v) * 1e3:.3f}" for k, v in acc.items())
        print(f"kv={kv:20s} step {statistics.median(steps) * 1e3:.2f} ms  ({phases})", flush=True)
        del llm, eng
        gc.collect()  # the timers hold the engine's bound methods: free it before the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
