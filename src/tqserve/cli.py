"""tqserve serve | generate | eval | bench."""

from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags with `vllm serve`'s names."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-dtype-skip-layers", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=_parse_bytes, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "reference", "triton"])
    p.add_argument("--chat-template", default=None)
    p.add_argument(
        "--kernel-warmup",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CUDA: compile every kernel shape class at startup (throw-away steps)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly, no CUDA graphs")
    p.add_argument(
        "--cuda-graph-sizes", type=int, nargs="+", default=None, help="decode batch sizes captured as CUDA graphs"
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA: launch each step before the previous one is read back",
    )
    p.add_argument(
        "--disable-async-output-proc",
        action="store_true",
        help="CUDA: process each step's outputs after it instead of while the next step runs",
    )
    p.add_argument(
        "--num-window-snapshots",
        type=int,
        default=None,
        help="exact-window snapshots for prefix-cache hits of window presets (0 = recompute from pages)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    from tqserve.config import EngineArgs

    names = EngineArgs.field_names()
    return {k: v for k, v in vars(args).items() if k in names and k != "model"}


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tqserve import SamplingParams
    from tqserve.config import EngineArgs
    from tqserve.engine.llm_engine import LLMEngine

    prompts = list(args.prompt)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = ["Write a short poem about a lighthouse."]
    engine = LLMEngine(EngineArgs(model=args.model, **engine_kwargs(args)))
    for line in engine.capacity_report().lines():
        print(line, file=sys.stderr)
    tok = engine.tokenizer
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    for i, p in enumerate(prompts):
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        else:
            ids = tok.encode(p)
        engine.add_request(str(i), ids, params, prompt=p)
    stream = len(prompts) == 1
    bar = tqdm(total=len(prompts), desc="Generating", disable=stream, file=sys.stderr)
    shown = 0
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if stream:
                text = out.outputs[0].text
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
            if out.finished:
                results[out.request_id] = out
                bar.update(1)
    bar.close()
    if stream:
        print()
    else:
        for i, p in enumerate(prompts):
            print(f"### {p}\n{results[str(i)].outputs[0].text}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="tqserve")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline, streaming to the terminal")
    gen.add_argument("model", nargs="?", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--prompt", "-p", action="append", default=[])
    gen.add_argument("--file", "-f", default=None, help="one prompt per line")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    for name in ("eval", "bench"):
        sub.add_parser(name, help=f"tqserve {name} ... (see `tqserve {name} --help`)", add_help=False)

    if argv and argv[0] in ("eval", "bench"):
        return _dispatch_tool(argv[0], argv[1:])
    if argv and argv[0] == "serve":
        from tqserve.server.args import add_serve_args

        add_serve_args(serve)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "serve":
        from tqserve.server.api_server import run_server

        return run_server(args) or 0
    return 2


def _dispatch_tool(name: str, argv: list[str]) -> int:
    if name == "eval":
        from tqserve.eval.cli import main as eval_main

        return eval_main(argv) or 0
    from tqserve.bench.cli import main as bench_main

    return bench_main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
