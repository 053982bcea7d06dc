"""Device probe of one decode case: per-kernel GPU times (torch profiler over CUDA-graph replays), the decode
kernel's registers, spills and SASS (written to a directory), for knob variants side by side.

PYTHONPATH=src:tests python benchmarks/kernel_probe.py --preset turboquant_4bit_nc --case 1x131072x1 \
    --variants ',narrow.KEYS_I8=0' --sass-dir $OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from decode_ab import _apply  # noqa: E402

from tqserve.attention import paged, paged_decode  # noqa: E402
from tqserve.bench.kernels import Case  # noqa: E402


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel `fn` launches, from replays of one CUDA graph of it."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            out[ev.key[:60]] = ev.device_time_total / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--case", default="1x131072x1", help="requests x context x query tokens")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--variants", default="")
    ap.add_argument("--sass-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n_req, ctx, ql = (int(x) for x in args.case.split("x"))
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    paged_decode.MAX_QUERY_LEN = max(paged_decode.MAX_QUERY_LEN, ql)
    c = Case(args.preset, n_req, ctx, ql, hq, hkv, d, dev)
    for i, variant in enumerate(args.variants.split(",") if args.variants else [""]):
        undo = _apply(variant.replace(":", ";"))
        times = kernel_times(c.run)
        k = paged.LAST_LAUNCH.get("kernel")
        regs = getattr(k, "n_regs", "?")
        spills = getattr(k, "n_spills", "?")
        total = sum(times.values())
        print(f"variant={variant or '-'} regs={regs} spills={spills} total_us={total:.2f}", flush=True)
        for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"  {us:8.2f} us  {name}", flush=True)
        if args.sass_dir and k is not None:  # disassemble with nvdisasm / cuobjdump -sass where convenient
            with open(os.path.join(args.sass_dir, f"kernel{i}.cubin"), "wb") as f:
                f.write(k.asm["cubin"])
        _apply(undo)


if __name__ == "__main__":
    main()
