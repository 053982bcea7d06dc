"""How the L2 flush before each timed call changes the kernel table (GPU).

`triton.testing.do_bench` (which `tqserve bench kernels` times with) flushes the L2 by writing zeros
over a 256 MB buffer before every call. That leaves the L2 full of dirty lines (50 MB on an H100),
and the timed call, whose reads evict them, pays for writing them back to DRAM: traffic that is not
its own. A model's step leaves mostly clean lines in the L2 (weights it read). This probe times the
same calls, CUDA-graph replays, side by side under four flushes:

- zero: the 256 MB zero fill (do_bench's);
- read: a reduction over the 256 MB buffer (clean lines);
- zero+read: the zero fill, then the reduction (the dirty lines are written back during the flush);
- none: no flush (caches warm where the call's bytes fit; here they mostly do not).

PYTHONPATH=src:tests python benchmarks/flush_probe.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from tqserve.bench import kernels
from tqserve.bench.kernels import Case, copy_bandwidth, store_slots

FLUSHES = ("zero", "read", "zero+read", "none")


class Flusher:
    def __init__(self, dev) -> None:
        self.buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=dev)
        self.buf.zero_()

    def __call__(self, mode: str) -> None:
        if mode in ("zero", "zero+read"):
            self.buf.zero_()
        if mode in ("read", "zero+read"):
            self.buf.sum()  # reads every line: the L2 is left full of clean ones


def replay_ms(fn, flush: Flusher, mode: str, reps: int) -> float:
    """Median ms of a CUDA-graph replay of fn, the L2 flushed by `mode` before each replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        flush(mode)
        graph.replay()
    for i in range(reps):
        flush(mode)
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians over them")
    args = ap.parse_args()
    dev = torch.device("cuda")
    kernels.GRAPHS = True
    print(torch.cuda.get_device_name(), flush=True)
    hq, hkv, d = 32, 8, 128
    calls: dict[str, object] = {}
    nbytes: dict[str, int] = {}
    long_ctx, batch_ctx = (16384, 4096) if args.quick else (131072, 32768)
    for n_req, ctx in ((1, long_ctx), (32, batch_ctx)):
        q = torch.randn(n_req, hq, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n_req, hkv, ctx + 1, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        calls[f"sdpa decode {n_req}x{ctx}"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True
        )
        for preset in ("turboquant_4bit_nc", "tq3"):
            c = Case(preset, n_req, ctx, 1, hq, hkv, d, dev)
            calls[f"{preset} decode {n_req}x{ctx}"] = c.run
    from tqserve.kvquant.presets import make_layer_format
    from tqserve.kvquant.store_triton import StorePlan, store_kv

    t = 16384
    for preset in ("turboquant_4bit_nc", "tq3", "tq4"):
        fmt = make_layer_format(preset, 5, hkv, d, torch.bfloat16)
        plan = StorePlan(fmt, dev)
        pages = fmt.allocate(t // 16 + 2, 16, dev)
        k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = store_slots(t, 16, "pages", dev)
        calls[f"{preset} store {t}"] = lambda p=pages, pl=plan, k=k, v=v, s=slots: store_kv(p, pl, k, v, s)
        nbytes[f"{preset} store {t}"] = 2 * k.numel() * 2 + t * fmt.page_bytes_per_token() + t * 8
    a = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    calls["copy 1 GiB (graph)"] = lambda: b.copy_(a)

    flush = Flusher(dev)
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            for mode in FLUSHES:
                res.setdefault((name, mode), []).append(replay_ms(fn, flush, mode, args.reps))
    med = {key: statistics.median(v) for key, v in res.items()}
    print("ms, medians of", args.rounds, "rounds:", " | ".join(FLUSHES), flush=True)
    for name in calls:
        print(f"{name:36s} " + " ".join(f"{med[(name, m)]:9.4f}" for m in FLUSHES), flush=True)
    copy = copy_bandwidth(dev)
    print(f"store, % of the eager copy rate ({copy:.0f} GB/s), per flush:", flush=True)
    for name, n in nbytes.items():
        print(f"  {name}: " + " ".join(f"{100 * n / (med[(name, m)] * 1e-3) / 1e9 / copy:5.1f}%" for m in FLUSHES))
    print("SDPA / paged decode, per flush:", flush=True)
    for n_req, ctx in ((1, long_ctx), (32, batch_ctx)):
        for preset in ("turboquant_4bit_nc", "tq3"):
            sdpa, ours = f"sdpa decode {n_req}x{ctx}", f"{preset} decode {n_req}x{ctx}"
            ratios = [med[(sdpa, m)] / med[(ours, m)] for m in FLUSHES]
            print(f"  {preset} {n_req}x{ctx}: " + " ".join(f"{r:5.2f}x" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
