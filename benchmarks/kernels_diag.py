"""Device A/B of the paged decode kernel: the current tree against an older paged.py (+ its tuning.py),
SDPA as the baseline, all in one process on one card; then decode tile / split sweeps of the new kernel
and real-size correctness checks of the packed presets.

python benchmarks/kernels_diag.py OLD_PAGED.py OLD_TUNING.py [--quick] [--sweep | --verify-sweep] [--f16j] [--json F]
(old files: e.g. `git show <commit>:src/tqserve/attention/paged.py > old_paged.py`, untracked)
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))

from test_paged_attention import _check_one_step  # noqa: E402

from tqserve.attention import paged, tuning  # noqa: E402
from tqserve.bench.kernels import Case, _bench, sdpa_decode_ms  # noqa: E402

HQ, HKV, D = 32, 8, 128
PACKED = ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4", "tq4", "tq3"]
ROWS: list[dict] = []
F16J_VARIANTS = [False]  # --f16j: also the fp16 join tree (paged.FAST['f16join'])


def correctness() -> None:
    cases = {
        "mixed": ([3001, 0, 777, 1500, 64], [1, 300, 5, 1, 130]),
        "decode": ([9000, 3000, 17], [1, 1, 1]),
        "verify": ([5000, 2047, 64], [5, 5, 5]),
    }
    for preset, hq, hkv, d in (
        ("turboquant_4bit_nc", 32, 8, 128),
        ("turboquant_3bit_nc", 32, 8, 128),
        ("turboquant_k8v4", 16, 16, 64),
        ("tq4", 32, 8, 128),
        ("tq3", 32, 8, 128),
        ("tq_k4v3_ub_s4_w128", 32, 8, 128),
    ):
        for (case, (ctx, ql)), f16j in itertools.product(cases.items(), F16J_VARIANTS):
            paged.FAST["f16join"] = f16j
            try:
                _check_one_step(preset, hq, hkv, d, ctx, ql, seed=1)
                msg = "ok"
            except AssertionError as e:
                msg = "FAIL " + str(e).splitlines()[0]
            print(f"check {preset:20s} {case:6s} f16join={int(f16j)}: {msg}", flush=True)
    paged.FAST["f16join"] = False


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def row(**kw) -> None:
    ROWS.append(kw)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


def ab(old, shapes, presets, sweep: bool) -> None:
    dev = torch.device("cuda")
    for n_req, L, qlen in shapes:
        shape = f"{n_req}x{qlen}x{L}"
        sd = sdpa_decode_ms(n_req, L, 1, HQ, HKV, D, dev)[0]
        row(shape=shape, preset="sdpa", ms=sd)
        for p in presets:
            try:
                one(old, p, n_req, L, qlen, shape, sd, sweep, dev)
            except Exception as e:  # report and go on with the next preset
                row(shape=shape, preset=p, error=f"{type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()


def one(old, p, n_req, L, qlen, shape, sd, sweep, dev) -> None:
    c = Case(p, n_req, L, qlen, HQ, HKV, D, dev)
    lay_new = c.layout
    c.layout = old.layout_for_format(c.fmt, dev)

    def run_old(c=c):
        return old.paged_attention(
            c.q, c.k, c.v, c.pages, c.layout, c.meta, c.d**-0.5, ring=c.ring, sinks=c.sinks, out=c.out
        )

    old_ms = _bench(run_old)
    o_old = c.out.clone()
    c.layout = lay_new
    new_ms = _bench(c.run)
    c.run()
    err = float((c.out.float() - o_old.float()).norm() / o_old.float().norm())
    ck = paged.LAST_LAUNCH.get("kernel")
    regs = getattr(ck, "n_regs", -1)
    row(shape=shape, preset=p, old=old_ms, new=new_ms, speedup=old_ms / new_ms, vs_sdpa=sd / new_ms,
        diff=err, regs=regs, spills=getattr(ck, "n_spills", -1))  # fmt: skip
    if len(F16J_VARIANTS) > 1 and p in PACKED:
        paged.FAST["f16join"] = True
        ms = _bench(c.run)
        c.run()
        err = float((c.out.float() - o_old.float()).norm() / o_old.float().norm())
        ck = paged.LAST_LAUNCH.get("kernel")
        row(shape=shape, preset=p, variant="f16join", ms=ms, vs_new=new_ms / ms, vs_sdpa=sd / ms, diff=err,
            regs=getattr(ck, "n_regs", -1), spills=getattr(ck, "n_spills", -1))  # fmt: skip
        paged.FAST["f16join"] = False
    if sweep == "verify" and p in ("turboquant_4bit_nc", "tq4", "tq3") and qlen > 1:
        for bn in (32, 64, 128) if p != "tq3" else (32, 64):
            tuning.OVERRIDES["decode"] = tuning.AttnConfig(1, bn, 4, 1, True)
            ms = _bench(c.run)
            ck = paged.LAST_LAUNCH.get("kernel")
            row(shape=shape, preset=p, tile=f"{bn}/4/1/pfTrue", ms=ms, vs_sdpa=sd / ms, regs=getattr(ck, "n_regs", -1),
                spills=getattr(ck, "n_spills", -1))  # fmt: skip
            tuning.OVERRIDES.clear()
    if sweep is True and p in ("turboquant_4bit_nc", "turboquant_3bit_nc", "tq4", "tq3") and qlen == 1:
        cfgs = [(64, 4, 1, False), (32, 4, 1, True), (64, 4, 1, 168), (128, 4, 1, True), (64, 8, 1, True)]
        cfgs.append((128, 8, 1, True))
        if p == "turboquant_3bit_nc":
            cfgs.append((128, 4, 2, False))
        if n_req > 1 or p == "turboquant_4bit_nc":
            for bn, nw, ns, pf in cfgs if n_req > 1 else cfgs[:3]:
                tuning.OVERRIDES["decode"] = tuning.AttnConfig(1, bn, nw, ns, bool(pf))
                if pf not in (True, False):  # a register cap
                    paged.LAUNCH_OPTS["maxnreg"] = pf
                try:
                    ms = _bench(c.run)
                    ck = paged.LAST_LAUNCH.get("kernel")
                    row(shape=shape, preset=p, tile=f"{bn}/{nw}/{ns}/pf{pf}", ms=ms, vs_sdpa=sd / ms,
                        regs=getattr(ck, "n_regs", -1))  # fmt: skip
                except Exception as e:  # out of resources: report and go on
                    row(shape=shape, preset=p, tile=f"{bn}/{nw}/{ns}/pf{pf}", error=type(e).__name__)
                tuning.OVERRIDES.clear()
                paged.LAUNCH_OPTS.clear()
            for sp in (1, 2, 3, 4, 6) if n_req > 1 else (16, 33, 48, 64, 128):
                ms = _bench(lambda c=c, sp=sp: c.run(sp))
                row(shape=shape, preset=p, splits=sp, ms=ms, vs_sdpa=sd / ms)
    c.free()
    del c
    torch.cuda.empty_cache()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick, sweep = "--quick" in sys.argv, "--sweep" in sys.argv
    sweep = "verify" if "--verify-sweep" in sys.argv else sweep
    if "--f16j" in sys.argv:
        F16J_VARIANTS.append(True)
    out_json = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    if out_json in args:
        args.remove(out_json)
    old_tuning = _load("tuning_old", args[1])
    old = _load("paged_old", args[0])
    old.pick_config, old.pick_splits = old_tuning.pick_config, old_tuning.pick_splits
    print(f"card {torch.cuda.get_device_name()}", flush=True)
    if not quick:
        correctness()
    ctx = 4096 if quick else 32768
    shapes = [(32, ctx, 1), (32, ctx, 5), (1, 4 * ctx, 1)]
    ab(old, shapes, ["auto", "fp8", *PACKED], sweep)
    if out_json:
        with open(out_json, "w") as f:
            json.dump(ROWS, f, indent=1)
