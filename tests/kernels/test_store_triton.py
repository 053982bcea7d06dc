"""Fused store kernel vs each format's torch `write` (kvquant/reference.py is the ground truth), and
the Triton backend (store kernel + paged attention) for the gain-search presets."""

from __future__ import annotations

import pytest
import torch
from paged_cases import backend_step_errors
from triton_env import DEV, INTERP, triton_kernels

from tqserve.kvquant import store_triton
from tqserve.kvquant.packing import unpack_bits
from tqserve.kvquant.presets import make_layer_format
from tqserve.kvquant.store_triton import MINMAX, TQ, TQ_DENSE, StorePlan, store_kv

pytestmark = triton_kernels


def _recon_err(fmt, pages, x: torch.Tensor, slots: torch.Tensor, side: str) -> torch.Tensor:
    """||x - decode(pages)||^2 / ||x||^2 per (token, head) row, decoded by the torch reference."""
    xh = fmt.read(pages, slots)[0 if side == "k" else 1]
    x = x.float()
    return ((x - xh) ** 2).sum(-1) / (x * x).sum(-1).clamp_min(1e-30)


def _check_search_rows(preset, fmt, want, got, k, v, slots, d):
    """Gain search: rows whose indices differ from the reference's must be near-ties, i.e. reconstruct
    their vector as well as the reference's indices do (to rounding).

    The search picks the gain of the largest cos(y, c[idx]) over ~50 candidate index sets; y is the
    reference's bit for bit (fixed point), but the kernel sums each cosine in another float32 order,
    which moves it by ~1e-7, so where two candidates' cosines agree that closely either may win, often
    with many different indices (the bound below allows ties up to ~1e-5). Both modes' error falls with the cosine
    (nc: 2 (1 - cos), unbiased: 1 / cos^2 - 1), so such a tie moves the relative error by < 2 * 1e-5,
    and the two fp16 scales (2^-11 relative each) move it by up to about 2 * 2^-11 of itself apiece."""
    for side, x in (("k", k), ("v", v)):
        codec = fmt.key_codec if side == "k" else fmt.value_codec
        bs = want[f"{side}_idx"].shape[2]
        page, off = slots // bs, slots % bs
        iw = unpack_bits(want[f"{side}_idx"][page, :, off], codec.bits, d)
        ig = unpack_bits(got[f"{side}_idx"][page, :, off], codec.bits, d)
        rows = (iw != ig).any(-1)  # [tokens, heads]
        if not rows.any():
            continue
        ew, eg = _recon_err(fmt, want, x, slots, side)[rows], _recon_err(fmt, got, x, slots, side)[rows]
        bad = eg > ew * (1 + 2.0**-9) + 2e-5
        assert not bad.any(), (
            f"{preset} {side}: {int(bad.sum())} of {int(rows.sum())} differing rows reconstruct worse than the "
            f"reference's (error {eg[bad].tolist()[:4]} vs {ew[bad].tolist()[:4]})"
        )


def _assert_tq_pages_identical(plan: StorePlan, want: dict, got: dict, what: str) -> None:
    """TurboQuant sides (the nearest-centroid encoder, Hadamard tiles or the dense path) write the
    reference's bytes exactly: indices and fp16 scales (both rotate in the same fixed point, `tq_rotate`)."""
    for mode, _bits, pay, sc, _zr, _tab in plan.sides:
        if mode not in (TQ, TQ_DENSE):
            continue
        for name in (pay, sc):
            a, b = want[name].view(torch.uint8), got[name].view(torch.uint8)
            rows = (a != b).reshape(*a.shape[:3], -1).any(-1)
            assert not rows.any(), f"{what} {name}: {int(rows.sum())} of {rows.numel()} rows differ from the reference"


def _assert_minmax_pages_identical(plan: StorePlan, want: dict, got: dict, what: str) -> None:
    """Min-max sides write the reference's packed indices bit for bit, and its fp16 scales and zeros (as
    values: the zero of a row of signed zeros is the minimum of +0 and -0, either sign by reduction order,
    and decodes the same)."""
    for mode, _bits, pay, sc, zr, _tab in plan.sides:
        if mode != MINMAX:
            continue
        a, b = want[pay], got[pay]
        rows = (a != b).reshape(*a.shape[:3], -1).any(-1)
        assert not rows.any(), f"{what} {pay}: {int(rows.sum())} of {rows.numel()} rows differ from the reference"
        for name in (sc, zr):
            a, b = want[name].float(), got[name].float()
            rows = ~((a == b) | (a.isnan() & b.isnan()))
            assert not rows.any(), f"{what} {name}: {int(rows.sum())} of {rows.numel()} rows differ from the reference"


