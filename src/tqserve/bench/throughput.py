"""`tqserve bench throughput`: decode tokens/s of the engine vs transformers' `generate`, side by
side in one run on one device (same model, same dtype, same prompts, greedy, fixed output length)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_tqserve(loaded, batch: int, new_tokens: int, device: str, dtype: str, **engine_kwargs) -> float:
    from tqserve import LLM, SamplingParams

    llm = LLM(loaded=loaded, device=device, dtype=dtype, max_model_len=1024, max_num_seqs=max(batch, 1), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [f"{PROMPT} (variant {i})" for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    _sync(torch.device(llm.engine.model_config.device))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(torch.device(llm.engine.model_config.device))
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return batch * new_tokens / dt


def bench_transformers(hf_model, tokenizer, batch: int, new_tokens: int, device: torch.device) -> float:
    prompts = [f"{PROMPT} (variant {i})" for i in range(batch)]
    tokenizer.hf.padding_side = "left"
    if tokenizer.hf.pad_token is None:
        tokenizer.hf.pad_token = tokenizer.hf.eos_token
    enc = tokenizer.hf(prompts, return_tensors="pt", padding=True).to(device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.hf.pad_token_id)
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


def main(argv: list[str] | None = None) -> int:
    from tqserve.engine.llm_engine import resolve_device, resolve_dtype
    from tqserve.models.loader import load_model

    p = argparse.ArgumentParser(prog="tqserve bench throughput")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    loaded = load_model(None, dtype, device)
    hf = load_hf_reference(dtype, device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    rows = []
    for b in args.batch:
        ref = bench_transformers(hf, loaded[2], b, args.new_tokens, device)
        for kv in args.kv_cache_dtype:
            ours = bench_tqserve(loaded, b, args.new_tokens, str(device), dtype_name, kv_cache_dtype=kv)
            rows.append({"batch": b, "kv_cache_dtype": kv, "tqserve_tok_s": ours, "transformers_tok_s": ref, "ratio": ours / ref})
            print(f"batch {b:3d} kv={kv:12s} tqserve {ours:9.1f} tok/s  transformers {ref:9.1f} tok/s  ratio {ours / ref:5.2f}x")
    result = {"card": card, "dtype": dtype_name, "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
