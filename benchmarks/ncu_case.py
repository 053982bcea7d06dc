"""One paged-attention call of a case, for Nsight Compute (`ncu`) to profile its kernels.

ncu --clock-control none -k regex:_narrow_decode_kernel -s 2 -c 1 --section WarpStateStats ... \
    python benchmarks/ncu_case.py --preset turboquant_4bit_nc --case 32x32768x1

Runs the call three times (compile, warm, profiled); the kernels' outputs are not checked.
"""

from __future__ import annotations

import argparse

import torch

from tqserve.bench.kernels import Case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--case", default="32x32768x1", help="requests x context x query tokens")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    n_req, ctx, ql = (int(x) for x in args.case.split("x"))
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    case = Case(args.preset, n_req, ctx, ql, hq, hkv, d, torch.device("cuda"))
    for _ in range(args.calls):
        case.run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
