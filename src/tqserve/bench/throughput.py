"""`tqserve bench throughput`: decode tokens/s of the engine vs transformers' `generate`, side by
side in one run on one device (same model, same dtype, same prompts, greedy, fixed output length)."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time

import torch

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_tqserve(
    loaded,
    batch: int,
    new_tokens: int,
    device: str,
    dtype: str,
    prompt_len: int = 0,
    prompt_len_spread: int = 0,
    **engine_kwargs,
) -> float:
    """Output tokens/s of one batch, prompts included in the timing (as in transformers' generate).
    With prompt_len > 0 the prompts are synthetic token ids of that length and only the decode
    steps are timed (prefill is done first, then every request decodes new_tokens together). With
    prompt_len_spread S, request i's prompt is i mod (S + 1) tokens shorter: the requests then reach
    block boundaries (and the exact-window snapshots there) in different steps, as a server's do."""
    from tqserve import LLM, RequestOutputKind, SamplingParams

    max_len = max(1024, prompt_len + new_tokens + 16)
    if prompt_len:
        # The whole batch prefills in one step, so every request starts decoding in the same step
        # and the timed steps decode `batch` requests each (with chunked prefill, the first requests
        # would decode, and finish, while the last ones still prefill).
        engine_kwargs.setdefault("max_num_batched_tokens", batch * prompt_len)
    llm = LLM(
        loaded=loaded, device=device, dtype=dtype, max_model_len=max_len, max_num_seqs=max(batch, 1), **engine_kwargs
    )
    # the timed steps build no per-step outputs, as LLM.generate asks of the engine
    params = SamplingParams(
        temperature=0.0, max_tokens=new_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    llm.generate(["warm-up"], SamplingParams(temperature=0.0, max_tokens=4))
    dev = torch.device(llm.engine.model_config.device)
    if prompt_len:
        vocab = llm.engine.model_config.vocab_size
        prompts = [
            {
                "prompt_token_ids": [
                    (7 + 31 * i + 17 * j) % vocab for j in range(prompt_len - i % (prompt_len_spread + 1))
                ]
            }
            for i in range(batch)
        ]
        return _decode_only(llm, prompts, params, dev)
    prompts = [f"{PROMPT} (variant {i})" for i in range(batch)]
    _sync(dev)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(dev)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return batch * new_tokens / dt


class _GCTimer:
    """Time the interpreter spends in cyclic garbage collection (per generation) while active: a
    full collection walks every tracked container, KV page bookkeeping included."""

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms[info["generation"]] += (time.perf_counter() - self._t) * 1e3
            self.count[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def _decode_only(llm, prompts, params, dev, rounds: int = 2) -> float:
    """Prefill everything, then time the steps in which every request decodes one token. The whole
    batch runs `rounds` times and the last round is reported: the first one compiles every kernel
    specialization these shapes reach (long contexts, large batches), which the engine's short
    warm-up request does not, and a compile inside the timed steps would swamp them."""
    eng = llm.engine
    rate = 0.0
    for r in range(rounds):
        for i, p in enumerate(prompts):
            eng.add_request(f"b{r}-{i}", p["prompt_token_ids"], params)
        while any(q.num_output_tokens == 0 for q in eng.scheduler.requests.values()):
            eng.step()
        started = {q.num_output_tokens for q in eng.scheduler.requests.values()}
        if len(started) != 1 or len(eng.scheduler.running) != len(prompts):
            raise RuntimeError(f"the batch did not start decoding together (output tokens so far: {sorted(started)})")
        _sync(dev)
        t = time.perf_counter()
        # tokens the engine appends from here on, less those of a step already launched (async
        # scheduling: the sync above waited for it); a request's last step may run once more with its
        # token dropped, which the engine does not count either
        first = eng.num_generation_tokens + eng.num_samples_in_flight
        with _GCTimer() as gct:
            while eng.has_unfinished_requests():
                eng.step()
            _sync(dev)
        rate = (eng.num_generation_tokens - first) / (time.perf_counter() - t)
    print(f"  timed steps: garbage collection {gct.count} runs per generation, {sum(gct.ms):.1f} ms", flush=True)
    return rate


def bench_transformers(hf_model, tokenizer, batch: int, new_tokens: int, device: torch.device) -> float:
    prompts = [f"{PROMPT} (variant {i})" for i in range(batch)]
    tokenizer.hf.padding_side = "left"
    if tokenizer.hf.pad_token is None:
        tokenizer.hf.pad_token = tokenizer.hf.eos_token
    enc = tokenizer.hf(prompts, return_tensors="pt", padding=True).to(device)
    kw = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.hf.pad_token_id
    )
    with torch.inference_mode():
        hf_model.generate(**{k: v[:1] for k, v in enc.items()}, max_new_tokens=4, do_sample=False)
        _sync(device)
        t = time.perf_counter()
        out = hf_model.generate(**enc, **kw)
        _sync(device)
    dt = time.perf_counter() - t
    assert out.shape[1] - enc["input_ids"].shape[1] == new_tokens
    return batch * new_tokens / dt


def load_hf_reference(dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    from tqserve.models.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    return model.to(device).eval()


def _bool(text: str) -> bool:
    return {"true": True, "false": False}[text.lower()]


def main(argv: list[str] | None = None) -> int:
    from tqserve.engine.llm_engine import resolve_device, resolve_dtype
    from tqserve.models.loader import load_model

    p = argparse.ArgumentParser(prog="tqserve bench throughput")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    p.add_argument("--prompt-len", type=int, default=0, help="synthetic prompts of this many tokens; time decode only")
    p.add_argument(
        "--prompt-len-spread",
        type=int,
        default=0,
        help="request i's prompt is i mod (S + 1) tokens shorter (block boundaries in different steps)",
    )
    p.add_argument("--skip-transformers", action="store_true")
    # true / false lists: one side or both, timed side by side
    for flag, text in (
        ("--enforce-eager", "CUDA: decode without CUDA graphs (true), with (false)"),
        ("--disable-async-output-proc", "CUDA: process outputs after each step (true), during the next one (false)"),
        ("--async-scheduling", "CUDA: launch each step before the previous one is read back (true), after (false)"),
    ):
        default = [flag == "--async-scheduling"]
        p.add_argument(flag, nargs="+", type=_bool, default=default, help=text + ", or both (false true)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--repeats", type=int, default=1, help="run every side this many times, interleaved; report each one's median"
    )
    args = p.parse_args(argv)
    if not 0 <= args.prompt_len_spread < max(args.prompt_len, 1):
        p.error("--prompt-len-spread must be at least 0 and below --prompt-len")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    loaded = load_model(None, dtype, device)
    hf = None if args.skip_transformers else load_hf_reference(dtype, device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    if device.type != "cuda":  # the engine overlaps host and device work only with a GPU
        args.disable_async_output_proc, args.async_scheduling = [True], [False]
    rows = []
    for b in args.batch:
        sides = (args.kv_cache_dtype, args.enforce_eager, args.disable_async_output_proc, args.async_scheduling)
        configs = list(itertools.product(*sides))
        runs: dict[tuple[str, bool, bool, bool], list[float]] = {c: [] for c in configs}
        refs: list[float] = []
        for r in range(max(1, args.repeats)):
            # Every repeat runs each configuration once, in an order rotated by one, so drift of the
            # machine (other load, clocks) and the position in the sequence spread over all of them.
            if hf is not None:
                refs.append(bench_transformers(hf, loaded[2], b, args.new_tokens, device))
            for kv, eager, sync_out, ahead in configs[r % len(configs) :] + configs[: r % len(configs)]:
                runs[kv, eager, sync_out, ahead].append(
                    bench_tqserve(
                        loaded,
                        b,
                        args.new_tokens,
                        str(device),
                        dtype_name,
                        args.prompt_len,
                        args.prompt_len_spread,
                        kv_cache_dtype=kv,
                        enforce_eager=eager,
                        disable_async_output_proc=sync_out,
                        async_scheduling=ahead,
                    )
                )
        ref = statistics.median(refs) if refs else None
        for (kv, eager, sync_out, ahead), ours_all in runs.items():
            ours = statistics.median(ours_all)
            row = {
                "batch": b,
                "prompt_len": args.prompt_len,
                "prompt_len_spread": args.prompt_len_spread,
                "kv_cache_dtype": kv,
                "enforce_eager": eager,
                "disable_async_output_proc": sync_out,
                "async_scheduling": ahead,
                "tqserve_tok_s": ours,
            }
            if len(ours_all) > 1:
                row.update(tqserve_runs=ours_all, transformers_runs=refs)
            mode = "eager" if eager or device.type != "cuda" else "graphs"
            mode += (" sync-out" if sync_out else " async-out") + (" ahead" if ahead else "")
            prompt = f"{args.prompt_len:5d}" + (f"-{args.prompt_len_spread}" if args.prompt_len_spread else "")
            line = f"batch {b:3d} prompt {prompt} kv={kv:20s} {mode:6s} tqserve {ours:9.1f} tok/s"
            if len(ours_all) > 1:
                line += f" (runs {', '.join(f'{x:.1f}' for x in ours_all)})"
            if ref is not None:
                row.update(transformers_tok_s=ref, ratio=ours / ref)
                line += f"  transformers {ref:9.1f} tok/s  ratio {ours / ref:5.2f}x"
            rows.append(row)
            print(line, flush=True)
    result = {
        "card": card,
        "dtype": dtype_name,
        "new_tokens": args.new_tokens,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
