"""`tqserve eval distortion | ppl | needle`: JSON + PNG in an output directory and a table on stdout."""

from __future__ import annotations

import argparse
import os

from tqserve.kvquant.presets import ALL_PRESETS, describe_preset

DEFAULT_PRESETS = [
    "bfloat16",
    "fp8",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "tq4",
    "tq3",
    "tq4s",
    "tq3s",
]
_REPO_TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "data", "alice29.txt")


def _text(path: str | None) -> str:
    path = path or os.path.normpath(_REPO_TEXT)
    with open(path, encoding="utf-8") as f:
        return f.read()


def _presets(s: str | None) -> list[str]:
    return [p for p in (s.split(",") if s else DEFAULT_PRESETS) if p]


def _size_columns(name: str, head_dim: int, context: int, num_layers: int | None = None) -> dict:
    info = describe_preset(name, head_dim, context_len=context, num_layers=num_layers)
    return {
        "bits": info["bits_per_value_total"],
        "page_bytes": info["page_bytes_per_token_head"],
        "exact_bytes": info["exact_overhead_bytes_per_token_head"],
        "capacity": info["capacity_vs_bf16"],
        "keys": info["keys"],
        "values": info["values"],
        "sink_window": f"{info['sink']}/{info['window']}",
    }


def _setup_device(args) -> None:
    if args.device != "cpu":
        from tqserve.eval.runner import strict_fp32

        strict_fp32()


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device != "cpu" else "cpu"


def cmd_distortion(args) -> None:
    import torch

    from tqserve.eval import distortion, report

    torch.set_num_threads(args.threads)
    rows = distortion.random_unit_distortion(n=args.n)
    print(
        report.table(
            rows,
            [
                ("d", "d", ""),
                ("bits", "b", ""),
                ("scale_mode", "scale", ""),
                ("mse", "MSE", ".5f"),
                ("mse_theory_table", "table", ".5f"),
                ("mse_theory_d", "theory(d)", ".5f"),
                ("ip_ratio", "<x,x^>/|x|^2", ".4f"),
                ("ip_err_x_d", "IP err x d", ".4f"),
            ],
        )
    )
    out = {"random_unit": rows}
    report.plot_distortion(rows, os.path.join(args.out, "distortion_random.png"))
    if args.tokens > 0:
        from tqserve.eval.runner import _load_default_model

        tok = _load_default_model()[2]
        ids = tok.encode(_text(args.text))[: args.tokens]
        cap, scale = distortion.capture_qkv(ids)
        res = distortion.model_kv_distortion(cap, scale, [p for p in _presets(args.presets) if p not in ("auto",)])
        rows2 = [{"preset": p, **{k: v for k, v in r.items() if k != "per_layer"}} for p, r in res.items()]
        print(
            report.table(
                rows2,
                [
                    ("preset", "preset", ""),
                    ("key_rel_mse", "K rel MSE", ".5f"),
                    ("value_rel_mse", "V rel MSE", ".5f"),
                    ("attn_rel_mse", "attn out rel MSE", ".5f"),
                ],
            )
        )
        out["model_kv"] = {"tokens": len(ids), "presets": res}
    print("wrote", report.write_json(args.out, "distortion.json", out))


def cmd_ppl(args) -> None:
    import torch

    from tqserve.eval import ppl, report

    torch.set_num_threads(args.threads)
    _setup_device(args)
    res = ppl.run_ppl(
        _text(args.text),
        _presets(args.presets),
        window=args.window,
        max_tokens=args.max_tokens,
        backend=args.backend,
        log=lambda s: print(s, flush=True),
        device=args.device,
    )
    res["device"] = _device_name(args.device)
    rows = []
    for p, r in res["results"].items():
        rows.append({"preset": p, **_size_columns(p, args.head_dim, args.context, args.num_layers), **r})
    rows.sort(key=lambda r: -r["bits"])
    res["rows"] = rows
    print(report.table(rows, _PPL_COLUMNS))
    report.plot_ppl(rows, os.path.join(args.out, "ppl.png"))
    print("wrote", report.write_json(args.out, "ppl.json", res))


_PPL_COLUMNS = [
    ("preset", "preset", ""),
    ("keys", "keys", ""),
    ("values", "values", ""),
    ("sink_window", "S/W", ""),
    ("page_bytes", "page B/tok/head", "d"),
    ("bits", "bits/value", ".3f"),
    ("capacity", "x bf16", ".2f"),
    ("ppl", "ppl", ".4f"),
    ("ppl_delta_pct", "ppl %", "+.2f"),
    ("kl_mean", "mean KL", ".4f"),
    ("kl_p99", "p99 KL", ".4f"),
    ("top1_agree", "top-1", ".4f"),
]