def _compare(preset: str, hkv: int, d: int, t: int, seed: int, wmax: int | None = None) -> None:
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
    plan = StorePlan(fmt, DEV, wmax=wmax)
    store_kv(got, plan, k, v, slots)
    if not plan.search:
        _assert_tq_pages_identical(plan, want, got, preset)
    if plan.search:
        _check_search_rows(preset, fmt, want, got, k[keep], v[keep], slots[keep], d)
    # rows (slot, head) whose indices differ (gain-search ties only): their TurboQuant scale
    # legitimately differs too (the scale follows the indices), so scales are compared on the other rows
    flipped = {}
    minmax_names = {side[2] for side in plan.sides if side[0] == MINMAX}
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
            # Indices match bit for bit: TurboQuant rotates in the reference's fixed point, min-max
            # divides as IEEE does. Gain search: a near-tie between two gains changes several indices
            # of one row at once; such rows are held to `_check_search_rows` instead (and to the 1%
            # bound on differing rows above); its min-max sides must still match exactly.
            if not plan.search or name in minmax_names:
                assert mism == 0.0, f"{preset} {name}: {mism:.2e} of indices differ"
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
        ("tq4s", 64),  # gain search, nc: tq_k5v3_ncs_s4_w60
        ("tq3s", 64),  # gain search, unbiased: tq_k4v2_ubs_s4_w60
        ("tq_k4v4_ncs", 80),  # gain search over a 64 + 16 tile rotation
        ("tq_k3v6_ubs", 32),
    ],
)
def test_store_matches_reference(preset, d):
    _compare(preset, 3, d, 21, seed=d + len(preset))


