"""Codec ground truth: rotation, codebooks, packing, distortion against theory."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tqserve.kvquant import reference as ref
from tqserve.kvquant.codebooks import (
    expected_sphere_distortion,
    gaussian_codebook,
    sphere_codebook,
)
from tqserve.kvquant.packing import _pack_stream, _unpack_stream, pack_bits, packed_bytes, unpack_bits
from tqserve.kvquant.rotation import Rotation, fwht, hadamard_blocks

# TURBOQUANT.md: Lloyd-Max for N(0,1), positive half, and D_mse per unit vector.
TABLE = {
    1: ([0.7979], 0.3634),
    2: ([0.4528, 1.5104], 0.1175),
    3: ([0.2451, 0.7560, 1.3439, 2.1519], 0.03455),
    4: ([0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326], 0.00950),
}
SPHERE_128 = {1: 0.3609, 2: 0.1160, 3: 0.0340, 4: 0.0093}


@pytest.fixture(autouse=True)
def _one_thread():
    # Small tensors on a shared 2-core CI box: extra intra-op threads only spin against each other.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _unit(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_codebook_matches_table(bits):
    cb = gaussian_codebook(bits)
    half, d = TABLE[bits]
    pos = cb.centroids[len(cb.centroids) // 2 :]
    assert torch.allclose(pos, torch.as_tensor(half, dtype=torch.float64), atol=1.5e-4)
    assert torch.allclose(cb.centroids, -cb.centroids.flip(0), atol=1e-10)  # symmetric
    assert cb.distortion == pytest.approx(d, rel=2e-3)


def test_codebooks_up_to_six_bits_are_ordered_with_midpoint_boundaries():
    for bits in range(1, 7):
        cb = gaussian_codebook(bits)
        assert cb.centroids.numel() == 1 << bits
        assert (cb.centroids.diff() > 0).all()
        assert torch.allclose(cb.boundaries, 0.5 * (cb.centroids[1:] + cb.centroids[:-1]))
    # each extra bit cuts the distortion by close to 4x, as the 4^-b bound says
    ds = [gaussian_codebook(b).distortion for b in range(1, 7)]
    assert all(3.0 < a / b < 4.2 for a, b in itertools.pairwise(ds))


def test_sphere_codebook_d128_matches_table():
    for bits, d in SPHERE_128.items():
        assert sphere_codebook(bits, 128).distortion == pytest.approx(d, rel=5e-3)
    assert sphere_codebook(4, 128).centroids[-1].item() == pytest.approx(2.6889, abs=2e-3)


def test_fwht_is_sylvester_hadamard():
    n = 16
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    pop = sum((bits >> k) & 1 for k in range(4))
    h = (1 - 2 * (pop % 2)).float()
    x = torch.eye(n)
    assert torch.equal(fwht(x), h)
    assert torch.equal(x, torch.eye(n))  # the stages alternate between their own buffers, never the input
    z = torch.randint(-2048, 2048, (5, 3, n))
    assert torch.equal(fwht(z), z @ h.long())  # integers: exact


@pytest.mark.parametrize("d,blocks", [(64, [64]), (80, [64, 16]), (96, [64, 32]), (128, [128])])
def test_rotation_is_orthogonal_and_matches_dense(d, blocks):
    assert hadamard_blocks(d) == blocks
    rot = Rotation(d, layer_idx=5)
    m = rot.matrix
    assert torch.allclose(m @ m.T, torch.eye(d), atol=1e-5)
    x = torch.randn(7, 3, d)
    assert torch.allclose(rot.forward(x), x @ m.T, atol=1e-5)
    assert torch.allclose(rot.inverse(rot.forward(x)), x, atol=1e-5)
    # block-diagonal: nothing mixes across blocks
    if len(blocks) > 1:
        assert m[: blocks[0], blocks[0] :].abs().max() == 0


def test_rotation_seed_differs_per_layer_and_is_reproducible():
    assert torch.equal(Rotation(64, 3).signs, Rotation(64, 3).signs)
    assert not torch.equal(Rotation(64, 3).signs, Rotation(64, 4).signs)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 8])
def test_packing_round_trip_and_size(bits):
    for d in (64, 80, 96, 128):
        idx = torch.randint(0, 1 << bits, (5, 3, d))
        packed = pack_bits(idx, bits)
        assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_bytes(d, bits) == d * bits // 8
        assert torch.equal(unpack_bits(packed, bits, d), idx)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_packing_by_groups_equals_the_bit_stream(bits):
    # rows of a multiple of 8 indices pack 8 at a time as one integer; the bit-by-bit stream defines the layout
    for d in (8, 64, 80, 256):
        idx = torch.randint(0, 1 << bits, (6, 2, d))
        packed = _pack_stream(idx, bits)
        assert torch.equal(pack_bits(idx, bits), packed)
        assert torch.equal(unpack_bits(packed, bits, d), _unpack_stream(packed, bits, d))
    cols = torch.randint(0, 1 << bits, (64, 5)).t()  # rows that are not contiguous
    assert torch.equal(unpack_bits(pack_bits(cols, bits).t().contiguous().t(), bits, 64), cols)
    idx = torch.randint(0, 1 << bits, (4, 13))  # 13 indices: the stream path, padded to whole bytes
    assert torch.equal(unpack_bits(pack_bits(idx, bits), bits, 13), idx)


def test_packing_bit_order_is_little_endian_stream():
    # 3-bit indices 1, 2, 3 -> stream bits 100 010 110 -> byte0 = 0b11010001 (bit i at i % 8)
    idx = torch.arange(8) % 8
    idx[:3] = torch.arange(1, 4)
    packed = pack_bits(idx, 3)
    assert packed[0].item() == 0b11010001
    # index j's bit k is stream bit j*b+k
    for j in range(8):
        val = sum(((packed[(j * 3 + k) // 8].item() >> ((j * 3 + k) % 8)) & 1) << k for k in range(3))
        assert val == idx[j].item()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_tq_distortion_matches_theory(d, bits):
    x = _unit(4096, d, seed=bits)
    rot = Rotation(d, layer_idx=1)
    packed, scale = ref.tq_encode(x, rot, bits, "plain")
    xh = ref.tq_decode(packed, scale, rot, bits, d)
    mse = ((x - xh) ** 2).sum(-1).mean().item()
    # theory at this d (exact sphere marginal, same N(0,1) codebook) within 3%
    assert mse == pytest.approx(expected_sphere_distortion(bits, d), rel=0.03)
    if d == 128:  # and the TURBOQUANT.md table (d -> infinity) within 3% at d = 128
        assert mse == pytest.approx(TABLE[bits][1], rel=0.03)


@pytest.mark.parametrize("d", [64, 128])
def test_norm_correction_inner_products(d):
    x = _unit(2048, d, seed=7) * 3.0
    rot = Rotation(d, layer_idx=2)
    for bits in (3, 4):
        ratios = {}
        for mode in ref.SCALE_MODES:
            packed, scale = ref.tq_encode(x, rot, bits, mode)
            xh = ref.tq_decode(packed, scale, rot, bits, d)
            ratios[mode] = ((x * xh).sum(-1) / (x * x).sum(-1)).mean().item()
        dist = gaussian_codebook(bits).distortion
        # tqserve's unbiased scale: <x, x_hat> = ||x||^2 (fp16 scale rounding only)
        assert ratios["unbiased"] == pytest.approx(1.0, abs=0.005)
        # vLLM's nc (n / ||c||): sqrt(1 - D); plain: 1 - D
        for mode in ("nc", "plain"):
            assert ratios[mode] == pytest.approx(ref.theory_inner_product_ratio(dist, mode), abs=0.004)
        # nc reconstructions are exactly as long as x
        packed, scale = ref.tq_encode(x, rot, bits, "nc")
        xh = ref.tq_decode(packed, scale, rot, bits, d)
        assert torch.allclose(xh.norm(dim=-1), x.norm(dim=-1), rtol=2e-3)


@pytest.mark.parametrize("d", [64, 128])
def test_gain_search_encoder(d):
    """Same decoder, better indices: cos(y, c[idx]) never drops below the nearest-centroid one, the
    error of nc / unbiased reconstructions falls (most at high bits), and unbiased stays unbiased."""
    x = _unit(2048, d, seed=11) * 2.0
    rot = Rotation(d, layer_idx=3)
    y = rot.forward(x / x.norm(dim=-1, keepdim=True))
    floor = {2: 0.0, 3: 0.05, 4: 0.12, 5: 0.15}  # measured at d = 64: 2 / 10 / 21 / 28% lower
    for bits, least in floor.items():
        cents, _ = ref.tq_codebook(bits, d)
        plain_c = cents[ref.tq_quantize_rotated(y, bits)]
        search_c = cents[ref.tq_search_indices(y, bits)]

        def cos(c):
            return (y * c).sum(-1) / c.norm(dim=-1)

        assert (cos(search_c) >= cos(plain_c) - 1e-6).all()
        for mode in ("nc", "unbiased"):
            errs = []
            for search in (False, True):
                packed, scale = ref.tq_encode(x, rot, bits, mode, search=search)
                xh = ref.tq_decode(packed, scale, rot, bits, d)
                errs.append((((x - xh) ** 2).sum(-1) / (x * x).sum(-1)).mean().item())
                if mode == "unbiased":
                    assert ((x * xh).sum(-1) / (x * x).sum(-1)).mean().item() == pytest.approx(1.0, abs=0.005)
            assert errs[1] <= errs[0] * (1 - least) + 1e-7, (bits, mode, errs)
    with pytest.raises(ValueError):
        ref.tq_encode(x, rot, 4, "plain", search=True)
    assert ref.SEARCH_GAINS[0] == 1.0 and len(set(ref.SEARCH_GAINS)) == len(ref.SEARCH_GAINS)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_stored_codes_order(bits):
    """Pages hold sign-magnitude codes at 4 bits (code 8 + r: the r-th positive centroid, code r: its negative)
    and the sorted indices at other widths; `code_order` is an involution, `tq_code_table` is the centroids by
    code, and `tq_encode` packs `to_codes` of the nearest-centroid indices, which decode to those centroids."""
    d = 128
    perm = ref.code_order(bits)
    assert [perm[p] for p in perm] == list(range(1 << bits))
    cents, _ = ref.tq_codebook(bits, d)
    table = ref.tq_code_table(bits, d)
    assert torch.equal(table, cents[perm])
    if bits in ref.SIGN_MAGNITUDE_BITS:
        h = 1 << (bits - 1)
        assert (table[h:] > 0).all() and (table[h:].diff() > 0).all()
        assert torch.equal(table[:h], -table[h:])
        x8, _ = ref.tq_int8_codes(bits, d)
        assert [x8[r] for r in range(h)] == [-1 - v for v in x8[h:]]
    else:
        assert perm == list(range(1 << bits))
    x = _unit(512, d, seed=5)
    rot = Rotation(d, layer_idx=1)
    packed, scale = ref.tq_encode(x, rot, bits, "plain")
    y, _ = ref.tq_rotate(x, rot)
    idx = ref.tq_quantize_rotated(y, bits)
    codes = unpack_bits(packed, bits, d)
    assert torch.equal(codes, ref.to_codes(idx, bits))
    assert torch.equal(ref.to_codes(codes, bits), idx)
    want = cents[idx] * scale.float().unsqueeze(-1)
    assert torch.equal(ref.tq_decode_rotated(packed, scale, bits, d), want)


def test_tq_zero_vector_decodes_to_zero():
    rot = Rotation(64, 0)
    for mode in ref.SCALE_MODES:
        for search in (False, True) if mode != "plain" else (False,):
            packed, scale = ref.tq_encode(torch.zeros(2, 64), rot, 4, mode, search=search)
            assert torch.equal(ref.tq_decode(packed, scale, rot, 4, 64), torch.zeros(2, 64))


def test_fp8_scaled_and_cast():
    x = torch.randn(64, 2, 128) * 5
    q, scale = ref.fp8_encode(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float16 and scale.shape == (64, 2)
    err = (ref.fp8_decode(q, scale) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert err.max() < 2**-4  # 3 mantissa bits: half an ulp of the largest binade
    assert ref.fp8_cast(torch.full((1,), 1e4)).float().item() == 448.0


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_minmax_round_trip_error_bounded(bits):
    x = torch.randn(100, 64) * 2 + 0.5
    packed, scale, zero = ref.minmax_encode(x, bits)
    xh = ref.minmax_decode(packed, scale, zero, bits, 64)
    step = scale.float()[:, None]
    assert ((xh - x).abs() <= 0.5 * step + 1e-2 * step + 1e-3).all()
    assert math.isclose(xh.amin(-1).sub(x.amin(-1)).abs().max().item(), 0.0, abs_tol=1e-2)


def test_grid_codebooks_are_lloyd_max_on_int8_half_steps():
    """The codec's 4-bit codebook (`grid_codebook`; 3 bits checked too): centroids (x + 1/2) step with int8 x, symmetric
    (x_i = ~x_(L-1-i)), boundaries at midpoints, each centroid the grid point nearest its cell's conditional
    mean, and a distortion within 0.1% of the free Lloyd-Max optimum; `tq_codebook` serves them, others stay."""
    from tqserve.kvquant.codebooks import GRID_BITS, grid_codebook

    assert GRID_BITS == (4,)
    for bits in (3, 4):
        cb, x, step = grid_codebook(bits)
        free = gaussian_codebook(bits)
        assert x.numel() == 1 << bits and int(x.max()) <= 127 and int(x.min()) >= -128
        assert torch.equal(x, -1 - x.flip(0)) and bool((x[1:] > x[:-1]).all())
        assert torch.allclose(cb.centroids, (x.double() + 0.5) * step)
        assert torch.allclose(cb.boundaries, 0.5 * (cb.centroids[1:] + cb.centroids[:-1]))
        assert cb.distortion == pytest.approx(free.distortion, rel=1e-3) and cb.distortion >= free.distortion
        # Lloyd's centroid condition on the grid: the conditional mean of each cell rounds to its centroid
        t = torch.randn(2_000_000, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
        cell = torch.bucketize(t, cb.boundaries)
        for i in range(1 << bits):
            mean = t[cell == i].mean()
            assert abs(float(mean) / step - 0.5 - float(x[i])) < 0.5 + 0.05, (bits, i)
        if bits not in GRID_BITS:
            continue
        c32, b32 = ref.tq_codebook(bits, 128)
        assert torch.allclose(c32.double(), cb.centroids / 128**0.5, rtol=1e-6)
        xs, g = ref.tq_int8_grid(bits, 128)
        assert xs == x.tolist() and g == pytest.approx(step / 128**0.5)
    for bits in (3, 5):  # the free Lloyd-Max codebooks elsewhere
        assert torch.allclose(ref.tq_codebook(bits, 64)[0].double(), gaussian_codebook(bits).centroids / 8, rtol=1e-6)
        with pytest.raises(ValueError):
            ref.tq_int8_grid(bits, 128)
