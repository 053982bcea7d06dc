"""Device probe of one decode case for knob variants side by side: each launch's GPU time in one CUDA-graph
replay (`attention_timeline.timeline`), the decode kernel's registers and spills, and its cubin written to a
directory (disassemble with `cuobjdump -sass`, which ships with triton's nvidia backend).

PYTHONPATH=src:tests python benchmarks/kernel_probe.py --preset turboquant_4bit_nc --case 1x131072x1 \
    --variants ',narrow.KEYS_I8=0' --cubin-dir $OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from attention_timeline import timeline  # noqa: E402
from decode_ab import _apply  # noqa: E402

from tqserve.attention import paged, paged_decode  # noqa: E402
from tqserve.bench.kernels import Case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--case", default="1x131072x1", help="requests x context x query tokens")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--variants", default="", help="decode_ab knob sets, comma-separated (':' joins knobs)")
    ap.add_argument("--cubin-dir", default=None)
    args = ap.parse_args()
    n_req, ctx, ql = (int(x) for x in args.case.split("x"))
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    paged_decode.MAX_QUERY_LEN = max(paged_decode.MAX_QUERY_LEN, ql)
    case = Case(args.preset, n_req, ctx, ql, hq, hkv, d, torch.device("cuda"))
    for i, variant in enumerate(args.variants.split(",") if args.variants else [""]):
        undo = _apply(variant.replace(":", ";"))
        rows = timeline(case)
        k = paged.LAST_LAUNCH.get("kernel")
        total = sum(us for _, us, _ in rows)
        regs, spills = getattr(k, "n_regs", "?"), getattr(k, "n_spills", "?")
        print(f"variant={variant or '-'} regs={regs} spills={spills} kernels_us={total:.2f}", flush=True)
        for name, us, gap in rows:
            print(f"  {us:8.2f} us (gap {gap:5.2f})  {name[:60]}", flush=True)
        if args.cubin_dir and k is not None:
            with open(os.path.join(args.cubin_dir, f"kernel{i}.cubin"), "wb") as f:
                f.write(k.asm["cubin"])
        _apply(undo)


if __name__ == "__main__":
    main()