def _bit_identical_case(preset: str, d: int, dtype: torch.dtype, t: int, seed: int, wmax: int | None = None) -> None:
    """Store kernel vs reference on rows built to stress the fixed point: a wide spread of norms
    (2^-90 .. 2^40), all-zero rows, rows below the 2^-99 floor, one huge coordinate among tiny ones,
    integer-valued rows, float32 / fp16 / bf16 inputs, rows whose rotated coordinates sit on a
    quantization boundary's float neighbours (tiny nudges of one coordinate)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, bs = 2, 16
    nb = (t + bs - 1) // bs + 2
    fmt = make_layer_format(preset, 1, hkv, d, torch.bfloat16)
    x = torch.randn(2, t, hkv, d, generator=gen)
    x = x * torch.exp2(torch.randint(-90, 40, (2, t, hkv, 1), generator=gen).float())
    x[:, 0] = 0.0
    x[:, 1] = 1e-33
    x[:, 2] = torch.randn(2, hkv, d, generator=gen) * 1e-6
    x[:, 2, :, 5] = 3e4
    x[:, 3] = torch.randint(-9, 10, (2, hkv, d), generator=gen).float()
    x[:, 4:8] = x[:, 8:12] * (1 + 2.0**-22 * torch.randint(-3, 4, (2, 4, hkv, d), generator=gen))
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    k, v = x.to(DEV, dtype)
    slots = (torch.randperm((nb - 1) * bs, generator=gen)[:t] + bs).to(DEV)
    want, got = fmt.allocate(nb, bs, DEV), fmt.allocate(nb, bs, DEV)
    fmt.write(want, k, v, slots)
    plan = StorePlan(fmt, DEV, wmax=wmax)
    tq = any(mode in (TQ, TQ_DENSE) for mode, *_ in plan.sides)
    assert (plan.tiles is not None) == (tq and (wmax is None or wmax >= 16)) and not plan.search
    store_kv(got, plan, k, v, slots)
    _assert_tq_pages_identical(plan, want, got, f"{preset} d {d} {dtype}")
    _assert_minmax_pages_identical(plan, want, got, f"{preset} d {d} {dtype}")


@pytest.mark.parametrize(
    "preset,d,dtype",
    [
        ("turboquant_4bit_nc", 64, torch.float32),
        ("turboquant_4bit_nc", 128, torch.bfloat16),
        ("turboquant_3bit_nc", 80, torch.float16),
        ("tq_k4v3_ub_s4_w128", 256, torch.float32),
        ("tq_k5v6_plain", 64, torch.float32),
    ],
)
def test_store_tq_bit_identical(preset, d, dtype):
    _bit_identical_case(preset, d, dtype, 40, seed=d)


@pytest.mark.parametrize(
    "preset,dtype", [("turboquant_4bit_nc", torch.bfloat16), ("turboquant_3bit_nc", torch.float16)]
)
def test_store_minmax_bit_identical(preset, dtype):
    """Min-max values on the stress rows (norms 2^-90 .. 2^40: scales and zeros clamped to the fp16 range, codes
    clamped at both ends; zero, constant and integer rows): the reference's bytes. Under the interpreter the
    clamps' path; the saturating index (`SAT_INDEX`, inline PTX) is the GPU test's."""
    _bit_identical_case(preset, 64, dtype, 40, seed=19)


@pytest.mark.gpu
@pytest.mark.parametrize("sat", [0, 1])
@pytest.mark.parametrize(
    "preset", ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_minmax_bit_identical_gpu(preset, dtype, sat, monkeypatch):
    monkeypatch.setattr(store_triton, "SAT_INDEX", sat)
    _bit_identical_case(preset, 128, dtype, 20000, seed=23)


@pytest.mark.parametrize("preset,d", [("turboquant_4bit_nc", 72), ("tq_k4v3_ub_s4_w128", 64)])
def test_store_tq_bit_identical_dense(preset, d):
    """The dense-rotation path (block of 8, or tiles capped below 16 columns) in the same fixed point."""
    _bit_identical_case(preset, d, torch.float32, 24, seed=d, wmax=8)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq_k4v3_ub_s4_w128"])
@pytest.mark.parametrize("d", [72, 128])
def test_store_tq_bit_identical_dense_gpu(preset, d):
    _bit_identical_case(preset, d, torch.bfloat16, 20000, seed=d, wmax=8)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc", "tq3", "tq_k4v3_ub_s4_w128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_store_tq_bit_identical_gpu(preset, d, dtype):
    _bit_identical_case(preset, d, dtype, 20000, seed=d)


@pytest.mark.parametrize(
    "preset,dtype", [("tq3", torch.bfloat16), ("turboquant_3bit_nc", torch.float16), ("tq_k4v4_ub", torch.float32)]
)
def test_store_signs_at_load_everywhere(preset, dtype, monkeypatch):
    """The rotation's signs applied at the load (`SIGNS_AT_LOAD = 2`: every tiled side, not only the tuned
    4bit_nc launch): the same page bits as the reference, for 16-bit inputs (a sign-bit XOR) and float32
    ones (a multiply)."""
    monkeypatch.setattr(store_triton, "SIGNS_AT_LOAD", 2)
    _bit_identical_case(preset, 64, dtype, 40, seed=11)


@pytest.mark.parametrize("sign_xor", [0, 1])
@pytest.mark.parametrize(
    "preset,dtype", [("tq3", torch.bfloat16), ("tq4", torch.float16), ("tq_k4v4_ub", torch.float32)]
)
def test_store_sign_xor(preset, dtype, sign_xor, monkeypatch):
    """The rotation's signs flipped on the fixed-point tile's fp16 copy by a sign-bit XOR (`SIGN_XOR`) or
    by the float32 multiply: the same page bits as the reference either way."""
    monkeypatch.setattr(store_triton, "SIGN_XOR", sign_xor)
    plan = StorePlan(make_layer_format(preset, 1, 2, 64, dtype), "cpu")
    assert store_triton.sign_mode(plan) == 2 * sign_xor
    _bit_identical_case(preset, 64, dtype, 40, seed=13)


def test_split_sides_rule(monkeypatch):
    """Keys and values in separate programs (`split_sides`): by default the tuned launches of two TurboQuant sides
    and of one whose codes stay within words (4bit_nc, then capped at 64 registers), not the 8 x 1 launch of one
    3-bit side, d = 256 or the gain search; `SPLIT_SIDES` 2 / 0 forces it on / off."""
    presets = ("turboquant_4bit_nc", "tq3", "tq4", "tq_k4v4_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc",
               "turboquant_k8v4", "tq4s", "bfloat16")  # fmt: skip
    plans = {p: StorePlan(make_layer_format(p, 1, 8, 128, torch.bfloat16), "cpu") for p in presets}
    split = [p for p, plan in plans.items() if store_triton.split_sides(plan)]
    assert split == ["turboquant_4bit_nc", "tq3", "tq4", "tq_k4v4_nc"]
    assert store_triton._launch_shape(plans["turboquant_4bit_nc"]) == (16, 2, store_triton.SPLIT_ONE_SIDE_MAXNREG)
    wide = StorePlan(make_layer_format("turboquant_4bit_nc", 1, 8, 256, torch.bfloat16), "cpu")
    assert not store_triton.split_sides(wide)
    monkeypatch.setattr(store_triton, "SPLIT_SIDES", 0)
    assert not any(store_triton.split_sides(plan) for plan in plans.values())
    assert store_triton._launch_shape(plans["turboquant_4bit_nc"]) == (16, 2, 80)
    monkeypatch.setattr(store_triton, "SPLIT_SIDES", 2)
    assert all(store_triton.split_sides(plan) for plan in plans.values())


@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize(
    "preset,dtype",
    [("turboquant_4bit_nc", torch.bfloat16), ("tq3", torch.float32), ("turboquant_3bit_nc", torch.float16)],
)
def test_store_split_sides(preset, dtype, split, monkeypatch):
    """Sides in one program or in two (`SPLIT_SIDES`, forced either way): the reference's page bits, skipped
    slots untouched (`_compare`: poisoned pages, every fifth slot -1)."""
    monkeypatch.setattr(store_triton, "SPLIT_SIDES", split)
    _bit_identical_case(preset, 64, dtype, 40, seed=29)
    _compare(preset, 2, 64, 40, seed=31)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize(
    "preset", ["turboquant_4bit_nc", "tq3", "tq4", "tq_k4v4_nc", "turboquant_3bit_nc", "turboquant_k8v4", "fp8", "auto"]
)
def test_store_split_sides_gpu(preset, split, monkeypatch):
    """`test_store_split_sides` at real sizes, for every launch the rule can pick and pages without a codec."""
    monkeypatch.setattr(store_triton, "SPLIT_SIDES", split)
    if preset in ("fp8", "auto", "turboquant_k8v4"):
        _compare(preset, 8, 128, 3000, seed=37)
    else:
        _bit_identical_case(preset, 128, torch.bfloat16, 20000, seed=37)
        _compare(preset, 8, 128, 3000, seed=37)


def test_minmax_rows_rule(monkeypatch):
    """`_minmax_rows` (`MINMAX_ROWS`): by default the min-max sides of the tuned launches (a TurboQuant key side at
    d <= 128): 2- or 4-bit codes at a power-of-two head size >= 32, 3-bit codes at d % 128 == 0 in the contiguous
    column order (`MINMAX_ROWS_CONTIG`) only; 2: every such side (fp8 keys, d = 256); never a TurboQuant side."""

    def rows(preset, d=128):
        plan = StorePlan(make_layer_format(preset, 1, 8, d, torch.bfloat16), "cpu")
        return [store_triton.minmax_rows(plan, side) for side in (0, 1)]

    assert rows("turboquant_4bit_nc") == rows("turboquant_k3v4_nc") == rows("turboquant_3bit_nc") == [0, 2]
    assert rows("turboquant_4bit_nc", 64) == [0, 2]
    assert rows("turboquant_k8v4") == rows("turboquant_4bit_nc", 256) == rows("tq3") == [0, 0]
    assert rows("turboquant_3bit_nc", 64) == rows("turboquant_4bit_nc", 80) == [0, 0]
    monkeypatch.setattr(store_triton, "MINMAX_ROWS", 2)
    assert rows("turboquant_k8v4") == rows("turboquant_4bit_nc", 256) == rows("turboquant_3bit_nc", 256) == [0, 2]
    assert rows("turboquant_3bit_nc", 64) == rows("turboquant_4bit_nc", 80) == rows("tq3") == [0, 0]
    monkeypatch.setattr(store_triton, "MINMAX_ROWS_CONTIG", 0)
    assert rows("turboquant_4bit_nc") == [0, 1]
    assert rows("turboquant_3bit_nc") == [0, 0]  # 3-bit codes: the contiguous order only
    monkeypatch.setattr(store_triton, "MINMAX_ROWS", 0)
    monkeypatch.setattr(store_triton, "MINMAX_ROWS_CONTIG", 1)
    assert rows("turboquant_4bit_nc") == rows("turboquant_3bit_nc") == [0, 0]


@pytest.mark.parametrize("contig", [0, 1])
@pytest.mark.parametrize(
    "preset,d,dtype",
    [
        ("turboquant_4bit_nc", 64, torch.bfloat16),
        ("turboquant_k8v4", 32, torch.float16),
        ("turboquant_k3v4_nc", 64, torch.float32),
        ("turboquant_3bit_nc", 128, torch.bfloat16),
    ],
)
def test_store_minmax_rows(preset, d, dtype, contig, monkeypatch):
    """Min-max values in `_minmax_rows`' layout (forced on every such side, both column orders; 3-bit codes take the
    contiguous one): the reference's page bits on the stress rows, skipped slots untouched."""
    monkeypatch.setattr(store_triton, "MINMAX_ROWS", 2)
    monkeypatch.setattr(store_triton, "MINMAX_ROWS_CONTIG", contig)
    plan = StorePlan(make_layer_format(preset, 1, 2, d, dtype), "cpu")
    assert store_triton.minmax_rows(plan, 1) == (0 if "3bit" in preset and not contig else 1 + contig)
    _bit_identical_case(preset, d, dtype, 40, seed=41)
    _compare(preset, 2, d, 40, seed=43)


