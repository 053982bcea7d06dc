"""KV-preset design sweep behind docs/kv-quality.md (one run, GPU or CPU, results as JSON).

1. Per-layer sensitivity on held-out text (the 2,048 tokens after the evaluation's 8,192): for a
   base preset, the drop in mean KL vs the exact cache when one layer alone gets one more key bit or
   one more value bit (each costs 8 B per token and KV head at head size 64).
2. Candidates: for each bit budget and exact-window size, the base preset plus as many of the most
   useful single-layer upgrades (largest KL drop first) as the budget leaves room for; plus uniform
   presets and the reference rows (fp8, vLLM's four).
3. Perplexity / KL / top-1 of every candidate over the evaluation text (8,192 tokens, windows of
   2,048), and the needle grid for the exact cache and the best candidates.

Partial results are written after every step, so a run cut short still reports what it measured.
Usage: python scripts/kv_quality_sweep.py --device cuda --out OUT [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from tqserve.eval import needle, ppl
from tqserve.eval.cli import _size_columns, _text
from tqserve.eval.runner import _load_default_model, make_runner, strict_fp32
from tqserve.kvquant.presets import describe_preset

REFERENCE_ROWS = [
    "fp8",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
# (budget in bits/value at 4K, base codec, the two upgrades)
BUDGETS = [
    (4.5, "tq_k5v3_ub", ("k6", "v4")),
    (3.5, "tq_k4v2_ub", ("k5", "v3")),
]
UNIFORM = [
    "tq_k5v3_ub_s4_w32",
    "tq_k5v3_ub_s4_w60",
    "tq_k5v3_nc_s4_w60",
    "tq_k5v3_ub_s8_w56",
    "tq_k6v2_ub_s4_w60",
    "tq_k4v2_ub_s4_w48",
    "tq_k4v2_ub_s4_w60",
    "tq_k4v2_nc_s4_w60",
]
SINK = 4
WINDOWS = (60, 44, 28, 12)


def _cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Sweep:
    def __init__(self, args) -> None:
        self.args = args
        self.t0 = time.time()
        self.out = args.out
        self.state: dict = {"device": args.device, "args": vars(args)}
        if args.device != "cpu":
            strict_fp32()
            self.state["device_name"] = torch.cuda.get_device_name(0)
        model = _load_default_model(args.device)
        self.num_layers = len(model[0].kv_layer_specs())
        self.state["num_layers"] = self.num_layers
        tok = model[2]
        ids = tok.encode(_text(None))
        self.windows = ppl.token_windows(ids, args.window, args.max_tokens)
        self.held = ids[args.max_tokens : args.max_tokens + args.window]
        self.state["text_tokens"] = len(ids)
        self.ref_eval: list[torch.Tensor] = []
        self.ref_held: torch.Tensor | None = None

    def elapsed(self) -> float:
        return time.time() - self.t0

    def save(self) -> None:
        self.state["elapsed_s"] = self.elapsed()
        with open(os.path.join(self.out, "sweep.json"), "w") as f:
            json.dump(self.state, f, indent=1)

    def runner(self, preset: str, max_len: int):
        return make_runner(preset, max_len, "engine", device=self.args.device)

    # 1. sensitivity ------------------------------------------------------------------------
    def references(self) -> None:
        r = self.runner("auto", self.args.window)
        self.ref_held = r.logprobs(self.held)
        self.ref_eval = [r.logprobs(w) for w in self.windows]
        del r
        _cleanup()

    def held_kl(self, preset: str) -> float:
        r = self.runner(preset, self.args.window)
        lp = r.logprobs(self.held)
        del r
        _cleanup()
        t = torch.as_tensor(self.held[1:])
        return float(ppl.compare(self.ref_held, lp, t)["kl"].mean())

    def sensitivity(self) -> None:
        sens = self.state.setdefault("sensitivity", {})
        layers = range(self.num_layers) if not self.args.tiny else range(2)
        for _budget, codec, ups in BUDGETS:
            base = f"{codec}_s{SINK}_w28"
            entry = sens.setdefault(base, {"base_kl": self.held_kl(base), "gain": {}})
            for layer in layers:
                for up in ups:
                    kl = self.held_kl(f"{base}+{up}@{layer}")
                    entry["gain"][f"{up}@{layer}"] = entry["base_kl"] - kl
                print(f"[{self.elapsed():.0f}s] sens {base} layer {layer}", flush=True)
            self.save()

    # 2. candidates -------------------------------------------------------------------------
    def candidates(self) -> list[str]:
        names: list[str] = []
        for budget, codec, _ups in BUDGETS:
            base28 = f"{codec}_s{SINK}_w28"
            gains = self.state["sensitivity"][base28]["gain"]
            ranked = [k for k, g in sorted(gains.items(), key=lambda kv: -kv[1]) if g > 0]
            for w in WINDOWS:
                base = f"{codec}_s{SINK}_w{w}"
                best = None
                for n in range(len(ranked) + 1):
                    name = base + _groups(ranked[:n])
                    info = describe_preset(name, 64, num_layers=self.num_layers)
                    if info["bits_per_value_total"] <= budget + 1e-9:
                        best = name
                    else:
                        break
                if best and best not in names:
                    names.append(best)
        self.state["candidates"] = names
        return names

    # 3. ppl / KL / top-1 over the evaluation text ------------------------------------------------
    def evaluate(self, presets: list[str]) -> None:
        res = self.state.setdefault("ppl", {})
        for p in presets:
            if p in res:
                continue
            if self.elapsed() > self.args.budget_s * 0.7:
                print(f"time budget: skipping ppl of {p}", flush=True)
                continue
            r = self.runner(p, self.args.window)
            acc: dict[str, list[torch.Tensor]] = {}
            for w, ref in zip(self.windows, self.ref_eval):
                m = ppl.compare(ref, r.logprobs(w), torch.as_tensor(w[1:]))
                for k, v in m.items():
                    acc.setdefault(k, []).append(v)
            del r
            _cleanup()
            s = ppl.summarize({k: torch.cat(v) for k, v in acc.items()})
            s.update(_size_columns(p, 64, 4096, self.num_layers))
            res[p] = s
            print(
                f"[{self.elapsed():.0f}s] {p}: {s['bits']:.3f} bits ppl {s['ppl_delta_pct']:+.2f}% "
                f"KL {s['kl_mean']:.4f} top1 {s['top1_agree']:.4f}",
                flush=True,
            )
            self.save()

    def needles(self, presets: list[str]) -> None:
        lengths = [int(x) for x in self.args.lengths.split(",")]
        depths = [0.1, 0.5, 0.9]
        raw = needle.run_needle(
            _text(None),
            presets,
            lengths=lengths,
            depths=depths,
            backend="engine",
            log=lambda s: print(f"[{self.elapsed():.0f}s] {s}", flush=True),
            device=self.args.device,
            on_cell=self._needle_partial,
        )
        self.state["needle"] = needle.finalize([raw])
        self.save()

    def _needle_partial(self, raw: dict) -> None:
        self.state["needle_raw"] = raw
        self.save()


def _groups(ups: list[str]) -> str:
    by: dict[str, list[int]] = {}
    for u in ups:
        kind, layer = u.split("@")
        by.setdefault(kind, []).append(int(layer))
    return "".join(f"+{k}@{'.'.join(str(x) for x in sorted(v))}" for k, v in sorted(by.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: short windows, 2 layers in the scan")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--needle-top", type=int, default=3, help="best <= 4.5-bit candidates in the needle grid")
    ap.add_argument("--presets", default=None, help="only these presets (no sensitivity scan, no reference rows)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    sw = Sweep(args)
    sw.references()
    if args.presets:
        sw.evaluate(args.presets.split(","))
    else:
        sw.sensitivity()
        cands = sw.candidates()
        sw.evaluate(cands + UNIFORM + REFERENCE_ROWS)
    res = sw.state["ppl"]
    tq = [p for p in res if p.startswith("tq_")]

    def goal1(p: str) -> bool:
        r = res[p]
        return r["ppl_delta_pct"] <= 0.3 and r["kl_mean"] <= 0.005 and r["top1_agree"] >= 0.97

    small = sorted(
        (p for p in tq if 3.5 < res[p]["bits"] <= 4.5 + 1e-9), key=lambda p: (not goal1(p), res[p]["kl_mean"])
    )
    three = sorted((p for p in tq if res[p]["bits"] <= 3.5 + 1e-9), key=lambda p: res[p]["kl_mean"])
    picks = small[: args.needle_top] + three[:1]
    if "tq_k5v3_ub_s4_w32" in res and "tq_k5v3_ub_s4_w32" not in picks:
        picks.append("tq_k5v3_ub_s4_w32")
    sw.state["needle_presets"] = picks
    sw.save()
    sw.needles(picks)
    print(f"done in {sw.elapsed():.0f}s", flush=True)


if __name__ == "__main__":
    main()
