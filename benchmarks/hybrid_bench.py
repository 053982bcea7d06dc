"""Prefill and decode tokens/s of a random-weight Qwen3.5-4B-shaped model: tqserve's hybrid model
(fla prefill, Triton GDN decode, driven by the test driver with a torch SDPA KV backend, no engine,
no CUDA graphs) side by side with transformers (its fla fast path when fla is installed) in the same
process on the same card.

    PYTHONPATH=src:tests python benchmarks/hybrid_bench.py --out bench.json
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


def timed(fn, reps: int = 1) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


class OursRunner:
    def __init__(self, model, num_slots: int, max_len: int) -> None:
        import hybrid_factory as hf

        self.hf, self.model = hf, model
        self.drv = hf.Driver(model, num_slots=num_slots, max_len=max_len)

    @torch.no_grad()
    def step(self, batch):
        """batch: (slot, token ids, context length). Returns the next greedy token per request."""
        from tqserve.layers.attention import ForwardContext

        meta = self.hf.build_meta([(s, c, len(t)) for s, t, c in batch], "cuda")
        ctx = ForwardContext(self.drv.backend, meta)
        ctx.state_pool = self.drv.pool
        ids = torch.tensor([i for _, t, _ in batch for i in t], device="cuda")
        hidden = self.model(ids, meta.positions, ctx)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]).argmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-ctx", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, DynamicCache

    from tqserve.models.qwen3_5 import Qwen3_5ForCausalLM

    cfg = qwen35_4b_config(args.layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
        ours = Qwen3_5ForCausalLM(cfg, torch.bfloat16)
    ours.load_weights(ref.state_dict().items())
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "dtype": "bfloat16",
    }
    vocab = cfg.vocab_size

    # ---- prefill: B prompts of L tokens in one step --------------------------------------------
    b, n = args.prefill_batch, args.prefill_len
    prompts = torch.randint(0, vocab, (b, n), device="cuda")
    runner = OursRunner(
        ours,
        num_slots=max(b, args.decode_batch) + 1,
        max_len=max(n, args.decode_ctx) + 64,
    )
    batch = [(i + 1, prompts[i].tolist(), 0) for i in range(b)]
    ours_next = runner.step(batch)  # warmup: Triton JIT + fla autotune
    t_ours = timed(lambda: runner.step(batch), 2)
    with torch.no_grad():
        ref_out = ref(prompts, logits_to_keep=1)
        t_ref = timed(lambda: ref(prompts, logits_to_keep=1), 2)
    res["prefill"] = {
        "batch": b, "len": n, "tqserve_tok_s": b * n / t_ours, "transformers_tok_s": b * n / t_ref,
        "top1_agree": float((ref_out.logits[:, -1].argmax(-1) == ours_next).float().mean()),
    }  # fmt: skip
    print(json.dumps(res["prefill"]), flush=True)

    # ---- decode: B requests with C context tokens, S greedy steps ------------------------------
    b, c, steps = args.decode_batch, args.decode_ctx, args.decode_steps
    prompts = torch.randint(0, vocab, (b, c), device="cuda")
    nxt = runner.step([(i + 1, prompts[i].tolist(), 0) for i in range(b)])

    def ours_decode():
        tok = nxt
        for s in range(steps):
            tok = runner.step([(i + 1, [int(x)], c + s) for i, x in enumerate(tok.tolist())])

    ours_decode()  # warmup (overwrites the same positions: fine for timing)
    runner.step([(i + 1, prompts[i].tolist(), 0) for i in range(b)])
    t_ours = timed(ours_decode)

    def ref_decode():
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            out = ref(prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = ref(
                    tok[:, None],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                tok = out.logits[:, -1].argmax(-1)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

    ref_decode()
    t_ref = ref_decode()
    res["decode"] = {
        "batch": b, "context": c, "steps": steps,
        "tqserve_tok_s": b * steps / t_ours, "transformers_tok_s": b * steps / t_ref,
    }  # fmt: skip
    print(json.dumps(res["decode"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