@pytest.mark.gpu
@pytest.mark.parametrize("contig", [0, 1])
@pytest.mark.parametrize(
    "preset,dtype",
    [
        ("turboquant_4bit_nc", torch.bfloat16),
        ("turboquant_k8v4", torch.float16),
        ("turboquant_k3v4_nc", torch.float32),
        ("turboquant_3bit_nc", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_store_minmax_rows_gpu(preset, d, dtype, contig, monkeypatch):
    """`test_store_minmax_rows` at real sizes, head sizes 64 / 128 / 256."""
    monkeypatch.setattr(store_triton, "MINMAX_ROWS", 2)
    monkeypatch.setattr(store_triton, "MINMAX_ROWS_CONTIG", contig)
    _bit_identical_case(preset, d, dtype, 20000, seed=47)
    _compare(preset, 8, d, 3000, seed=47)


@pytest.mark.parametrize("order", [2, 3])
@pytest.mark.parametrize("preset,dtype", [("turboquant_4bit_nc", torch.bfloat16), ("tq3", torch.float16)])
def test_store_split_order(preset, dtype, order, monkeypatch):
    """Split launches with the value programs first or interleaved with the key programs (`SPLIT_ORDER`): the
    reference's page bits, skipped slots untouched."""
    monkeypatch.setattr(store_triton, "SPLIT_SIDES", 2)
    monkeypatch.setattr(store_triton, "SPLIT_ORDER", order)
    _bit_identical_case(preset, 64, dtype, 40, seed=53)
    _compare(preset, 2, 64, 40, seed=59)


@pytest.mark.gpu
@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "tq_k4v4_nc"])
def test_store_split_order_gpu(preset, order, monkeypatch):
    """`test_store_split_order` at real sizes."""
    monkeypatch.setattr(store_triton, "SPLIT_ORDER", order)
    _bit_identical_case(preset, 128, torch.bfloat16, 20000, seed=61)
    _compare(preset, 8, 128, 3000, seed=61)


def test_asm_store_rule(monkeypatch):
    """Code words and scales by inline PTX (`asm_store`): 4-bit half-group sides where every TurboQuant side of the
    plan is one (4bit_nc's keys, both sides of tq_k4v4_nc), not tq3's keys beside its 2-bit values, not 3-bit
    sides; `ASM_STORE` 2 takes every 4-bit half-group side, 0 none."""

    def asm(preset):
        plan = StorePlan(make_layer_format(preset, 1, 8, 128, torch.bfloat16), "cpu")
        return [store_triton.asm_store(plan, side) for side in (0, 1)]

    assert asm("turboquant_4bit_nc") == [True, False]
    assert asm("tq_k4v4_nc") == asm("tq_k4v4_ub") == [True, True]
    assert asm("tq3") == asm("turboquant_3bit_nc") == asm("tq4") == asm("turboquant_k8v4") == [False, False]
    monkeypatch.setattr(store_triton, "ASM_STORE", 2)
    assert asm("tq3") == [True, False]
    monkeypatch.setattr(store_triton, "ASM_STORE", 0)
    assert asm("turboquant_4bit_nc") == asm("tq_k4v4_nc") == [False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [0, 2])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "tq_k4v4_ub"])
