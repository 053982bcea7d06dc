"""Host phases and GPU time of the decode steps, per engine instance: is a slow run host- or device-bound?

PYTHONPATH=src python benchmarks/engine_instances.py turboquant_4bit_nc turboquant_4bit_nc auto [preset ...]

Builds one engine per argument in turn in one process (as `tqserve bench throughput` does), runs
`bench_tqserve`'s 64 x 4K decode, and prints for the last round's timed steps (medians, ms): the step,
the GPU time of each CUDA-graph replay (CUDA events around it), the host phases (schedule, input build,
launch, read-back wait, scheduler update, output processing), the vCPUs the engine thread ran on and the
share of steal time. CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from decode_phases import _timed  # (run as a script: benchmarks/ is on sys.path)

from tqserve.bench import throughput
from tqserve.core import scheduler
from tqserve.engine import cuda_graphs, input_batch, llm_engine, model_runner, output_processor
from tqserve.models.loader import load_model

acc: dict[str, list[float]] = collections.defaultdict(list)
events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
cpus: collections.Counter = collections.Counter()


def _replay_timed() -> None:
    run = cuda_graphs.DecodeGraphs.run

    def wrapper(self, size, inputs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = run(self, size, inputs)
        b.record()
        events.append((a, b))
        return out

    cuda_graphs.DecodeGraphs.run = wrapper


def _cpu() -> int:
    """The vCPU this thread runs on (/proc/thread-self/stat, field 39)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def _steal() -> tuple[int, int]:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[7], sum(ticks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("presets", nargs="*", default=["turboquant_4bit_nc"] * 4 + ["auto"] * 2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    for cls, name, key in [
        (scheduler.Scheduler, "schedule", "schedule"),
        (scheduler.Scheduler, "update", "update"),
        (input_batch.InputBatchBuilder, "build", "build"),
        (model_runner.ModelRunner, "launch", "launch"),
        (model_runner.StepHandle, "collect", "read-back"),
        (output_processor.OutputProcessor, "process", "output"),
    ]:
        _timed(cls, name, acc, key)
    _replay_timed()
    step = llm_engine.LLMEngine.step

    def timed_step(self, *a, **k):
        cpus[_cpu()] += 1
        t = time.perf_counter()
        out = step(self, *a, **k)
        acc["step"].append(time.perf_counter() - t)
        return out

    llm_engine.LLMEngine.step = timed_step
    loaded = load_model(None, torch.bfloat16, torch.device("cuda"))
    n = args.new_tokens - 1  # the timed steps of the last round
    for preset in args.presets:
        acc.clear()
        events.clear()
        cpus.clear()
        st0, tot0 = _steal()
        rate = throughput.bench_tqserve(
            loaded, args.batch, args.new_tokens, "cuda", "bfloat16", args.prompt_len, kv_cache_dtype=preset
        )
        torch.cuda.synchronize()
        st1, tot1 = _steal()
        gpu = statistics.median(a.elapsed_time(b) for a, b in events[-n:])

        def med(key: str) -> float:
            return statistics.median(acc[key][-n:]) * 1e3 if acc[key] else float("nan")

        keys = ("schedule", "build", "launch", "read-back", "update", "output")
        phases = "  ".join(f"{k} {med(k):.3f}" for k in keys)
        print(
            f"{preset:24s} {rate:8.0f} tok/s  step {med('step'):.2f}  gpu replay {gpu:.3f}  {phases}  "
            f"vcpus {dict(cpus.most_common(3))}  steal {100 * (st1 - st0) / max(1, tot1 - tot0):.2f}%",
            flush=True,
        )


if __name__ == "__main__":
    main()
