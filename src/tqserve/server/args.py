"""`tqserve serve` flags, named as `vllm serve` names them, and their mapping onto EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Any

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """'2G' = 2e9, '2GiB' = 2 * 2**30, '512m' = 512e6, '4096' = 4096 (decimal unless 'i' is written)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 512M, 2G, 1.5GiB)")
    number, unit, binary, _ = m.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** _POWERS[unit.lower()])


def parse_token_count(text: str) -> int:
    """Token counts accept the same suffixes ('32k' = 32000, '32Ki' = 32768); -1 passes through (auto)."""
    if str(text).strip() == "-1":
        return -1
    return parse_size(text)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every `tqserve serve` flag to `parser` (the model is an optional positional)."""
    parser.add_argument("model_tag", nargs="?", default=None, help="model path or name; omitted = the default model")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")

    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (use 0.0.0.0 to listen on all interfaces)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        default=os.environ.get("TQSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (env TQSERVE_API_KEY)",
    )
    srv.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use; first one is reported")
    srv.add_argument("--chat-template", default=None, help="Jinja chat template: a file path or the template itself")
    srv.add_argument(
        "--max-request-body-bytes",
        type=parse_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="reject larger request bodies with 413 (default 16MiB)",
    )
    srv.add_argument("--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    srv.add_argument("--disable-log-requests", action="store_true", help="no info line per finished request")
    srv.add_argument("--no-warmup", action="store_true", help="report ready without running a warm-up request")

    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", default=None, help="model dtype: auto, bfloat16, float16, float32")
    eng.add_argument("--max-model-len", type=parse_token_count, default=None, help="context length (e.g. 4096, 32k)")
    eng.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one batch")
    eng.add_argument("--max-num-batched-tokens", type=parse_token_count, default=None, help="token budget per step")
    eng.add_argument("--block-size", type=int, default=None, help="tokens per KV page")
    eng.add_argument("--kv-cache-dtype", default=None, help="KV cache preset (auto, fp8, turboquant presets...)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=None, help="fraction of device memory to use")
    eng.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory_bytes",
        type=parse_size,
        default=None,
        help="KV cache size (e.g. 2GiB); overrides --gpu-memory-utilization",
    )
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    eng.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    eng.add_argument("--seed", type=int, default=None)
    eng.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    eng.add_argument(
        "--kernel-warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: compile every kernel shape class at startup (throw-away steps); off by default",
    )
    eng.add_argument(
        "--enforce-eager", action="store_true", default=None, help="CUDA: run decode steps eagerly, no CUDA graphs"
    )
    eng.add_argument(
        "--cuda-graph-sizes", type=int, nargs="+", default=None, help="decode batch sizes captured as CUDA graphs"
    )
    eng.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: launch each step before the previous one is read back (default on)",
    )
    eng.add_argument(
        "--disable-async-output-proc",
        action="store_true",
        default=None,
        help="CUDA: process each step's outputs after it instead of while the next step runs",
    )
    eng.add_argument(
        "--num-window-snapshots",
        type=int,
        default=None,
        help="exact-window snapshots kept for prefix-cache hits of sink / window KV presets "
        "(default min(2 * max-num-seqs, 64); 0 = recompute the window from pages)",
    )
    return parser


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template` takes a file path or the template text, like vLLM's."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def model_name(args: argparse.Namespace) -> str | None:
    return args.model_tag or args.model


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Flag values that EngineArgs has a field for; unset flags stay out so the engine defaults apply."""
    values: dict[str, Any] = {
        "model": model_name(args),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "seed": args.seed,
        "device": args.device,
        "kernel_warmup": args.kernel_warmup,
        "enforce_eager": args.enforce_eager,
        "cuda_graph_sizes": args.cuda_graph_sizes,
        "disable_async_output_proc": args.disable_async_output_proc,
        "async_scheduling": args.async_scheduling,
        "num_window_snapshots": args.num_window_snapshots,
        "chat_template": resolve_chat_template(args.chat_template),
        "served_model_name": args.served_model_name[0] if args.served_model_name else None,
    }
    return {k: v for k, v in values.items() if v is not None or k == "model"}


def build_engine_args(args: argparse.Namespace) -> Any:
    try:
        from tqserve.engine.arg_utils import EngineArgs
    except ImportError:  # the engine keeps EngineArgs in tqserve.config
        from tqserve.config import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = engine_kwargs(args)
    unknown = sorted(k for k, v in kwargs.items() if k not in names and v is not None)
    if unknown:
        raise ValueError(f"this engine build does not support: {', '.join(unknown)}")
    return EngineArgs(**{k: v for k, v in kwargs.items() if k in names})