def test_store_asm_store_gpu(preset, asm, monkeypatch):
    """Words and scales by inline PTX or by `tl.store`: the reference's page bits, skipped slots untouched."""
    monkeypatch.setattr(store_triton, "ASM_STORE", asm)
    _bit_identical_case(preset, 128, torch.bfloat16, 20000, seed=79)
    _compare(preset, 8, 128, 3000, seed=79)


def test_compare_ptx_boundaries():
    """The 2-bit sides' compare block holds each boundary's exact float32 bits, in order, one subtraction
    each; the tables of 2-bit sides carry it, wider ones do not."""
    from tqserve.kvquant.reference import tq_codebook

    _, bnd = tq_codebook(2, 128)
    ptx = store_triton.compare_ptx(bnd)
    subs = [line for line in ptx.splitlines() if line.startswith("sub.rn.f32")]
    want = [f"0f{int(b) & 0xFFFFFFFF:08X}" for b in bnd.float().view(torch.int32).tolist()]
    assert [line.split()[2].rstrip(",") for line in subs] == want
    for preset, cmp_sides in (("tq3", [False, True]), ("tq_k2v4_nc", [True, False]), ("tq4", [False, False])):
        plan = StorePlan(make_layer_format(preset, 1, 2, 128, torch.bfloat16), "cpu")
        assert [bool(side[5][5]) for side in plan.sides] == cmp_sides, preset


@pytest.mark.gpu
@pytest.mark.parametrize("cmp", [0, 1])
@pytest.mark.parametrize("preset", ["tq3", "tq_k2v4_nc", "tq_k4v2_ub"])
def test_store_compare_lookup_gpu(preset, cmp, monkeypatch):
    """2-bit sides by compares (`CMP_2BIT`) or by the cell table: the reference's page bits either way
    (zero rows included: y = 0 lies above the middle boundary, -4.9e-18)."""
    monkeypatch.setattr(store_triton, "CMP_2BIT", cmp)
    _bit_identical_case(preset, 128, torch.bfloat16, 20000, seed=17)


