"""Where a paged-attention kernel's warps wait, from Nsight Compute's sampled stall reasons.

Two modes:

    # on the GPU (Firecracker machines, where ncu reads the counters): one case, run eagerly a few times
    ncu --clock-control none --kernel-name regex:_narrow_decode --launch-skip 2 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section SourceCounters --export rep \
        python benchmarks/ncu_stalls.py run turboquant_4bit_nc 32x32768x1 [narrow.NUM_STAGES=5 ...]
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv

    # anywhere: the samples of that CSV by stall reason and opcode, and the hottest instructions
    python benchmarks/ncu_stalls.py report src.csv [--top 25]

The report is what the twenty-seventh session used to find the narrow decode kernel's wait at the top of
its key loop (docs/benchmarks.md, H200 section).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

REASONS = (
    "stall_long_sb",
    "stall_short_sb",
    "stall_wait",
    "stall_math",
    "stall_not_selected",
    "stall_selected",
    "stall_mio",
    "stall_dispatch",
    "stall_barrier",
)
SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _opcode(sass: str) -> str:
    words = sass.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def report(path: str, top: int) -> None:
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {name: i for i, name in enumerate(rows[header])}
    data = [r for r in rows[header + 1 :] if len(r) == len(rows[header])]
    base = int(data[0][0], 16)
    total = sum(_num(r[col[SAMPLES]]) for r in data)
    print(f"{path}: {len(data)} instructions, {total:.0f} samples")
    for reason in REASONS:
        by_op: dict[str, float] = defaultdict(float)
        for r in data:
            by_op[_opcode(r[1])] += _num(r[col[reason]])
        n = sum(by_op.values())
        hot = sorted(by_op.items(), key=lambda kv: -kv[1])[:6]
        print(f"{reason:20s} {n:7.0f} ({100 * n / max(total, 1):4.1f}%): " + ", ".join(f"{k} {v:.0f}" for k, v in hot))
    print(f"hottest {top} instructions (offset in the kernel, samples, reasons with more than 20):")
    for r in sorted(data, key=lambda r: -_num(r[col[SAMPLES]]))[:top]:
        why = " ".join(f"{c[6:]}={_num(r[col[c]]):.0f}" for c in REASONS if _num(r[col[c]]) > 20)
        print(f"{int(r[0], 16) - base:#07x} {_num(r[col[SAMPLES]]):6.0f} {r[1].strip()[:60]:60s} {why}")


def run(preset: str, shape: str, knobs: list[str]) -> None:
    """One step of a kernels-benchmark case, four times, eagerly (ncu profiles one launch of it)."""
    import torch

    from tqserve.attention import paged_decode
    from tqserve.attention import paged_decode_narrow as narrow
    from tqserve.bench.kernels import Case

    for kv in knobs:  # "narrow.NAME=INT" or "paged_decode.NAME=INT"
        name, val = kv.split("=")
        prefix, attr = name.split(".")
        module = {"narrow": narrow, "paged_decode": paged_decode}[prefix]
        setattr(module, attr, type(getattr(module, attr))(int(val)))
    n, ctx, qlen = (int(v) for v in shape.split("x"))
    case = Case(preset, n, ctx, qlen, 32, 8, 128, torch.device("cuda"))
    for _ in range(4):
        case.run()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("report", help="stall samples of an `ncu --page source --csv` export")
    r.add_argument("csv")
    r.add_argument("--top", type=int, default=25)
    c = sub.add_parser("run", help="run one case for ncu to profile")
    c.add_argument("preset")
    c.add_argument("shape", help="requests x context x query tokens, e.g. 32x32768x1")
    c.add_argument("knobs", nargs="*", help="narrow.NAME=INT or paged_decode.NAME=INT")
    args = ap.parse_args()
    if args.mode == "report":
        report(args.csv, args.top)
    else:
        run(args.preset, args.shape, args.knobs)


if __name__ == "__main__":
    main()
