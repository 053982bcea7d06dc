"""Per-kernel timeline of one paged-attention call replayed from a CUDA graph (GPU): which launches a
step makes and how long each takes, with the gaps between them.

PYTHONPATH=src:tests python benchmarks/attention_timeline.py --presets turboquant_4bit_nc,tq3 \
    --cases 1x131072x1,32x32768x1,32x32768x5
(cases: requests x context x query tokens; 32 query / 8 KV heads, d = 128 unless --heads says else)
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tqserve.bench import kernels
from tqserve.bench.kernels import Case, _bench

REPLAYS = 3


def timeline(case: Case) -> list[tuple[str, float, float]]:
    """(kernel name, microseconds, gap after the previous kernel) of one graph replay."""
    case.run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    last = events[-(len(events) // REPLAYS) :]  # the last replay
    rows, prev_end = [], None
    for e in last:
        gap = e.time_range.start - prev_end if prev_end is not None else 0.0
        rows.append((e.name, e.time_range.elapsed_us(), gap))
        prev_end = e.time_range.end
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="turboquant_4bit_nc,tq3")
    ap.add_argument("--cases", default="1x131072x1,32x32768x1,32x32768x5")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    args = ap.parse_args()
    kernels.GRAPHS = True
    dev = torch.device("cuda")
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    for preset in args.presets.split(","):
        for spec in args.cases.split(","):
            n_req, ctx, qlen = (int(x) for x in spec.split("x"))
            case = Case(preset, n_req, ctx, qlen, hq, hkv, d, dev)
            ms = _bench(case.run)
            rows = timeline(case)
            print(f"== {preset} {spec}: graph replay {ms * 1000:.1f} us, {len(rows)} kernels", flush=True)
            for name, us, gap in rows:
                print(f"   {us:8.1f} us  gap {gap:5.1f}  {name[:100]}", flush=True)
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
