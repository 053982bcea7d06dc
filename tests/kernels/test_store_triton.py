"""Fused store kernel vs each format's torch `write` (kvquant/reference.py is the ground truth)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tqserve.kvquant.packing import unpack_bits
from tqserve.kvquant.presets import make_layer_format
from tqserve.kvquant.store_triton import StorePlan, store_kv

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
if DEV.type == "cpu" and not INTERP:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)


def _compare(preset: str, hkv: int, d: int, t: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bs, nb = 16, (t + 15) // 16 + 3
    fmt = make_layer_format(preset, 2, hkv, d, torch.bfloat16)
    want, got = fmt.allocate(nb, bs, DEV), fmt.allocate(nb, bs, DEV)
    for p in got.values():  # poison: every written slot must be overwritten
        p.view(torch.uint8).fill_(0x7F)
    for name in want:
        want[name].copy_(got[name])
    k = (torch.randn(t, hkv, d, generator=gen) * 3).to(DEV, torch.bfloat16)
    v = torch.randn(t, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    slots = (torch.randperm((nb - 1) * bs, generator=gen)[:t] + bs).to(DEV)
    slots[1::5] = -1  # skipped writes must leave pages untouched
    keep = slots >= 0
    fmt.write(want, k[keep], v[keep], slots[keep])
    store_kv(got, StorePlan(fmt, DEV), k, v, slots)
    # rows (slot, head) whose indices differ: their TurboQuant scale legitimately differs too
    # (one flipped index moves <y, c> by about 1/d), so scales are compared on the other rows only
    flipped = {}
    for name in want:
        if want[name].dtype == torch.uint8:
            bits = want[name].shape[-1] * 8 // d
            side = name.split("_")[0]
            diff = (unpack_bits(want[name], bits, d) != unpack_bits(got[name], bits, d)).any(-1)
            flipped[side] = flipped.get(side, torch.zeros_like(diff)) | diff
    for name in want:
        a, b = want[name], got[name]
        if name.endswith("_scale") and name.split("_")[0] in flipped:
            keep_rows = ~flipped[name.split("_")[0]]
            assert keep_rows.float().mean() > 0.99
            a, b = a[keep_rows], b[keep_rows]
        if a.dtype == torch.uint8:
            bits = a.shape[-1] * 8 // d
            mism = (unpack_bits(a, bits, d) != unpack_bits(b, bits, d)).float().mean().item()
            # Indices must match bit for bit, except where float summation order moves a rotated
            # coordinate across a decision boundary (a few in a million).
            assert mism <= 1e-4, f"{preset} {name}: {mism:.2e} of indices differ"
            continue
        # the poison is NaN in fp8 / fp16: untouched slots must still hold it, on both sides
        assert torch.equal(a.float().isnan(), b.float().isnan()), f"{preset} {name}: written slots differ"
        fp8 = a.dtype == torch.float8_e4m3fn
        a, b = a.float().nan_to_num(0.0), b.float().nan_to_num(0.0)
        if fp8:
            # The CPU interpreter rounds fp32 -> e4m3 wrongly next to powers of two (7.84 -> 4.0), and
            # on the GPU Triton's conversion differs from torch's by one e4m3 step on rare inputs
            # (seen on H200: max 3.6% of the row max). Same value almost everywhere, never further off.
            off = (a != b).float().mean().item()
            assert off <= (0.05 if INTERP else 2e-3), f"{preset} {name}: {off:.2%} differ"
            ulp = a.abs().clamp_min(2.0**-6) * 2.0**-3
            assert ((a - b).abs() <= (2.0 if INTERP else 1.0) * ulp + 1e-9).all() or INTERP
        else:
            err = ((a - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-6)).item()
            assert err <= 1e-3, f"{preset} {name}: max rel err {err:.2e}"


@pytest.mark.parametrize(
    "preset,d",
    [
        ("auto", 64),
        ("fp8", 64),
        ("turboquant_k8v4", 64),
        ("turboquant_4bit_nc", 64),
        ("turboquant_3bit_nc", 80),  # block-diagonal rotation, padded tile
        ("tq_k4v3_ub_s4_w128", 64),
        ("tq_k5v6_plain", 64),
    ],
)
def test_store_matches_reference(preset, d):
    _compare(preset, 3, d, 21, seed=d + len(preset))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset", ["auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq4", "tq3"]
)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_store_gpu(preset, d):
    _compare(preset, 8, d, 1000, seed=d)
