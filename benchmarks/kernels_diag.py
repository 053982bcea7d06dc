"""Device diagnosis of the packed decode paths: A/B timing of the current kernel (default, fp16 join
tree, 2 pipeline stages) against an older paged.py, then correctness of the decoding variants at real sizes."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))

from test_paged_attention import _check_one_step  # noqa: E402

from tqserve.attention import paged, tuning  # noqa: E402
from tqserve.bench.kernels import Case, _bench, sdpa_decode_ms  # noqa: E402

CASES = {"mixed": ([3001, 0, 777, 1500, 64], [1, 300, 5, 1, 130]), "decode": ([9000, 3000], [1, 1])}


def correctness(quick: bool = False) -> None:
    for preset, hq, hkv, d in (
        ("turboquant_4bit_nc", 32, 8, 128),
        ("turboquant_3bit_nc", 32, 8, 128),
        ("turboquant_k8v4", 16, 16, 64),
        ("tq_k4v3_ub_s4_w128", 32, 8, 128),
    ):
        variants = ((1, 1, 0),) if quick else ((1, 1, 0), (1, 1, 1), (0, 0, 0))
        for (pairs, ints, f16j), case in itertools.product(variants, CASES):
            paged.FAST.update(pairs=bool(pairs), ints=bool(ints), f16join=bool(f16j))
            try:
                _check_one_step(preset, hq, hkv, d, *CASES[case], seed=1)
                msg = "ok"
            except AssertionError as e:
                msg = str(e).splitlines()[0]
            print(f"{preset:20s} pairs={pairs} ints={ints} f16join={f16j} {case:6s}: {msg}", flush=True)
    paged.FAST.update(pairs=True, ints=True, f16join=False)


def ab(old_file: str, quick: bool = False) -> None:
    spec = importlib.util.spec_from_file_location("paged_old", old_file)
    old = importlib.util.module_from_spec(spec)
    sys.modules["paged_old"] = old
    spec.loader.exec_module(old)
    dev = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    for n_req, L in ((32, 32768),) if quick else ((32, 32768), (1, 131072)):
        sd = sdpa_decode_ms(n_req, L, 1, hq, hkv, d, dev)[0]
        print(f"sdpa decode {n_req}x{L}: {sd:.3f} ms", flush=True)
        for p in ("turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4", "tq4", "tq3"):
            c = Case(p, n_req, L, 1, hq, hkv, d, dev)
            lay_new = c.layout
            c.layout = old.layout_for_format(c.fmt, dev)

            def run_old(c=c):
                return old.paged_attention(
                    c.q, c.k, c.v, c.pages, c.layout, c.meta, c.d**-0.5, ring=c.ring, sinks=c.sinks, out=c.out
                )

            old_ms = _bench(run_old)
            o_old = c.out.clone()
            c.layout = lay_new
            line = f"{p:20s} {n_req}x{L}: old {old_ms:.3f} ms ({sd / old_ms:.2f}x SDPA)"
            variants = (("default", 0, None), ("f16join", 1, None), ("stages=2", 0, 2), ("f16j+s2", 1, 2))
            for label, f16j, st in variants[:2] if quick else variants:
                paged.FAST.update(f16join=bool(f16j))
                tuning.OVERRIDES.clear()
                if st:
                    tuning.OVERRIDES["decode"] = tuning.AttnConfig(1, 64, 4, st)
                ms = _bench(c.run)
                c.run()
                err = float((c.out.float() - o_old.float()).norm() / o_old.float().norm())
                line += f" | {label} {ms:.3f} ms ({sd / ms:.2f}x) diff {err:.1e}"
            paged.FAST.update(f16join=False)
            tuning.OVERRIDES.clear()
            print(line, flush=True)
            c.free()
            del c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    q = "--quick" in sys.argv
    correctness(q)
    ab(sys.argv[1], q)