def test_signs_at_load_rule(monkeypatch):
    """By default only one TurboQuant side in the 16 x 2 launch (turboquant_4bit_nc) takes the signs at the
    load; 2 turns it on for every tiled side, 0 off."""
    plans = {
        p: StorePlan(make_layer_format(p, 1, 8, 128, torch.bfloat16), "cpu")
        for p in ("turboquant_4bit_nc", "turboquant_3bit_nc", "tq3", "tq4", "tq_k4v4_ub")
    }
    assert [p for p, plan in plans.items() if store_triton.signs_at_load(plan)] == ["turboquant_4bit_nc"]
    monkeypatch.setattr(store_triton, "SIGNS_AT_LOAD", 2)
    assert all(store_triton.signs_at_load(plan) for plan in plans.values())
    monkeypatch.setattr(store_triton, "SIGNS_AT_LOAD", 0)
    assert not any(store_triton.signs_at_load(plan) for plan in plans.values())


@pytest.mark.parametrize("preset", ["tq4s", "tq3s"])
def test_store_search_dense_rotation(preset):
    """Gain search on the dense-R path (tile width capped below 16, so no Hadamard tiles)."""
    _compare(preset, 2, 64, 21, seed=5, wmax=8)


def _lookup_probes(bnd: torch.Tensor, d: int, seed: int) -> torch.Tensor:
    """Rotated coordinates to look up: Gaussian ones of a d-vector, uniform ones over |y| <= 1.01, every
    boundary and the floats either side of it, zeros of both signs and the range's ends (float32)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat(
        [
            torch.randn(200_000, generator=gen) / d**0.5,
            torch.rand(20_000, generator=gen) * 2.02 - 1.01,
            bnd,
            torch.nextafter(bnd, torch.tensor(-1.0)),
            torch.nextafter(bnd, torch.tensor(1.0)),
            torch.tensor([0.0, -0.0, 1.0, -1.0, 1.01, -1.01]),
        ]
    ).float()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("d", [16, 64, 80, 128, 256])
def test_cell_table_matches_bucketize(bits, d):
    """`_tq_lookup`'s table, emulated in torch: index = base + (y > own boundary) over the cell of
    round(y * CS), with y * CS off by a few ulps (as the kernel forms it from z * (f * CS)), equals
    torch.bucketize (the reference) and picks c[index], on random y and on y one float either side
    of every boundary."""
    from tqserve.kvquant.reference import tq_codebook
    from tqserve.kvquant.store_triton import _cell_table

    cb, bnd = tq_codebook(bits, d)
    tab, ncell, halfc, cs = _cell_table(cb, bnd)
    y = _lookup_probes(bnd, d, bits * 1000 + d)
    want = torch.bucketize(y, bnd)
    for wobble in (1.0, 1.0 + 2.0**-21, 1.0 - 2.0**-21):
        yc = (y * (cs * wobble)).double()
        # entry: [own boundary as int32 bits, base]; the centroids' bits follow the entries
        e = tab[: 2 * ncell].view(ncell, 2)[(yc.round().long() + halfc).clamp(0, ncell - 1)]
        up = y > e[:, 0].view(torch.float32)
        idx = e[:, 1] + up.int()
        assert torch.equal(idx.long(), want), f"{int((idx != want).sum())} indices differ"
        cv = tab[2 * ncell :][idx.long()].view(torch.float32)
        assert torch.equal(cv, cb[want])


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_cell_lanes_match_bucketize(bits, d):
    """`_tq_lookup_lanes`' lane tables, emulated in torch: the cell of round(y * CS) clamped to the lanes'
    cells [lo, hi] gives index = base + (y > own boundary) equal to torch.bucketize (the reference), and the
    third table's term at that index equals what `_tq_scale_terms` rounds from the scaled centroid (the fma
    cq * cq + 1.5 * 2^(23 + SCALE_QS) in float32, less its bits' offset)."""
    from tqserve.kvquant.reference import SCALE_QS, tq_codebook

    cb, bnd = tq_codebook(bits, d)
    tab, ncell, halfc, cs = store_triton._cell_table(cb, bnd)
    lanes = store_triton.lane_cells(tab, ncell, cb.numel())
    assert lanes > 0
    lo, span = (lanes - 1) // 64, (lanes - 1) % 64
    assert span < 32
    t0 = 2 * ncell + 2 * cb.numel()
    lane_p, lane_b, lane_t = tab[t0 : t0 + 32], tab[t0 + 32 : t0 + 64], tab[t0 + 64 : t0 + 96]
    y = _lookup_probes(bnd, d, bits * 100 + d)
    want = torch.bucketize(y, bnd)
    for wobble in (1.0, 1.0 + 2.0**-21, 1.0 - 2.0**-21):
        cell = ((y * (cs * wobble)).double().round().long() + halfc - lo).clamp(0, span)
        idx = lane_b[cell] + (y > lane_p[cell].view(torch.float32)).int()
        assert torch.equal(idx.long(), want), f"{int((idx != want).sum())} indices differ"
    cq = (cb.float() * 2.0**SCALE_QS).double()
    fma = (cq * cq + 1.5 * 2.0 ** (23 + SCALE_QS)).float()  # one rounding: the float64 sum is exact
    terms = fma.view(torch.int32) - (0x4B400000 + (SCALE_QS << 23))
    assert torch.equal(lane_t[torch.arange(cb.numel())], terms)