def cmd_merge(args) -> None:
    """Merge the rows of several `eval ppl` runs over the same text and windows into one table + plot."""
    import json

    from tqserve.eval import report

    rows: dict[str, dict] = {}
    meta = None
    for path in args.inputs.split(","):
        with open(path) as f:
            data = json.load(f)
        key = (data["window"], data["max_tokens"], data["num_windows"])
        if meta is not None and key != meta:
            raise SystemExit(f"{path}: different windows {key} vs {meta}")
        meta = key
        for r in data["rows"]:
            rows.setdefault(r["preset"], r)
    merged = sorted(rows.values(), key=lambda r: -r["bits"])
    print(report.table(merged, _PPL_COLUMNS))
    report.plot_ppl(merged, os.path.join(args.out, "ppl.png"))
    out = {"window": meta[0], "max_tokens": meta[1], "num_windows": meta[2], "rows": merged}
    print("wrote", report.write_json(args.out, "ppl.json", out))


def _needle_report(res: dict, out_dir: str) -> None:
    from tqserve.eval import report

    rows = [{"preset": p, **s} for p, s in res["summary"].items()]
    cols = [
        ("preset", "preset", ""),
        ("found", "found", "d"),
        ("cells", "cells", "d"),
        ("missed_where_reference_found", "missed vs exact", "d"),
        ("loglik_ok", "loglik within 5%", "d"),
        ("max_abs_loglik_diff", "max |dLL|", ".3f"),
    ]
    print(report.table(rows, cols))
    report.plot_needle(res, os.path.join(out_dir, "needle.png"))
    print("wrote", report.write_json(out_dir, "needle.json", res))


def cmd_needle(args) -> None:
    import torch

    from tqserve.eval import needle, report

    torch.set_num_threads(args.threads)
    _setup_device(args)
    raw = needle.run_needle(
        _text(args.text),
        _presets(args.presets),
        lengths=[int(x) for x in args.lengths.split(",")],
        depths=[float(x) for x in args.depths.split(",")],
        backend=args.backend,
        with_reference=not args.no_reference,
        log=lambda s: print(s, flush=True),
        device=args.device,
    )
    raw["device"] = _device_name(args.device)
    report.write_json(args.out, "needle_raw.json", raw)
    if not args.no_reference:
        _needle_report(needle.finalize([raw]), args.out)


def cmd_needle_merge(args) -> None:
    import json

    from tqserve.eval import needle

    parts = []
    for path in args.inputs.split(","):
        with open(path) as f:
            parts.append(json.load(f))
    _needle_report(needle.finalize(parts), args.out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tqserve eval", description="KV-cache quality evaluation")
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default="eval_out", help="output directory (JSON + PNG)")
    common.add_argument("--text", default=None, help="prose text file (default: tests/data/alice29.txt)")
    common.add_argument("--presets", default=None, help=f"comma-separated presets (known: {', '.join(ALL_PRESETS)})")
    common.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    common.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "engine", "direct"],
        help="engine: through tqserve.LLM; direct: model + reference backend (same formats)",
    )
    common.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: the engine on the GPU, float32 without TF32, reference attention backend",
    )
    d = sub.add_parser("distortion", parents=[common], help="codec MSE / inner-product error vs theory")
    d.add_argument("--n", type=int, default=8192, help="random unit vectors per (d, bits)")
    d.add_argument("--tokens", type=int, default=512, help="tokens of captured model K/V (0 = skip)")
    d.set_defaults(fn=cmd_distortion)
    p = sub.add_parser("ppl", parents=[common], help="perplexity, KL and top-1 vs the exact cache")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=64, help="head size used for the size columns")
    p.add_argument("--context", type=int, default=4096, help="context length at which sink/window bytes are counted")
    p.add_argument("--num-layers", type=int, default=30, help="attention layers, for per-layer presets' average size")
    p.set_defaults(fn=cmd_ppl)
    n = sub.add_parser("needle", parents=[common], help="needle-in-a-haystack recall and answer log-likelihood")
    n.add_argument("--lengths", default="1024,2048,4096,8192")
    n.add_argument("--depths", default="0.1,0.5,0.9")
    n.add_argument("--no-reference", action="store_true", help="skip the exact reference (join runs with needle-merge)")
    n.set_defaults(fn=cmd_needle)
    nm = sub.add_parser("needle-merge", help="join `eval needle` raw JSON files (needle_raw.json) and compare")
    nm.add_argument("--inputs", required=True)
    nm.add_argument("--out", default="eval_out")
    nm.set_defaults(fn=cmd_needle_merge)
    m = sub.add_parser("merge", help="merge several `eval ppl` JSON files into one table + plot")
    m.add_argument("--inputs", required=True, help="comma-separated ppl.json files")
    m.add_argument("--out", default="eval_out")
    m.set_defaults(fn=cmd_merge)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.fn(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
