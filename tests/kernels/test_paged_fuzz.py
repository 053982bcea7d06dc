"""Seeded random sweep of the paged-attention kernel family against the torch reference (GPU).

The other kernel tests pin chosen combinations; this one draws them: a page format (every named
preset, plus TurboQuant names built from the grammar with random key / value bits, scale mode, sink
and window), head size, KV heads and GQA ratio, block size, and a batch that mixes decode, verify
(1 + k), extend chunks over a cached prefix and prefills from scratch, with lengths that are not
multiples of the block size, forced split counts and graph-padding rows. Each case runs one step
of `paged_attention` on NaN-poisoned outputs (`_check_one_step`: every element written, padding rows
zeroed, relative error <= 1e-2) and every third case also two steps through the Triton backend
(store kernel, attention, exact-window refresh) against the reference backend. The seed of a case
is its id, so a failure names a reproducible configuration.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_cases import backend_step_errors
from test_paged_attention import TOL, _check_one_step

from tqserve.kvquant.presets import ALL_PRESETS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = 36
# the gain-search presets' torch encoder (the reference writes every case's context) is slow
NAMED = [p for p in ALL_PRESETS if p not in ("tq4s", "tq3s")]


def _preset(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(NAMED)
    k, v = rng.choice([2, 3, 4, 5, 6, 8]), rng.choice([2, 3, 4, 5, 6, 8])
    name = f"tq_k{k}v{v}_{rng.choice(['nc', 'ub', 'plain'])}"
    if rng.random() < 0.5:
        name += f"_s{rng.choice([0, 1, 4])}_w{rng.choice([0, 8, 33, 48, 128])}"
    return name


def _lengths(rng: random.Random, bs: int, longest: int) -> tuple[list[int], list[int]]:
    """(cached context, new tokens) per request: decode, verify, extend over a prefix, prefill."""
    ctx, ql = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "decode", "verify", "extend", "prefill"])
        c = rng.choice([rng.randint(1, 3 * bs), rng.randint(3 * bs, longest)])
        if kind == "decode":
            ctx.append(c), ql.append(1)
        elif kind == "verify":
            ctx.append(c), ql.append(rng.randint(2, 8))
        elif kind == "extend":
            ctx.append(c), ql.append(rng.randint(9, 400))
        else:
            ctx.append(0), ql.append(rng.randint(1, 300))
    return ctx, ql


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3, 4, 8])
    group = rng.choice([1, 2, 3, 4, 5, 7, 8])
    bs = rng.choice([16, 16, 32, 64])
    # cases that also prefill through both backends stay shorter (the reference's prefill holds
    # [tokens, tokens] scores per head)
    ctx, ql = _lengths(rng, bs, 6000 if seed % 3 else 1500)
    return dict(
        preset=_preset(rng), hq=hkv * group, hkv=hkv, d=rng.choice([64, 128, 128, 256]), bs=bs, ctx=ctx, ql=ql,
        num_splits=rng.choice([None, None, None, 2, 7]), pad=rng.choice([0, 0, 3]),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(CASES))
def test_random_batches_match_reference(seed):
    c = _case(seed)
    print(f"\ncase {seed}: {c}")
    _check_one_step(
        c["preset"], c["hq"], c["hkv"], c["d"], c["ctx"], c["ql"],
        bs=c["bs"], seed=seed, num_splits=c["num_splits"], pad=c["pad"],
    )  # fmt: skip
    if seed % 3 == 0:
        # prefill the contexts through the backend (store kernel), then this step's mix on top
        steps = [([0] * len(c["ctx"]), [max(1, x) for x in c["ctx"]]), ([max(1, x) for x in c["ctx"]], c["ql"])]
        dev = torch.device("cuda")
        errs = backend_step_errors(c["preset"], c["hq"], c["hkv"], c["d"], steps, seed, seed, dev, bs=c["bs"])
        assert max(errs) <= TOL, f"case {seed} through the backend: rel err per step {errs}"


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_5bit_keys_narrow(seed, monkeypatch):
    """The same draws over 5-bit-key formats (tq4 and grammar names) with `NARROW_KEYS5` on, so that their
    decode / verify rows take the narrow kernel (extend and prefill rows stay with theirs)."""
    from tqserve.attention import paged_decode

    monkeypatch.setattr(paged_decode, "NARROW_KEYS5", 1)
    c = _case(1000 + seed)
    rng = random.Random(seed)
    c["preset"] = f"tq_k5v{rng.choice([2, 3, 4])}_{rng.choice(['nc', 'ub'])}"
    if rng.random() < 0.5:  # the grammar's sink and window suffixes (an alias such as tq4 takes none)
        c["preset"] += f"_s{rng.choice([0, 4])}_w{rng.choice([0, 32, 48])}"
    elif rng.random() < 0.5:
        c["preset"] = "tq4"
    print(f"\ncase {seed}: {c}")
    _check_one_step(
        c["preset"], c["hq"], c["hkv"], c["d"], c["ctx"], c["ql"],
        bs=c["bs"], seed=seed, num_splits=c["num_splits"], pad=c["pad"],
    )  # fmt: skip