@pytest.mark.parametrize(
    "preset,d,dtype", [("turboquant_4bit_nc", 128, torch.bfloat16), ("turboquant_3bit_nc", 64, torch.float32)]
)
def test_store_cell_lanes_everywhere(preset, d, dtype, monkeypatch):
    """The lane-table lookup on every nc side of 3- or 4-bit codes (`CELL_LANES = 2`, not only where both
    sides are TurboQuant): the reference's page bits."""
    monkeypatch.setattr(store_triton, "CELL_LANES", 2)
    plan = StorePlan(make_layer_format(preset, 1, 2, d, dtype), "cpu")
    assert plan.sides[0][5][6] > 0
    _bit_identical_case(preset, d, dtype, 40, seed=19)


def test_cell_lanes_rule(monkeypatch):
    """Lane-table cells (`cell_lanes`): by default where both sides are TurboQuant and in 4bit_nc's split launch,
    not in the one-warp launches of 3-bit sides; `CELL_LANES` 0 nowhere."""

    def lanes(preset, d=128):
        plan = StorePlan(make_layer_format(preset, 1, 8, d, torch.bfloat16), "cpu")
        return plan.sides[0][5][6] > 0

    assert lanes("turboquant_4bit_nc") and lanes("turboquant_4bit_nc", 64) and lanes("tq_k4v4_nc")
    assert not lanes("turboquant_3bit_nc") and not lanes("turboquant_k3v4_nc")
    assert not lanes("turboquant_4bit_nc", 256)  # not a tuned launch
    monkeypatch.setattr(store_triton, "CELL_LANES", 0)
    assert not lanes("turboquant_4bit_nc") and not lanes("tq_k4v4_nc")


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", [0, 2])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc", "tq_k4v4_nc"])
def test_store_cell_lanes_gpu(preset, lanes, monkeypatch):
    """The lane-table lookup (`CELL_LANES`) on and off for every nc side: the reference's page bits."""
    monkeypatch.setattr(store_triton, "CELL_LANES", lanes)
    _bit_identical_case(preset, 128, torch.bfloat16, 20000, seed=23)


def _backend_two_steps(preset, hq, hkv, d, steps, seed, tol=1e-2):
    """The attention kernel reads what the store kernel wrote (see `backend_step_errors`)."""
    errs = backend_step_errors(preset, hq, hkv, d, steps, seed, seed, DEV)
    assert max(errs) <= tol, f"{preset}: rel err per step {errs}"


@pytest.mark.parametrize("preset", ["tq4s", "tq3s"])
def test_backend_search_presets(preset):
    # window 60 + sink 4: a 70-token prompt puts its early positions on the quantized pages only
    _backend_two_steps(preset, 4, 2, 64, [([0, 0], [70, 20]), ([70, 20], [1, 4])], seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset",
    [
        "auto",
        "fp8",
        "turboquant_k8v4",
        "turboquant_4bit_nc",
        "turboquant_3bit_nc",
        "tq4",
        "tq3",
        "tq4s",
        "tq3s",
        "tq_k4v4_ncs",
    ],
)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_store_gpu(preset, d):
    _compare(preset, 8, d, 1000, seed=d)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tq4s", "tq3s"])
def test_store_gpu_search_dense_rotation(preset):
    _compare(preset, 8, 128, 1000, seed=3, wmax=8)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tq4s", "tq3s", "tq_k4v4_ncs"])
def test_backend_search_presets_gpu(preset):
    ctx, ql = [2999, 290, 777, 60], [1, 5, 1, 4]  # prefill, then decode / verify on the same pages
    _backend_two_steps(preset, 32, 8, 128, [([0] * 4, ctx), (ctx, ql)], seed=2)


