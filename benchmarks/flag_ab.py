"""A/B of module-level switches of the attention kernels, side by side in one process (CUDA-graph
replays), against SDPA on the same shapes.

PYTHONPATH=src python benchmarks/flag_ab.py --module paged_decode_narrow \
    --configs "PAIR_SCALARS=0;PAIR_SCALARS=1;PAIR_SCALARS=1,MAXNREG=128" \
    --presets turboquant_4bit_nc,tq3 --cases 32x32768x1,32x32768x5,1x131072x1

Each case is built once (same pages); every configuration (';'-separated sets of NAME=value of the
module, under tqserve.attention) is timed on it, then the outputs are compared with the first
configuration's (max abs difference relative to the output's largest magnitude).
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from tqserve.bench import kernels
from tqserve.bench.kernels import Case, _bench, copy_bandwidth, sdpa_decode_ms


def _cast(current, text: str):
    """`text` as the type of the switch's current value (bool("0") would be True: bools go through int)."""
    return bool(int(text)) if isinstance(current, bool) else type(current)(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--module", required=True, help="module under tqserve.attention")
    ap.add_argument("--configs", required=True, help="';'-separated configurations, each NAME=value[,NAME=value]")
    ap.add_argument("--presets", default="turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc,tq3")
    ap.add_argument("--cases", default="32x32768x1,32x32768x5,1x131072x1", help="requests x context x query tokens")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    mod = importlib.import_module(f"tqserve.attention.{args.module}")
    configs = []
    for spec in args.configs.split(";"):
        sets = dict(kv.split("=") for kv in spec.split(",") if kv)
        configs.append({k: _cast(getattr(mod, k), v) for k, v in sets.items()})
    kernels.GRAPHS = True
    dev = torch.device("cuda")
    torch.manual_seed(0)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  copy {bw:.0f} GB/s  {args.module}: {args.configs}", flush=True)
    rows = []
    for case in args.cases.split(","):
        n_req, ctx, ql = (int(x) for x in case.split("x"))
        sd = sdpa_decode_ms(n_req, ctx, 1, hq, hkv, d, dev)[0]
        print(f"sdpa decode {n_req}x{ctx}: {sd:.4f} ms", flush=True)
        for p in args.presets.split(","):
            c = Case(p, n_req, ctx, ql, hq, hkv, d, dev)
            line, outs = [], []
            for i, cfg in enumerate(configs):
                old = {k: getattr(mod, k) for k in cfg}
                try:
                    for k, v in cfg.items():
                        setattr(mod, k, v)
                    ms = _bench(c.run)
                    outs.append(c.run().float().clone())
                finally:
                    for k, v in old.items():
                        setattr(mod, k, v)
                rows.append({"case": case, "preset": p, "config": cfg, "ms": ms, "sdpa_decode_ms": sd})
                line.append(f"[{i}] {ms:.4f} ms {sd / ms:5.2f}x")
            scale = outs[0].abs().max().clamp_min(1e-30)
            diff = max(float((o - outs[0]).abs().max() / scale) for o in outs)
            print(f"  {p:20s} {case:12s} " + " | ".join(line) + f" | max diff {diff:.1e}", flush=True)
            c.free()
            del c, outs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
