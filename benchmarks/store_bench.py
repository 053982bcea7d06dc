"""Store-kernel benchmark: every preset's fused store against the card's copy rate, one process.

python benchmarks/store_bench.py [--old label=path/to/store_triton.py ...] [--sweep p1,p2] [--json out.json]

Bytes per call are the fewest the store must move (as `tqserve bench kernels` counts them): the
bf16 K and V it reads, the page bytes it writes (indices, fp8 or bf16 payload, scales, zeros) and
the int64 slot mapping. `--old label=path` times other copies of the kernel module side by side
(committed versions, for before / after numbers on the same card in the same process); `--sweep`
also times other launch shapes (tokens per program x warps) for the presets it names.
Times are medians of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from tqserve.bench import kernels
from tqserve.bench.kernels import PRESETS, copy_bandwidth
from tqserve.kvquant.presets import make_layer_format


def _time(fn, flush: bool = False) -> float:
    """Median ms of one call replayed from a CUDA graph (no Python launch cost in the number); with
    `flush`, the L2 is flushed before every replay, as `tqserve bench kernels` times it (the K / V the
    store reads then come from DRAM)."""
    import triton

    if flush:
        kernels.GRAPHS = True
        return kernels._bench(fn)
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def _load(path: str):
    spec = importlib.util.spec_from_file_location("store_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--old", action="append", default=[], help="label=path of another kernel module")
    ap.add_argument("--sweep", default="", help="comma-separated presets to also time at other launch shapes")
    ap.add_argument(
        "--shapes",
        default="16:2,16:4,32:2,32:4,64:2,64:4,32:8,64:8,128:8",
        help="the sweep's launch shapes: tokens:warps[:maxnreg], comma-separated",
    )
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--flush", action="store_true", help="flush the L2 before every call (as bench kernels)")
    ap.add_argument("--slots", default="tokens", choices=("tokens", "pages"), help="`kernels.store_slots` order")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tqserve.kvquant import store_triton as new

    dev = torch.device("cuda")
    others = [(spec.split("=", 1)[0], _load(spec.split("=", 1)[1])) for spec in args.old]
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  copy {bw:.0f} GB/s", flush=True)
    t, hkv, d, bs = args.tokens, args.heads, args.head_dim, 16
    rows = []
    for preset in args.presets.split(","):
        fmt = make_layer_format(preset, 5, hkv, d, torch.bfloat16)
        pages = fmt.allocate(t // bs + 2, bs, dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
        slots = kernels.store_slots(t, bs, args.slots, dev, gen)
        nbytes = 2 * k.numel() * 2 + t * fmt.page_bytes_per_token() + t * 8
        cases = []
        for label, mod in [*others, ("new", new)]:
            try:
                plan = mod.StorePlan(fmt, dev)
            except NotImplementedError as e:  # e.g. an older kernel without the gain search
                print(f"{preset:20s} {label:16s} n/a ({e})", flush=True)
                continue
            cases.append((label, mod, plan, {}))
            tq = mod.TQ in {s[0] for s in plan.sides}
            if preset in args.sweep.split(",") and label == "new":  # shapes of the module under test only
                shapes = [[int(x) for x in sh.split(":")] for sh in args.shapes.split(",")]
                shapes = shapes if tq else [[32, 4], [64, 4]]
                for bt, nw, *mr in shapes:
                    kw = {"block_tokens": bt, "num_warps": nw, **({"maxnreg": mr[0]} if mr else {})}
                    cases.append((f"{label} bt{bt} w{nw}" + (f" r{mr[0]}" if mr else ""), mod, plan, kw))
                if tq:  # rotation tiles of 64 columns instead of the default 32
                    cases.append(("new W64", mod, mod.StorePlan(fmt, dev, wmax=64), {}))
        for label, mod, pl, kw in cases:
            try:
                ms = _time(
                    lambda mod=mod, pl=pl, kw=kw, p=pages, k=k, v=v, s=slots: mod.store_kv(p, pl, k, v, s, **kw),
                    args.flush,
                )
            except Exception as e:  # report and go on: one broken variant must not hide the rest
                print(f"{preset:20s} {label:16s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"preset": preset, "variant": label, "ms": ms, "GBps": gbps, "of_copy": gbps / bw})
            print(f"{preset:20s} {label:16s} {ms:8.4f} ms {gbps:8.0f} GB/s {gbps / bw:6.1%} of copy", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
