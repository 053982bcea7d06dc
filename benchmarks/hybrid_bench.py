"""Prefill and decode tokens/s of a random-weight Qwen3.5-4B-shaped model through the tqserve
engine (LLM: scheduler, input-batch builder, fla prefill chunks, Triton GDN decode, Triton paged
attention, sampler) side by side with transformers' implementation (its fla fast path when fla is
installed) in the same process on the same card, with the same weights.

    PYTHONPATH=src:tests python benchmarks/hybrid_bench.py --out bench.json [--kv-cache-dtype auto tq4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def qwen35_4b_config(layers: int):
    from transformers import Qwen3_5TextConfig

    # Qwen3.5-4B shape: hidden 2560, 32 layers (3 GDN : 1 attention), GQA 16/4 x 256, vocab 248320.
    # The GDN head counts / dims and the MLP width are assumptions (Qwen3.5 defaults), not read from the hub.
    cfg = Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_prefill(llm, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """Seconds for the engine to prefill every prompt and sample its first token."""
    from tqserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    _sync()
    t = time.perf_counter()
    outs = llm.generate(reqs, params)
    _sync()
    return time.perf_counter() - t, [o.outputs[0].token_ids[0] for o in outs]


def engine_decode(llm, prompts: list[list[int]], steps: int, step_ms: list | None = None) -> float:
    """Tokens/s of the engine steps in which every request decodes (prefill done first, untimed).
    `step_ms` collects each step's wall time (a compile inside the timed loop shows up there)."""
    from tqserve import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"d{time.perf_counter_ns()}-{i}", p, params)
    while any(r.num_output_tokens == 0 for r in eng.scheduler.requests.values()):
        eng.step()
    _sync()
    t = time.perf_counter()
    tokens = 0
    while eng.has_unfinished_requests():
        tokens += len(eng.scheduler.running)
        t0 = time.perf_counter()
        eng.step()
        if step_ms is not None:
            _sync()
            step_ms.append(round((time.perf_counter() - t0) * 1e3, 2))
    _sync()
    return tokens / (time.perf_counter() - t)


def hf_prefill(ref, prompts: torch.Tensor) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        _sync()
        t = time.perf_counter()
        out = ref(prompts, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        _sync()
    return time.perf_counter() - t, nxt


def hf_decode(ref, cfg, prompts: torch.Tensor, steps: int) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        out = ref(prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        _sync()
        t = time.perf_counter()
        for _ in range(steps):
            out = ref(tok[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1)
        _sync()
    return prompts.shape[0] * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernel-warmup", action="store_true", help="compile every kernel shape class at engine start")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script runs")
    args = ap.parse_args()

    import model_factory
    from transformers import AutoModelForCausalLM

    from tqserve import LLM
    from tqserve.models.qwen3_5 import Qwen3_5ForCausalLM
    from tqserve.tokenizer import Tokenizer

    cfg = qwen35_4b_config(args.layers)
    dev = "cuda"
    if args.smoke:
        dev = "cpu"
        for k, v in dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16).items():  # fmt: skip
            setattr(cfg, k, v)
    torch.manual_seed(0)
    with torch.device(dev):
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        ours = Qwen3_5ForCausalLM(cfg, torch.bfloat16)
    ours.load_weights(ref.state_dict().items())
    # Token ids only: the tiny tokenizer just detokenizes (ids beyond its vocabulary decode to "").
    tok = Tokenizer(model_factory.make_tiny_tokenizer())
    res: dict = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "layers": args.layers,
        "dtype": "bfloat16",
        "rows": [],
    }
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    pre = torch.randint(0, vocab, (args.prefill_batch, args.prefill_len), generator=gen)
    dec = torch.randint(0, vocab, (args.decode_batch, args.decode_ctx), generator=gen)

    # transformers first (warm-up call, then the timed one), same prompts as the engine gets.
    hf_prefill(ref, pre.to(dev))
    t_ref, ref_next = hf_prefill(ref, pre.to(dev))
    hf_decode(ref, cfg, dec[:, :16].to(dev), 2)
    ref_dec = hf_decode(ref, cfg, dec.to(dev), args.decode_steps)
    ref_pre = pre.numel() / t_ref
    print(f"transformers: prefill {ref_pre:.0f} tok/s, decode {ref_dec:.1f} tok/s", flush=True)

    for kv in args.kv_cache_dtype:
        llm = LLM(
            loaded=(ours, cfg, tok),
            device=dev,
            dtype="bfloat16",
            kv_cache_dtype=kv,
            max_model_len=max(args.prefill_len, args.decode_ctx) + args.decode_steps + 16,
            max_num_seqs=max(args.prefill_batch, args.decode_batch),
            max_num_batched_tokens=max(args.prefill_batch * args.prefill_len, 2048),
            enable_prefix_caching=False,
            gpu_memory_utilization=0.6,
            kernel_warmup=args.kernel_warmup,
        )
        engine_prefill(llm, pre[:, :64].tolist())  # warm-up: Triton JIT, fla autotune
        engine_decode(llm, dec[:, :32].tolist(), 4)
        t_ours, our_next = engine_prefill(llm, pre.tolist())
        ours_dec = engine_decode(llm, dec.tolist(), args.decode_steps)
        step_ms: list[float] = []
        engine_decode(llm, dec.tolist(), args.decode_steps, step_ms)  # again, each step timed alone
        row = {
            "kv_cache_dtype": kv,
            "prefill": {"batch": args.prefill_batch, "len": args.prefill_len,
                        "tqserve_tok_s": pre.numel() / t_ours, "transformers_tok_s": ref_pre,
                        "ratio": (pre.numel() / t_ours) / ref_pre,
                        "top1_agree": float((torch.tensor(our_next) == ref_next.cpu()).float().mean())},
            "decode": {"batch": args.decode_batch, "context": args.decode_ctx, "steps": args.decode_steps,
                       "tqserve_tok_s": ours_dec, "transformers_tok_s": ref_dec, "ratio": ours_dec / ref_dec,
                       "step_ms": step_ms},
        }  # fmt: skip
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        del llm
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
