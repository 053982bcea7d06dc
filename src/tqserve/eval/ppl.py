"""Perplexity, KL divergence and top-1 agreement of each KV preset against the exact cache.

The text is tokenized once, the first `max_tokens` tokens are cut into windows of `window` tokens,
and each window is scored as one prompt whose attention reads the (quantized) cache. Per token:
NLL of the reference (`auto`) and of the preset, KL(p_ref || p_preset) and whether both argmax agree.
"""

from __future__ import annotations

import time

import torch

from tqserve.eval.runner import make_runner

REFERENCE = "auto"


def token_windows(ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    ids = ids[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]


def compare(ref_lp: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token metrics for log-prob rows [N, vocab] (row i predicts targets[i])."""
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)
    return {
        "nll_ref": -ref_lp.gather(1, targets[:, None])[:, 0],
        "nll": -lp.gather(1, targets[:, None])[:, 0],
        "kl": kl,
        "agree": (ref_lp.argmax(-1) == lp.argmax(-1)).float(),
    }


def summarize(per_token: dict[str, torch.Tensor]) -> dict[str, float]:
    ppl_ref = float(per_token["nll_ref"].mean().exp())
    ppl = float(per_token["nll"].mean().exp())
    return {
        "tokens": int(per_token["nll"].numel()),
        "ppl_ref": ppl_ref,
        "ppl": ppl,
        "ppl_delta_pct": 100.0 * (ppl / ppl_ref - 1.0),
        "kl_mean": float(per_token["kl"].mean()),
        "kl_p99": float(torch.quantile(per_token["kl"].double(), 0.99)),
        "top1_agree": float(per_token["agree"].mean()),
    }


def run_ppl(
    text: str,
    presets: list[str],
    window: int = 2048,
    max_tokens: int = 8192,
    backend: str = "auto",
    log=print,
    device: str = "cpu",
) -> dict:
    ref_runner = make_runner(REFERENCE, window, backend, device=device)
    ids = ref_runner.tokenizer.encode(text)
    windows = token_windows(ids, window, max_tokens)
    runners = {p: make_runner(p, window, backend, device=device) for p in presets if p != REFERENCE}
    acc: dict[str, dict[str, list[torch.Tensor]]] = {p: {} for p in runners}
    timing = {p: 0.0 for p in [REFERENCE, *runners]}
    for wi, win in enumerate(windows):
        t0 = time.time()
        ref_lp = ref_runner.logprobs(win)
        timing[REFERENCE] += time.time() - t0
        targets = torch.as_tensor(win[1:], device=ref_lp.device)
        for p, r in runners.items():
            t0 = time.time()
            m = {k: v.cpu() for k, v in compare(ref_lp, r.logprobs(win), targets).items()}
            timing[p] += time.time() - t0
            for k, v in m.items():
                acc[p].setdefault(k, []).append(v)
            s = summarize({k: torch.cat(v) for k, v in acc[p].items()})
            delta, kl = s["ppl_delta_pct"], s["kl_mean"]
            log(f"window {wi + 1}/{len(windows)} {p}: ppl {s['ppl']:.4f} ({delta:+.2f}%) KL {kl:.4f}")
    results = {p: summarize({k: torch.cat(v) for k, v in acc[p].items()}) for p in runners}
    ppl_ref = float(torch.cat(acc[next(iter(acc))]["nll_ref"]).mean().exp()) if acc else float("nan")
    results[REFERENCE] = {
        "tokens": sum(len(w) - 1 for w in windows),
        "ppl_ref": ppl_ref,
        "ppl": ppl_ref,
        "ppl_delta_pct": 0.0,
        "kl_mean": 0.0,
        "kl_p99": 0.0,
        "top1_agree": 1.0,
    }
    for p, r in results.items():
        r["seconds"] = timing.get(p, 0.0)
    return {
        "runner": ref_runner.kind,
        "window": window,
        "max_tokens": max_tokens,
        "num_windows": len(windows),
        "text_tokens_total": len(ids),
        "results": results,
    }
