"""Store-kernel A/B in one process: `tqserve bench kernels`' store rows (16K tokens, pages in random order, the L2
flushed before each CUDA-graph replay; 1 layer and `kernels.STORE_LAYERS` layers back to back), variants
interleaved round by round, medians printed.

python benchmarks/store_ab.py PRESETS VARIANTS [ROUNDS]

PRESETS: comma-separated. VARIANTS: `label:spec;label:spec;...`, each spec a comma-separated list of
`ATTR=value` (a knob of `tqserve.kvquant.store_triton`), `file=path` (another copy of that module, e.g. a
committed version from `git show REV:src/tqserve/kvquant/store_triton.py`) or `shape=tokens/warps/regs` (the
launch shape). Each variant starts from the module's defaults: knobs another variant set are put back.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys

import torch

from tqserve.bench import kernels
from tqserve.kvquant import store_triton

_MODULES: dict[str, object] = {}
_DEFAULTS: dict[int, dict[str, object]] = {}


def _module(path: str):
    if path not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"store_variant_{len(_MODULES)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[path] = mod
    return _MODULES[path]


def _apply(spec: str) -> None:
    """Set up one variant: the module under test (in sys.modules, where `kernels.store_case` imports it from),
    every knob and the launch shape at the module's defaults, then the spec's."""
    items = [x.split("=", 1) for x in spec.split(",") if x]
    mod = next((_module(v) for k, v in items if k == "file"), store_triton)
    sys.modules["tqserve.kvquant.store_triton"] = mod
    if id(mod) not in _DEFAULTS:
        knobs = {k: v for k, v in vars(mod).items() if k.isupper() and isinstance(v, int | float)}
        _DEFAULTS[id(mod)] = {**knobs, "_launch_shape": mod._launch_shape}
    for key, val in _DEFAULTS[id(mod)].items():
        setattr(mod, key, val)
    for key, val in items:
        if key == "shape":
            shape = tuple(int(x) or None for x in val.split("/"))
            mod._launch_shape = lambda plan, s=shape: s
        elif key != "file":
            setattr(mod, key, type(getattr(mod, key))(val))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("presets", help="comma-separated KV presets")
    ap.add_argument("variants", help="label:spec;label:spec;... (see above)")
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    args = ap.parse_args(argv)
    presets = args.presets.split(",")
    variants = [v.split(":", 1) if ":" in v else (v, "") for v in args.variants.split(";")]
    rounds = args.rounds
    dev = torch.device("cuda")
    kernels.GRAPHS = True
    bw = kernels.copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}  copy {bw:.0f} GB/s", flush=True)
    res: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for preset in presets:
            for layers in (1, kernels.STORE_LAYERS):
                for label, spec in variants:
                    _apply(spec)
                    ms, gbps = kernels.store_case(preset, 16384, 8, 128, dev, "pages", layers)
                    res.setdefault((preset, layers, label), []).append((ms, gbps / bw))
    _apply("")
    for (preset, layers, label), xs in res.items():
        ms = statistics.median(x[0] for x in xs)
        frac = statistics.median(x[1] for x in xs)
        each = " ".join(f"{x[0] * 1000:.2f}" for x in xs)
        print(f"{preset:22s} {layers} layers {label:10s} {ms * 1000:8.2f} us {frac:6.1%} of copy  rounds {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