def _run_lane_table(ptx: str, lane: int) -> int:
    """`lane_table_ptx`'s output register in lane `lane`, by evaluating its instructions (the subset
    it emits: mov from %laneid or an immediate, and, setp.ne, selp)."""
    regs: dict[str, int] = {}
    pred: dict[str, bool] = {}

    def val(x: str) -> int:
        return int(x, 0) if x[0].isdigit() else regs[x]

    for line in ptx.strip("{}\n").splitlines():
        op, _, rest = line.rstrip(";").partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op.startswith(".reg"):
            continue
        if op == "mov.u32" and args[1] == "%laneid":
            regs[args[0]] = lane
        elif op in ("mov.b32", "mov.u32"):
            regs[args[0]] = val(args[1])
        elif op == "and.b32":
            regs[args[0]] = val(args[1]) & val(args[2])
        elif op == "setp.ne.u32":
            pred[args[0]] = val(args[1]) != val(args[2])
        elif op == "selp.b32":
            regs[args[0]] = val(args[1]) if pred[args[3]] else val(args[2])
        else:
            raise AssertionError(f"unexpected instruction {line!r}")
    return regs["$0"]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_lane_table_ptx_gives_each_lane_its_entry(n):
    """The store's shuffle lookup (LANE_LUT) reads centroid c from lane c: lane l must hold entry l mod n."""
    from tqserve.kvquant.store_triton import lane_table_ptx

    gen = torch.Generator().manual_seed(n)
    entries = [int(v) & 0xFFFFFFFF for v in torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen)]
    ptx = lane_table_ptx(entries)
    assert [_run_lane_table(ptx, lane) for lane in range(32)] == [entries[lane % n] for lane in range(32)]


def test_lane_table_rule():
    """The lane table serves every TurboQuant side of up to 32 centroids, except two 4-bit unbiased sides."""
    presets = ("tq3", "tq4", "tq_k4v4_ub", "tq_k4v4_nc")
    plans = {p: StorePlan(make_layer_format(p, 1, 8, 128, torch.bfloat16), "cpu") for p in presets}
    assert [bool(s[5][4]) for s in plans["tq3"].sides] == [True, True]
    assert [bool(s[5][4]) for s in plans["tq4"].sides] == [True, True]
    assert [bool(s[5][4]) for s in plans["tq_k4v4_ub"].sides] == [False, False]
    assert [bool(s[5][4]) for s in plans["tq_k4v4_nc"].sides] == [True, True]
    fmt = make_layer_format("turboquant_4bit_nc", 1, 8, 128, torch.bfloat16)
    assert bool(StorePlan(fmt, "cpu").sides[0][5][4]) and StorePlan(fmt, "cpu").sides[1][5] is None


def test_term_lut_rule():
    """nc sides of 3- and 4-bit codes without cell lanes shuffle their nc terms (`TERM_LUT`, LANES = -1): the lane
    table holds round(c^2 * 2^SCALE_QS), as `reference.fixed_sum` rounds each term; other sides keep theirs."""
    from tqserve.kvquant.reference import SCALE_QS, tq_codebook

    cases = (
        ("turboquant_3bit_nc", [-1]),
        ("turboquant_k3v4_nc", [-1]),
        ("tq_k4v4_nc", None),
        ("turboquant_4bit_nc", None),
    )
    for preset, want in cases:
        plan = StorePlan(make_layer_format(preset, 1, 8, 128, torch.bfloat16), "cpu")
        lanes = [s[5][6] for s in plan.sides if s[0] == TQ]
        if want is None:
            assert all(n > 0 for n in lanes), preset  # cell lanes: the terms come from their own table
            continue
        assert lanes == want, preset
        bits = plan.sides[0][1]
        cb = tq_codebook(bits, 128)[0]
        terms = store_triton.nc_terms(cb)
        assert terms == torch.round(cb.double() * cb.double() * 2.0**SCALE_QS).long().tolist()
        ptx = plan.sides[0][5][4]
        assert [_run_lane_table(ptx, lane) for lane in range(32)] == [terms[lane % len(terms)] for lane in range(32)]
        dense = StorePlan(make_layer_format(preset, 1, 8, 128, torch.bfloat16), "cpu", wmax=8)
        assert dense.sides[0][0] == TQ_DENSE and dense.sides[0][5][6] == 0, preset  # the dense path keeps centroids


@pytest.mark.gpu
@pytest.mark.parametrize("term_lut", [0, 1])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc"])
def test_store_term_lut_gpu(preset, term_lut, monkeypatch):
    """nc terms shuffled from the lane table (`TERM_LUT`) or formed by an fma from the scaled centroid: the
    reference's page bits either way (lane-table cells off: 4bit_nc takes them by default, `cell_lanes`)."""
    monkeypatch.setattr(store_triton, "TERM_LUT", term_lut)
    monkeypatch.setattr(store_triton, "CELL_LANES", 0)
    plan = StorePlan(make_layer_format(preset, 1, 2, 128, torch.bfloat16), "cpu")
    assert (plan.sides[0][5][6] == -1) == bool(term_lut)
    _bit_identical_case(preset, 128, torch.bfloat16, 20000, seed=29)
