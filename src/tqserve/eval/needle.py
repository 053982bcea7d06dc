"""Needle in a haystack: a number hidden at a depth of a long prose prompt, asked for at the end.

For each (context length, depth) the prompt is haystack tokens with the needle sentence inserted at
`depth` of the haystack, followed by the question; the answer is the number. One prefill of
prompt + answer through the engine gives, at the answer positions, (a) the teacher-forced
log-likelihood of the answer and (b) whether greedy decoding reproduces it: greedy decoding emits the
answer exactly when every teacher-forced argmax equals the answer token (the same prefixes are fed).
"""

from __future__ import annotations

import random

import torch

from tqserve.eval.runner import make_runner

REFERENCE = "auto"
NEEDLE = "\nThe secret number is {n}. Remember it: the secret number is {n}.\n"
QUESTION = "\n\nQuestion: What is the secret number mentioned in the text above?\nAnswer: The secret number is"


def build_case(tokenizer, haystack_ids: list[int], length: int, depth: float, seed: int) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) with len(prompt + answer) == length."""
    n = random.Random(seed).randrange(10_000, 99_999)
    needle = tokenizer.encode(NEEDLE.format(n=n), add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    full = tokenizer.encode(QUESTION + f" {n}", add_special_tokens=False)
    if full[: len(question)] != question:
        raise RuntimeError("question tokens change when the answer is appended")
    answer = full[len(question) :]
    room = length - len(needle) - len(question) - len(answer)
    if room <= 0 or room > len(haystack_ids):
        raise ValueError(f"length {length} does not fit the haystack ({len(haystack_ids)} tokens)")
    hay = haystack_ids[:room]
    at = round(depth * room)
    return hay[:at] + needle + hay[at:] + question, answer


def score_case(runner, prompt: list[int], answer: list[int]) -> dict:
    lp = runner.logprobs(prompt + answer, last=len(answer)).cpu()  # rows predicting the answer tokens
    target = torch.as_tensor(answer)
    ll = float(lp.gather(1, target[:, None]).sum())
    found = bool((lp.argmax(-1) == target).all())
    return {"loglik": ll, "found": found}


def run_needle(
    text: str,
    presets: list[str],
    lengths=(1024, 2048, 4096, 8192),
    depths=(0.1, 0.5, 0.9),
    backend: str = "auto",
    with_reference: bool = True,
    log=print,
    device: str = "cpu",
    on_cell=None,
) -> dict:
    """Score every (length, depth) cell for each preset (plus the exact reference unless told not to:
    runs split over processes are joined by `finalize`). `on_cell(result so far)` after each cell."""
    names = list(dict.fromkeys(([REFERENCE] if with_reference else []) + list(presets)))
    runners = {p: make_runner(p, max(lengths), backend, device=device) for p in names}
    tok = next(iter(runners.values())).tokenizer
    hay = tok.encode(text, add_special_tokens=False)
    cells = []
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            prompt, answer = build_case(tok, hay, length, depth, seed=1000 * li + di)
            row = {
                "length": length,
                "depth": depth,
                "results": {p: score_case(r, prompt, answer) for p, r in runners.items()},
            }
            cells.append(row)
            if on_cell is not None:
                on_cell({"lengths": list(lengths), "depths": list(depths), "cells": cells})
            log(
                f"len {length} depth {depth:.2f}: "
                + ", ".join(f"{p} {'Y' if r['found'] else 'n'} {r['loglik']:.3f}" for p, r in row["results"].items())
            )
    return {"lengths": list(lengths), "depths": list(depths), "cells": cells}


def finalize(parts: list[dict]) -> dict:
    """Join per-process results on (length, depth), compare every preset with the reference, summarize."""
    base = parts[0]
    cells = {
        (c["length"], c["depth"]): {"length": c["length"], "depth": c["depth"], "results": {}} for c in base["cells"]
    }
    for part in parts:
        for c in part["cells"]:
            cells[(c["length"], c["depth"])]["results"].update(c["results"])
    cells = list(cells.values())
    presets = list(dict.fromkeys(p for c in cells for p in c["results"]))
    if REFERENCE not in presets:
        raise ValueError("no reference results to compare with")
    for c in cells:
        ref = c["results"][REFERENCE]
        for res in c["results"].values():
            diff = res["loglik"] - ref["loglik"]
            res["loglik_diff"] = diff
            res["loglik_rel"] = diff / abs(ref["loglik"]) if ref["loglik"] else 0.0
            # within 5%: relative to the reference log-likelihood, or the answer probability within
            # about 5% when the reference is nearly certain (|ll| < 1 nat)
            res["loglik_ok"] = abs(diff) <= 0.05 * max(abs(ref["loglik"]), 1.0)
    summary = {}
    for p in presets:
        rs = [c["results"][p] for c in cells if p in c["results"]]
        refs = [c["results"][REFERENCE] for c in cells if p in c["results"]]
        summary[p] = {
            "found": sum(r["found"] for r in rs),
            "cells": len(rs),
            "missed_where_reference_found": sum(1 for r, q in zip(rs, refs) if q["found"] and not r["found"]),
            "loglik_ok": sum(r["loglik_ok"] for r in rs),
            "max_abs_loglik_diff": max(abs(r["loglik_diff"]) for r in rs),
        }
    return {"lengths": base["lengths"], "depths": base["depths"], "cells": cells, "summary": summary}
