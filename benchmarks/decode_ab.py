"""Device A/B of the decode kernels: the sliced kernel (attention/paged_decode.py) against the general
one (attention/paged.py, `paged_decode.ENABLED = False`) on the same pages, SDPA as the baseline, all
in one process on one card; real-size reference checks of decode / verify batches first.

PYTHONPATH=src:tests python benchmarks/decode_ab.py [--presets P,...] [--json F]
PYTHONPATH=src:tests python benchmarks/decode_ab.py --no-checks --heads 9,3,64 --cases 64x4096x1  (SmolLM2's decode)
PYTHONPATH=src:tests python benchmarks/decode_ab.py --no-checks --graphs --lookups shfl,prmt \
    --variants 'BLOCK_N=64,SMALL_NUM_WARPS=2:SMALL_BLOCK_N=64,narrow.ENABLED=0'   (decoders and knob
    sets, graph replays; `narrow.` knobs are attention/paged_decode_narrow.py's)
PYTHONPATH=src:tests python benchmarks/decode_ab.py --no-checks --no-general --rounds 3 --graphs --lookups shfl \
    --variants ',narrow.VALUE_ROWS=0'   (each variant timed 3 times, interleaved; median and range reported)
PYTHONPATH=src:tests python benchmarks/decode_ab.py --no-checks --no-general --rounds 3 --graphs --lookups shfl \
    --old main=/tmp/main/src/tqserve/attention/paged_decode_narrow.py --variants ',module=main'   (another copy
    of the narrow kernel's module, e.g. a committed version, as a variant: same pages, same process)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))

from test_paged_attention import _check_one_step  # noqa: E402

from tqserve.attention import finish, paged, paged_decode, rotate  # noqa: E402
from tqserve.attention import paged_decode_narrow as narrow  # noqa: E402
from tqserve.bench.kernels import Case, _bench, copy_bandwidth, sdpa_decode_ms  # noqa: E402

PRESETS = "turboquant_4bit_nc,turboquant_3bit_nc,tq4,tq3,tq4s,tq3s,tq_k4v4_nc"
CHECKS = [
    ("turboquant_4bit_nc", 32, 8, 128), ("turboquant_3bit_nc", 32, 8, 128), ("tq4", 32, 8, 128), ("tq3", 32, 8, 128),
    ("tq4s", 32, 8, 128), ("turboquant_4bit_nc", 9, 3, 64), ("tq3", 28, 4, 128), ("tq_k4v4_nc", 16, 2, 256),
]  # fmt: skip
ROWS: list[dict] = []
# Copies of attention/paged_decode_narrow.py a variant can switch to ("module=label", `--old`); "new" is this tree's.
MODULES = {"new": narrow}


def row(**kw) -> None:
    ROWS.append(kw)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


def checks() -> None:
    batches = {"decode": ([9000, 3000, 17, 1], [1, 1, 1, 1]), "verify": ([5000, 2047, 64], [5, 5, 5])}
    for preset, hq, hkv, d in CHECKS:
        for name, (ctx, ql) in batches.items():
            try:
                _check_one_step(preset, hq, hkv, d, ctx, ql, seed=1)
                msg = "ok"
            except AssertionError as e:
                msg = "FAIL " + str(e).splitlines()[0][:200]
            row(check=preset, shape=f"{hq}/{hkv}/{d}", case=name, result=msg)


def _apply(variant: str) -> str:
    """Set decode-kernel knobs from "NAME=VALUE;narrow.NAME=VALUE" (`paged_decode`, or with the prefix
    `narrow.` those of `paged_decode_narrow`, `finish.` those of the split-K combine, `rotate.` the query
    rotation's, `paged.` the general kernel's); returns the string that undoes it."""
    undo = []
    for kv in filter(None, variant.split(";")):
        name, val = kv.split("=")
        if name == "module":  # the launcher imports the narrow kernel's module from the package each call
            import tqserve.attention as package

            current = next(k for k, m in MODULES.items() if m is package.paged_decode_narrow)
            undo.append(f"module={current}")
            package.paged_decode_narrow = MODULES[val]
            continue
        prefix, _, attr = name.rpartition(".")
        module = {"": paged_decode, "narrow": narrow, "finish": finish, "paged": paged, "rotate": rotate}[prefix]
        old = getattr(module, attr)
        undo.append(f"{name}={int(old) if isinstance(old, bool) else old}")
        setattr(module, attr, type(old)(int(val) if val.isdigit() else val))
    return ";".join(undo)


def ab(
    presets: list[str],
    dev,
    heads=(32, 8, 128),
    cases=((32, 32768, 1), (1, 131072, 1), (32, 32768, 5)),
    lookups=("shfl", "prmt"),
    variants=("",),
    rounds: int = 1,
    general: bool = True,
) -> None:
    """Times every variant `rounds` times, the variants interleaved within each round (so a drift of
    the card's clock over the run lands on all of them), and reports each one's median and range."""
    bw = copy_bandwidth(dev)
    row(copy_GBps=bw)
    hq, hkv, d = heads
    paged_decode.MIN_HEAD_DIM = 64  # the A/B times the sliced kernel wherever it can run
    saved = paged_decode.LOOKUP, paged_decode.MAX_QUERY_LEN
    for n_req, ctx, ql in cases:
        shape = f"{n_req}x{ql}x{ctx} heads {hq}/{hkv}/{d}"
        sd = sdpa_decode_ms(n_req, ctx, ql, hq, hkv, d, dev)[0]
        row(shape=shape, preset="sdpa", ms=sd)
        for p in presets:
            c = Case(p, n_req, ctx, ql, hq, hkv, d, dev)
            paged_decode.ENABLED = False
            old = _bench(c.run) if general else float("nan")
            c.run()
            ref = c.out.float().clone()
            paged_decode.ENABLED = True
            paged_decode.MAX_QUERY_LEN = ql
            for lookup in lookups:
                times: dict[str, list[float]] = {v: [] for v in variants}
                errs: dict[str, float] = {}
                for _ in range(rounds):
                    for variant in variants:
                        paged_decode.LOOKUP = lookup
                        undo = _apply(variant)
                        times[variant].append(_bench(c.run))
                        c.run()
                        errs[variant] = float((c.out.float() - ref).norm() / ref.norm())
                        _apply(undo)
                for variant, ts in times.items():
                    new = sorted(ts)[len(ts) // 2]
                    row(shape=shape, preset=p, lookup=lookup, variant=variant or "-", general_ms=old,
                        sliced_ms=new, lo=min(ts), hi=max(ts), speedup=old / new, sliced_vs_sdpa=sd / new,
                        of_copy=c.bytes / new / 1e6 / bw, diff=errs[variant])  # fmt: skip
            paged_decode.LOOKUP, paged_decode.MAX_QUERY_LEN = saved
            del c
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head size")
    ap.add_argument("--cases", default="32x32768x1,1x131072x1,32x32768x5", help="requests x context x query tokens")
    ap.add_argument("--lookups", default="shfl,prmt", help="slice decoders to time (paged_decode.LOOKUP)")
    ap.add_argument("--variants", default="", help="paged_decode knob sets to time, e.g. 'BLOCK_N=64,SMALL_BLOCK_N=64'")
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (no host launch overhead)")
    ap.add_argument("--no-checks", action="store_true", help="skip the real-size reference checks")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the variants (median reported)")
    ap.add_argument("--no-general", action="store_true", help="don't time the general kernel")
    ap.add_argument("--old", action="append", default=[], help="label=path of another paged_decode_narrow.py")
    args = ap.parse_args()
    for spec in args.old:
        label, path = spec.split("=", 1)
        mspec = importlib.util.spec_from_file_location(f"tqserve.attention.paged_decode_narrow_{label}", path)
        MODULES[label] = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(MODULES[label])
    dev = torch.device("cuda")
    if not args.no_checks:
        checks()
    heads = tuple(int(x) for x in args.heads.split(","))
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if args.graphs:
        from tqserve.bench import kernels

        kernels.GRAPHS = True
    variants = tuple(v.replace(":", ";") for v in args.variants.split(",")) if args.variants else ("",)
    ab(
        args.presets.split(","), dev, heads, cases, tuple(args.lookups.split(",")), variants, args.rounds,
        not args.no_general,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
