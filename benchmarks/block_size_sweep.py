"""Paged decode / verify at several block sizes, side by side in one process (CUDA-graph replays).

A page holds `block_size` tokens of one KV head contiguously, so the block size sets the size of the
pieces a decode step reads from random places: 16 tokens of 4-bit keys are 1 KB, of bf16 keys 4 KB.
This times the same shapes at each block size against SDPA on contiguous bf16 K/V.

PYTHONPATH=src python benchmarks/block_size_sweep.py --presets auto,turboquant_4bit_nc --block-sizes 16,64
"""

from __future__ import annotations

import argparse
import json

import torch

from tqserve.bench import kernels
from tqserve.bench.kernels import Case, _bench, copy_bandwidth, sdpa_decode_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", default="auto,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,tq3")
    ap.add_argument("--block-sizes", default="16,32,64,128")
    ap.add_argument("--cases", default="32x32768x1,32x32768x5,1x131072x1", help="requests x context x query tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kernels.GRAPHS = True
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hq, hkv, d = 32, 8, 128
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  copy {bw:.0f} GB/s", flush=True)
    rows = []
    for case in args.cases.split(","):
        n_req, ctx, ql = (int(x) for x in case.split("x"))
        sd = sdpa_decode_ms(n_req, ctx, 1, hq, hkv, d, dev)[0]
        print(f"sdpa decode {n_req}x{ctx}: {sd:.4f} ms", flush=True)
        for p in args.presets.split(","):
            line = []
            for bs in (int(x) for x in args.block_sizes.split(",")):
                c = Case(p, n_req, ctx, ql, hq, hkv, d, dev, bs=bs)
                ms = _bench(c.run)
                gbps = c.bytes / (ms * 1e-3) / 1e9
                rows.append({"case": case, "preset": p, "block_size": bs, "ms": ms, "sdpa_decode_ms": sd, "GBps": gbps})
                line.append(f"bs {bs:3d} {ms:.4f} ms {sd / ms:5.2f}x ({gbps / bw:5.1%})")
                c.free()
                del c
                torch.cuda.empty_cache()
            print(f"  {p:20s} {case:12s} " + " | ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
