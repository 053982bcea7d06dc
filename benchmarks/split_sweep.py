"""Split-K sweep of the decode kernels: one preset and shape at the planner's split count and at others,
CUDA-graph replays, one process. Checks `paged_decode_narrow.plan` (the one-wave rule and its occupancy
model, `resident_per_sm`) against measurement.

PYTHONPATH=src:tests python benchmarks/split_sweep.py --preset turboquant_3bit_nc --case 32x32768x1 --splits 6,7,8,12

Prints the planned launch (registers, shared memory, programs per SM the planner assumed) and the median
ms of each split count; SDPA on the same shape is the baseline.
"""

from __future__ import annotations

import argparse

import torch

from tqserve.attention import paged_decode_narrow as narrow
from tqserve.attention.paged import LAST_LAUNCH
from tqserve.bench import kernels
from tqserve.bench.kernels import Case, _bench, sdpa_decode_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="turboquant_3bit_nc")
    ap.add_argument("--case", default="32x32768x1", help="requests x context x query tokens")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--splits", default="4,6,7,8,10,12,16")
    args = ap.parse_args()
    kernels.GRAPHS = True
    dev = torch.device("cuda")
    n_req, ctx, ql = (int(x) for x in args.case.split("x"))
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    sd = sdpa_decode_ms(n_req, ctx, ql, hq, hkv, d, dev)[0]
    print(f"{torch.cuda.get_device_name()}  sdpa {sd:.4f} ms", flush=True)
    case = Case(args.preset, n_req, ctx, ql, hq, hkv, d, dev)
    ms = _bench(case.run)
    k = LAST_LAUNCH["kernel"]
    name = getattr(k, "name", "?")
    print(
        f"{args.preset} {args.case} planned: {ms:.4f} ms ({sd / ms:.2f}x sdpa)  {name} regs {k.n_regs} "
        f"shared {k.metadata.shared}  programs per SM recorded {sorted(set(narrow._RESIDENT.values()))}",
        flush=True,
    )
    for sp in (int(x) for x in args.splits.split(",")):
        t = _bench(lambda sp=sp: case.run(sp))
        print(f"{args.preset} {args.case} splits {sp:4d}: {t:.4f} ms ({sd / t:.2f}x sdpa)", flush=True)
    case.free()


if __name__ == "__main__":
    main()
