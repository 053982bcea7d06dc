"""The sliced decode kernels (attention/paged_decode.py, attention/paged_decode_narrow.py) vs the torch
reference backend.

paged_attention dispatches decode steps over 2- / 4-bit codebook-key layouts to them (decode steps of
layouts without exact copies to the narrow kernel, the rest to `paged_decode`'s); these tests check
that the dispatch happens, that the output matches the reference for decode and verify batches (tiny
shapes under the interpreter, real sizes on the GPU), and on the GPU that the inline-PTX slice
decoders (shuffle and PRMT codebook lookups, magic-number min-max) give the same bits as the fp16
gathers.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from paged_cases import backend_step_errors, fill_context, make_meta
from test_paged_attention import TOL, _check_one_step
from triton_env import DEV, triton_kernels

from tqserve.attention import paged_decode
from tqserve.attention import paged_decode_narrow as narrow
from tqserve.attention.paged import layout_for_format, paged_attention
from tqserve.attention.reference import KVCacheStore
from tqserve.kvquant.presets import make_layer_format

pytestmark = triton_kernels

# 4-bit keys with min-max values (vLLM's), with 2-bit codebook values + sink / window (tq3, tq3s),
# 4-bit codebook values, 2-bit keys.
SLICED = ["turboquant_4bit_nc", "tq3", "tq3s", "tq_k4v4_nc", "tq_k2v4_nc"]
NARROW = ["turboquant_4bit_nc", "tq_k4v4_nc", "tq_k2v4_nc", "tq_k4v4_ub", "tq_k4v2_nc"]  # no exact copies
NARROW_EXACT = ["tq3", "tq3s"]  # sink + window copies (their exact pairs: split 0)
NARROW3 = ["turboquant_3bit_nc", "tq_k3v2_ub", "turboquant_k3v4_nc"]  # 3-bit codes: 8-code groups, narrow only


def _count(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture
def spy(monkeypatch):
    """Counts sliced-kernel launches; lowers the dispatch's head-size floor so d = 64 runs it too."""
    monkeypatch.setattr(paged_decode, "MIN_HEAD_DIM", 64)
    return _count(monkeypatch, paged_decode, "decode_attention")


@pytest.fixture
def narrow_spy(monkeypatch):
    """Counts narrow-kernel launches (`paged_decode_narrow.launch`)."""
    monkeypatch.setattr(paged_decode, "MIN_HEAD_DIM", 64)
    return _count(monkeypatch, narrow, "launch")


def _layout(preset: str, hkv: int = 2, d: int = 128):
    return layout_for_format(make_layer_format(preset, 3, hkv, d, torch.bfloat16), DEV)


def _layer_step(preset: str, ctx: list[int], qlen: int, seed: int, hq: int = 8, hkv: int = 2, d: int = 128, bs=16):
    """One layer's pages filled with random context and this step's K / V (qlen tokens per request) written;
    returns the step's attention as a function of the split count (None: planned)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = make_layer_format(preset, 3, hkv, d, torch.bfloat16)
    nblocks = sum((c + qlen + bs - 1) // bs for c in ctx) + 4
    meta = make_meta(ctx, [qlen] * len(ctx), bs, nblocks, DEV, seed=seed)
    store = KVCacheStore([fmt], nblocks, bs, len(ctx) + 1, len(ctx) + 1, DEV)
    fill_context(store, 0, meta, ctx, gen)
    q, k, v = (torch.randn(len(ctx) * qlen, h, d, generator=gen).to(DEV, torch.bfloat16) for h in (hq, hkv, hkv))
    fmt.write(store.pages[0], k, v, meta.slot_mapping)
    lay = layout_for_format(fmt, DEV)

    def run(splits: int | None):
        return paged_attention(
            q, k, v, store.pages[0], lay, meta, d**-0.5, ring=store.ring[0], sinks=store.sinks[0], num_splits=splits
        )

    return run


def test_eligibility(monkeypatch):
    def lay(preset, d=128):
        return _layout(preset, 2, d)

    for p in SLICED:
        assert paged_decode.eligible(lay(p), 1, 128), p
        assert paged_decode.eligible(lay(p, 64), 1, 64), p  # d = 64: one-warp programs, faster too
        with monkeypatch.context() as m:
            m.setattr(paged_decode, "MIN_HEAD_DIM", 128)
            assert not paged_decode.eligible(lay(p, 64), 1, 64), p
        assert paged_decode.eligible(lay(p), 5, 128, group=4), p  # verify: 8 x 4 rows
        assert not paged_decode.eligible(lay(p), 5, 128, group=8), p  # 64 rows: the general kernel
        assert not paged_decode.eligible(lay(p), 9, 128), p  # past MAX_QUERY_LEN
    # exact pages: the general kernel; fp8 sides: the narrow kernel (`FP8_NARROW`), else the general one
    assert not paged_decode.eligible(lay("auto"), 1, 128), "auto"
    for p in ["turboquant_k8v4", "fp8"]:
        assert paged_decode.eligible(lay(p), 1, 128, group=4) and paged_decode.eligible(lay(p), 5, 128, group=4), p
        assert paged_decode.eligible(lay(p, 64), 1, 64, group=4), p
        with monkeypatch.context() as m:
            m.setattr(paged_decode, "FP8_NARROW", 0)
            assert not paged_decode.eligible(lay(p), 1, 128, group=4), p
    # 5-bit keys: the narrow kernel's 8-code groups as for 3-bit codes (d >= 128), unless NARROW_KEYS5 is off
    for p in ["tq4", "tq4s"]:
        assert paged_decode.eligible(lay(p), 1, 128, group=4) and paged_decode.eligible(lay(p), 5, 128, group=4), p
        assert not paged_decode.eligible(lay(p, 64), 1, 64, group=4), p
        with monkeypatch.context() as m:
            m.setattr(paged_decode, "NARROW_KEYS5", 0)
            assert not paged_decode.eligible(lay(p), 1, 128, group=4), p
    # 3-bit codes: the narrow kernel's 8-code groups, at least 16 per token (d >= 128)
    for p in NARROW3:
        assert paged_decode.eligible(lay(p), 1, 128, group=4) and paged_decode.eligible(lay(p), 5, 128, group=4), p
        assert not paged_decode.eligible(lay(p, 64), 1, 64, group=4), p
        assert not paged_decode.eligible(lay(p), 5, 128, group=8), p  # 64 columns: past the narrow kernel
        with monkeypatch.context() as m:
            m.setattr(narrow, "ENABLED", False)
            assert not paged_decode.eligible(lay(p), 1, 128, group=4), p
    # the narrow kernel: no exact copies, (query tokens x group) padded up to 32 columns
    for p in NARROW:
        assert narrow.eligible(lay(p), 1, 4) and narrow.eligible(lay(p), 1, 32), p
        assert narrow.eligible(lay(p), 5, 4) and narrow.eligible(lay(p), 8, 3), p  # 20 -> 32, 24 -> 32
        assert not narrow.eligible(lay(p), 5, 8) and not narrow.eligible(lay(p), 1, 33), p  # 64 columns
        assert not narrow.eligible(lay(p), 9, 1), p  # past MAX_QUERY_LEN
    for p in NARROW_EXACT:  # exact copies: the same columns (their exact pairs get a program apart)
        assert narrow.eligible(lay(p), 1, 4) and narrow.eligible(lay(p), 5, 4) and narrow.eligible(lay(p), 1, 32), p
        assert not narrow.eligible(lay(p), 5, 8) and not narrow.eligible(lay(p), 1, 33), p
    assert narrow.cols(1, 1) == 8 and narrow.cols(1, 3) == 8 and narrow.cols(1, 16) == 16
    assert narrow.cols(5, 4) == 32 and narrow.cols(5, 3) == 16 and narrow.cols(2, 4) == 8


def test_launch_configs():
    """The tuned table: 16-row programs at d = 128 one warp over 64-key tiles without exact copies;
    with them the wide configuration when the requests fill the SMs, else one warp over 32-key tiles
    (no pipelining); d = 256 always wide (2 stages only when the requests fill the SMs); d = 64
    decode and verify rows one warp (verify at d >= 128 with 3 stages, of exact-copy layouts there
    without pipelining)."""
    pd = paged_decode
    packed = (pd.PACKED_NUM_WARPS, pd.PACKED_BLOCK_N, pd.PACKED_SPLIT_TARGET, pd.PACKED_STAGES)
    assert pd.launch_config(16, 128, False, 256, 132) == packed
    assert pd.launch_config(16, 128, False, 8, 132) == packed
    wide = (pd.NUM_WARPS, pd.BLOCK_N, pd.SPLIT_TARGET)
    assert pd.launch_config(16, 128, True, 256, 132) == (*wide, pd.NUM_STAGES)
    assert pd.launch_config(16, 256, False, 256, 132) == (*wide, pd.NUM_STAGES)
    assert pd.launch_config(16, 256, True, 8, 132) == (*wide, pd.FEW_PROGRAMS_STAGES)
    few = (pd.FEW_NUM_WARPS, pd.FEW_BLOCK_N, pd.FEW_SPLIT_TARGET, pd.FEW_STAGES)
    assert pd.launch_config(16, 128, True, 8, 132) == few
    assert pd.launch_config(16, 64) == (pd.SMALL_NUM_WARPS, pd.SMALL_BLOCK_N, pd.SMALL_SPLIT_TARGET, pd.SMALL_STAGES)
    one = (pd.SMALL_NUM_WARPS, pd.SMALL_BLOCK_N)
    assert pd.launch_config(32, 128, False) == (*one, pd.VERIFY_SPLIT_TARGET, pd.VERIFY_WIDE_STAGES)
    assert pd.launch_config(32, 128, True) == (*one, pd.VERIFY_SPLIT_TARGET, pd.VERIFY_EXACT_WIDE_STAGES)
    assert pd.launch_config(32, 64, True) == (*one, pd.VERIFY_SMALL_D_SPLIT_TARGET, pd.VERIFY_STAGES)
    assert paged_decode.program_rows(1, 4) == 16 and paged_decode.program_rows(5, 4) == 32
    assert paged_decode.program_rows(5, 7) == 64  # GQA 7 pads to 8
    nw = narrow.NUM_WARPS
    # min-max values: 4-bit ones capped at 128 (the scalars' word loads), 3-bit ones at 168 (12 programs per SM
    # instead of 8)
    assert narrow.launch_config(128, False) == (nw, narrow.BLOCK_N, narrow.NUM_STAGES, narrow.MM4_MAXNREG)
    mm3 = (nw, narrow.BLOCK_N, narrow.NUM_STAGES, narrow.MM3_MAXNREG)
    assert narrow.launch_config(128, False, 8, False, 3) == mm3 and narrow.MM3_MAXNREG == 168
    k3v4 = (nw, narrow.BLOCK_N, narrow.K3V4_STAGES, narrow.MM4_MAXNREG)
    assert narrow.launch_config(128, False, 8, False, 4, 3) == k3v4
    cb = (nw, narrow.CB_VALUES_BLOCK_N, narrow.CB_VALUES_STAGES, narrow.CB_VALUES_MAXNREG)
    assert narrow.launch_config(128, True) == cb
    assert narrow.launch_config(256, True) == (nw, narrow.WIDE_D_BLOCK_N, narrow.WIDE_D_STAGES, 0)
    assert narrow.launch_config(64, True) == (nw, narrow.SMALL_D_BLOCK_N, narrow.SMALL_D_STAGES, 0)
    verify = (narrow.VERIFY_NUM_WARPS, narrow.VERIFY_BLOCK_N, narrow.VERIFY_STAGES, 0)
    wide_verify = (narrow.VERIFY_NUM_WARPS, narrow.VERIFY_BLOCK_N, narrow.VERIFY_WIDE_STAGES, 0)
    assert narrow.launch_config(128, False, 32) == wide_verify and narrow.launch_config(64, True, 32) == verify
    assert narrow.launch_config(128, True, 32, True, 2, 5) == wide_verify  # tq4
    assert narrow.launch_config(128, False, 32, False, 3, 3) == verify  # 3-bit keys keep their stages
    assert narrow.launch_config(64, True, 16) == narrow.launch_config(64, True, 8)
    # exact copies: their own table at d >= 128, a register cap at d < 128
    exact = (nw, narrow.EXACT_BLOCK_N, narrow.EXACT_STAGES, narrow.EXACT_MAXNREG)
    assert narrow.launch_config(128, True, 8, True) == exact
    assert narrow.launch_config(256, True, 8, True) == (nw, narrow.EXACT_BLOCK_N, narrow.EXACT_WIDE_D_STAGES, 0)
    small_exact = (nw, narrow.SMALL_D_BLOCK_N, narrow.SMALL_D_STAGES)
    assert narrow.launch_config(64, True, 8, True) == (*small_exact, narrow.SMALL_D_EXACT_DECODE_MAXNREG)
    assert narrow.launch_config(64, True, 16, True) == (*small_exact, narrow.SMALL_D_EXACT_MAXNREG)


def test_two_bit_decoders_rule(monkeypatch):
    """Byte-permute 2-bit decoders for the narrow kernel's decode steps, PAIR_TABLES elsewhere; the
    narrow kernel's launch key tells the two apart (their register counts differ)."""
    assert paged_decode.pair_tables(True, 1) == 2
    assert paged_decode.pair_tables(True, 5) == paged_decode.pair_tables(False, 1) == paged_decode.PAIR_TABLES
    lay = _layout("tq3", 2, 128)
    assert narrow.plan(lay, 128, 4, 1, 2, 4096, 132, DEV)[4] != narrow.plan(lay, 128, 4, 2, 2, 4096, 132, DEV)[4]
    monkeypatch.setattr(paged_decode, "PRMT2_DECODE", 0)
    assert paged_decode.pair_tables(True, 1) == paged_decode.PAIR_TABLES


def test_narrow_pair_scalars_rule(monkeypatch):
    """Scalars through 32-bit words everywhere but decode steps over codebook values without exact
    copies; PAIR_SCALARS = 0 / 2 turn them off / on everywhere."""
    mm, cb, exact = _layout("turboquant_4bit_nc"), _layout("tq_k4v4_ub"), _layout("tq3")
    assert narrow.pair_scalars(mm, 8) and narrow.pair_scalars(mm, 32) and narrow.pair_scalars(exact, 8)
    assert not narrow.pair_scalars(cb, 8) and narrow.pair_scalars(cb, 32)
    monkeypatch.setattr(narrow, "PAIR_SCALARS", 0)
    assert not narrow.pair_scalars(mm, 8) and not narrow.pair_scalars(exact, 32)
    assert narrow.launch_config(128, False)[3] == 0
    monkeypatch.setattr(narrow, "PAIR_SCALARS", 2)
    assert narrow.pair_scalars(cb, 8)


def test_narrow_splits_fill_one_wave():
    """Occupancy from the compiled kernel's registers / shared memory (H100: 64K registers, 228 KB),
    and split-K counts that keep (request, KV head) pairs x splits within one wave of resident
    programs, at least 4 key tiles per split, at most MAX_SPLITS."""
    assert narrow.resident_per_sm(128, 13 * 1024, 1) == 16  # registers: 65536 / (128 x 32)
    assert narrow.resident_per_sm(215, 26 * 1024, 1) == 8  # 6,912 a warp: 2 per sub-partition; smem 8
    # warps come in fours (one per sub-partition of 16,384 registers): 139 -> 4,608 a warp, 3 per quarter
    assert narrow.resident_per_sm(139, 6784, 1) == 12
    assert narrow.resident_per_sm(200, 9216, 1) == 8  # 6,400 a warp: 2 per quarter (65,536 // 6,400 = 10)
    assert narrow.resident_per_sm(168, 0, 2) == 6  # 5,376 a warp: 12 warps, 6 two-warp programs
    assert narrow.resident_per_sm(64, 100 * 1024, 1) == 2  # shared memory bound
    assert narrow.resident_per_sm(32, 0, 1) == 32  # the block limit
    assert narrow.resident_per_sm(128, 0, 4) == 4  # 4 warps of 128 registers
    # 32 requests x 8 KV heads at 32K, 16 per SM on 132 SMs: 2,112 slots -> 8 splits (2,048 programs)
    assert narrow.pick_splits(256, 32768, 32, 16, 132) == 8
    assert narrow.pick_splits(8, 131072, 32, 16, 132) == 264  # one request: the slots, 2,112 / 8
    assert narrow.pick_splits(1, 1 << 20, 32, 16, 132) == narrow.MAX_SPLITS == 512  # one KV head: the cap
    assert narrow.pick_splits(8, 1000, 32, 16, 132) == 8  # 32 key tiles: 4 per split
    assert narrow.pick_splits(4096, 32768, 32, 16, 132) == 1  # more pairs than slots
    # exact-copy layouts: the exact-pairs program's part on top stays within the warmed combine
    assert narrow.pick_splits(3, 1 << 20, 64, 16, 132, exact=True) == narrow.MAX_SPLITS - 1
    lay = _layout("tq3", 3, 64)
    assert narrow.plan(lay, 64, 3, 1, 3, 1 << 20, 132, DEV)[3] + 1 <= narrow.MAX_SPLITS


@pytest.mark.parametrize("preset", SLICED)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 128), (7, 1, 64), (12, 3, 64)])
def test_decode_matches_reference(preset, hq, hkv, d, spy, monkeypatch):
    """`paged_decode`'s kernel on decode batches (one token per request, lengths off the block size,
    one request past the window, one inside it), one split and several (split-K partials combined)."""
    monkeypatch.setattr(narrow, "ENABLED", False)
    for splits in (None, 3):
        _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=splits)
    assert len(spy) == 2


@pytest.mark.parametrize("preset", NARROW + NARROW_EXACT)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 128), (7, 1, 64), (12, 3, 64), (4, 4, 64), (16, 1, 64)])
def test_narrow_decode_matches_reference(preset, hq, hkv, d, narrow_spy):
    """The narrow kernel (GQA group on the dots' N side) on decode batches: groups 4, 7 (odd), 4
    (three KV heads), 1 (MHA: N padded to 8) and 16 (N = 16), one split and several; with exact sink
    / window copies (tq3, tq3s: one request past the window, one inside it)."""
    for splits in (None, 3):
        _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=splits)
    assert len(narrow_spy) == 2


@pytest.mark.parametrize("preset", NARROW + NARROW_EXACT)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 128), (12, 3, 64), (4, 4, 64)])
def test_narrow_verify_matches_reference(preset, hq, hkv, d, narrow_spy):
    """The narrow kernel on verify batches (1 + k tokens, causal among themselves, beside a decode row):
    (token, head) columns 5 x 4 -> 32, 5 x 3 -> 16, 5 x 1 -> 8; one split and several."""
    for splits in (None, 3):
        _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], [5, 1, 3, 5], seed=6, num_splits=splits)
    assert len(narrow_spy) == 2


@pytest.mark.parametrize(
    ("preset", "hq", "hkv", "d"),
    [("turboquant_3bit_nc", 8, 2, 128), ("turboquant_3bit_nc", 3, 3, 128), ("turboquant_3bit_nc", 16, 2, 256),
     ("tq_k3v2_ub", 8, 2, 128), ("turboquant_k3v4_nc", 8, 2, 128)],
)  # fmt: skip
def test_narrow_3bit_matches_reference(preset, hq, hkv, d, narrow_spy):
    """3-bit codes (groups of 8 codes in 3 stream bytes, 8 slices per dot) on decode and verify
    batches: groups 4, 1 and 8, d = 128 and 256, one split and several."""
    for splits in (None, 3):
        _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=splits)
    qlens = [5, 1, 3, 5] if hq // hkv <= 4 else [3, 1, 2, 3]  # at most 32 columns
    _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], qlens, seed=6)
    assert len(narrow_spy) == 3


@pytest.mark.parametrize(
    ("preset", "hq", "hkv", "d"),
    [("tq4", 8, 2, 128), ("tq_k5v4_nc", 3, 3, 128), ("tq_k5v4_nc", 8, 2, 128), ("tq_k5v2_ub", 16, 2, 256)],
)
def test_narrow_5bit_keys_match_reference(preset, hq, hkv, d, narrow_spy, monkeypatch):
    """5-bit keys (tq4's; groups of 8 codes as two 20-bit halves cut from 5-word runs of the bit stream,
    8 slices per dot) on decode and verify batches, with 3-, 4- and 2-bit values, exact copies (tq4) and
    none, groups 4, 1 and 8, one split and several; off (`NARROW_KEYS5 = 0`), or at d = 64 (fewer than 16
    groups of 8 per token), the steps take the general kernel."""
    monkeypatch.setattr(paged_decode, "NARROW_KEYS5", 1)
    assert paged_decode.eligible(_layout(preset, hkv, d), 1, d, hq // hkv)
    assert not paged_decode.eligible(_layout(preset, hkv, 64), 1, 64, hq // hkv)
    for splits in (None, 3):
        _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=splits)
    qlens = [5, 1, 3, 5] if hq // hkv <= 4 else [3, 1, 2, 3]  # at most 32 columns
    _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], qlens, seed=6)
    assert len(narrow_spy) == 3
    monkeypatch.setattr(paged_decode, "NARROW_KEYS5", 0)
    assert not paged_decode.eligible(_layout(preset, hkv, d), 1, d, hq // hkv)


@pytest.mark.parametrize("preset", ["tq4", "tq_k5v4_nc"])
def test_narrow_5bit_keys_nan_pages(preset, narrow_spy, monkeypatch):
    """5-bit keys on pages whose unwritten slots hold NaN (scalars) and odd sequence lengths (a tile's last keys
    past the end): the narrow kernel's outputs are finite and agree with the general kernel's."""
    from test_paged_attention import _rel

    for run in _steps(preset, 128, seed=21, nan_pages=True):
        monkeypatch.setattr(paged_decode, "NARROW_KEYS5", 0)
        want = run(num_splits=3).float()
        monkeypatch.setattr(paged_decode, "NARROW_KEYS5", 1)
        got = run(num_splits=3).float()
        assert torch.isfinite(got).all()
        assert _rel(got, want) <= TOL
    assert len(narrow_spy) == 2


def test_groups5_cut_the_bit_stream():
    """Slice j of `_groups5`'s groups is code 8 g + j of the packed stream (all 32 codes and random rows)."""
    from tqserve.kvquant.packing import pack_bits

    gen = torch.Generator().manual_seed(5)
    d, bn = 128, 16
    idx = torch.randint(0, 32, (bn, d), generator=gen)
    idx[0] = torch.arange(d) % 32
    pages = pack_bits(idx, 5).to(DEV)  # [bn, 80] bytes

    @triton.jit
    def kernel(p_ptr, cb_ptr, o_ptr, D: tl.constexpr, BN: tl.constexpr):
        rows = tl.arange(0, BN)
        w = paged_decode._words(p_ptr, rows, rows < BN, 5, 8, D, False, False)
        for j in tl.static_range(8):
            c = paged_decode._cb_slice(w, j, cb_ptr, 5, "", tl.float32)  # the gathers, from an identity codebook
            tl.store(o_ptr + rows[:, None] * D + tl.arange(0, D // 8)[None, :] * 8 + j, c)

    out = torch.zeros(bn, d, dtype=torch.float32, device=DEV)
    kernel[(1,)](pages, torch.arange(32, dtype=torch.float32, device=DEV), out, D=d, BN=bn)
    assert torch.equal(out.cpu().long(), idx)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("preset", "hq", "hkv", "d"), [("tq4", 32, 8, 128), ("tq_k5v2_ub", 16, 2, 256)])
def test_narrow_5bit_gpu_real_sizes(preset, hq, hkv, d, narrow_spy, monkeypatch):
    """5-bit keys at real sizes (shuffle decoder on the GPU): decode, one long request (split-K), verify."""
    monkeypatch.setattr(paged_decode, "NARROW_KEYS5", 1)
    _check_one_step(preset, hq, hkv, d, [9000, 3000, 17, 1], [1, 1, 1, 1], seed=1)
    _check_one_step(preset, hq, hkv, d, [20000], [1], seed=2)
    qlen = 5 if hq // hkv <= 4 else 3
    _check_one_step(preset, hq, hkv, d, [5000, 2047, 64], [qlen] * 3, seed=3)
    assert len(narrow_spy) == 3


def test_narrow_3bit_value_bytes_equal_words(narrow_spy, monkeypatch):
    """3-bit min-max values of decode steps read as byte tiles (`paged_decode.MINMAX3_BYTES`) decode to
    the same operands as the 4-byte words: outputs identical bit for bit, one split and several."""
    d, hq, hkv, bs = 128, 8, 2, 16
    ctx = [3000, 777, 150] if DEV.type == "cuda" else [70, 33]
    gen = torch.Generator().manual_seed(11)
    fmt = make_layer_format("turboquant_3bit_nc", 3, hkv, d, torch.bfloat16)  # the 3-bit min-max values
    nblocks = sum((c + 1 + bs - 1) // bs for c in ctx) + 4
    meta = make_meta(ctx, [1] * len(ctx), bs, nblocks, DEV, seed=11)
    store = KVCacheStore([fmt], nblocks, bs, len(ctx) + 1, len(ctx) + 1, DEV)
    fill_context(store, 0, meta, ctx, gen)
    q, k, v = (torch.randn(len(ctx), h, d, generator=gen).to(DEV, torch.bfloat16) for h in (hq, hkv, hkv))
    fmt.write(store.pages[0], k, v, meta.slot_mapping)
    lay = layout_for_format(fmt, DEV)
    for splits in (None, 3):
        outs = []
        for on in (1, 0):
            monkeypatch.setattr(paged_decode, "MINMAX3_BYTES", on)
            outs.append(paged_attention(q, k, v, store.pages[0], lay, meta, d**-0.5, num_splits=splits))
        assert torch.equal(outs[0], outs[1])
    assert len(narrow_spy) == 4


def _steps(preset: str, d: int, seed: int, nan_pages: bool = False, odd_scalars: bool = False, dtype=torch.bfloat16):
    """A decode and a verify step (8 / 2 heads, odd sequence lengths) over pages
    written through the format's torch codec, each as run(**kw): `paged_attention` on them. With `nan_pages`,
    every page slot no request wrote holds NaN; with `odd_scalars`, the fp16 scalar tensors are views
    2 bytes past a 4-byte boundary."""
    hq, hkv, bs = 8, 2, 16
    ctx = [3001, 777, 150] if DEV.type == "cuda" else [69, 34]
    gen = torch.Generator().manual_seed(seed)
    fmt = make_layer_format(preset, 3, hkv, d, dtype)
    nblocks = sum((c + 5 + bs - 1) // bs for c in ctx) + 4
    lay = layout_for_format(fmt, DEV)
    for qlen in (1, 3):
        meta = make_meta(ctx, [qlen] * len(ctx), bs, nblocks, DEV, seed=seed)
        store = KVCacheStore([fmt], nblocks, bs, len(ctx) + 1, len(ctx) + 1, DEV)
        if nan_pages:
            for t in store.pages[0].values():
                if t.is_floating_point():
                    t.fill_(float("nan"))
        fill_context(store, 0, meta, ctx, gen)
        n = len(ctx) * qlen
        q, k, v = (torch.randn(n, h, d, generator=gen).to(DEV, dtype) for h in (hq, hkv, hkv))
        fmt.write(store.pages[0], k, v, meta.slot_mapping)
        if odd_scalars:
            for name, t in store.pages[0].items():
                if t.dtype == torch.float16:
                    view = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
                    store.pages[0][name] = view.copy_(t)

        def run(store=store, meta=meta, q=q, k=k, v=v, **kw):
            return paged_attention(
                q, k, v, store.pages[0], lay, meta, d**-0.5, ring=store.ring[0], sinks=store.sinks[0], **kw
            )

        yield run


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "tq_k4v4_ub", "turboquant_3bit_nc"])
def test_narrow_pair_scalars_equal_loads(preset, narrow_spy, monkeypatch):
    """Per-token scalars read through their 32-bit words (`paged._token_scalars`) give the outputs of
    one 2-byte load per key, bit for bit, on decode and verify steps (odd sequence lengths: a tile's
    last pair straddles the end), with NaN in every page slot no request wrote (a word's other half
    past the end must not reach the output)."""
    for run in _steps(preset, 128, seed=12, nan_pages=True):
        for splits in (None, 3):
            outs = []
            for on in (2, 0):
                monkeypatch.setattr(narrow, "PAIR_SCALARS", on)
                outs.append(run(num_splits=splits))
            assert not outs[0].isnan().any()
            assert torch.equal(outs[0], outs[1])
    assert len(narrow_spy) == 8


def test_narrow_pair_scalars_misaligned_views(narrow_spy, monkeypatch):
    """Scalar tensors that do not start on a 4-byte boundary take the 2-byte loads (the launch checks),
    so the outputs match them bit for bit. (On the GPU the 32-bit copies would fault on such views; the
    interpreter reads any address, so there this checks the outputs only.)"""
    monkeypatch.setattr(narrow, "PAIR_SCALARS", 2)
    odd = torch.empty(9, dtype=torch.float16, device=DEV)[1:]
    assert narrow.pair_scalars(_layout("turboquant_4bit_nc"), 8) and not narrow.pair_scalars(
        _layout("turboquant_4bit_nc"), 8, (odd,)
    )
    for run in _steps("turboquant_4bit_nc", 128, seed=14, odd_scalars=True):
        on = run()
        monkeypatch.setattr(narrow, "PAIR_SCALARS", 0)
        assert torch.equal(on, run())
        monkeypatch.setattr(narrow, "PAIR_SCALARS", 2)
    assert len(narrow_spy) == 4


@pytest.mark.parametrize(
    ("preset", "d"), [("turboquant_4bit_nc", 128), ("tq3", 64), ("tq3", 128), ("turboquant_3bit_nc", 256)]
)
def test_narrow_rotates_query_in_kernel(preset, d, narrow_spy, monkeypatch):
    """The query rotated inside the kernel (Hadamard slices and butterflies, `QROT`; with the L2
    prefetch of the first pages on the GPU) against the rotation before the launch (`rotate_rows`):
    the same outputs to float32 rounding, decode and verify, with the dispatch rule (power-of-two d, at
    least 16 coordinates per slice)."""
    monkeypatch.setattr(narrow, "QROT", 1)
    assert narrow.rotates_query(_layout(preset, d=d), d)
    assert not narrow.rotates_query(_layout("turboquant_3bit_nc", d=64), 64)  # 8 coordinates per slice
    assert not narrow.rotates_query(_layout("turboquant_4bit_nc", d=96), 96)  # two Hadamard blocks
    for run in _steps(preset, d, seed=13):
        outs = []
        for on in (1, 0):
            monkeypatch.setattr(narrow, "QROT", on)
            monkeypatch.setattr(narrow, "QROT_EXACT_DECODE", on)
            monkeypatch.setattr(narrow, "PREFETCH", on)
            monkeypatch.setattr(narrow, "PARK_DECODE", on)
            outs.append(run().float())
        err = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
        assert err < 4e-3, err  # bf16 outputs: a last-bit flip at most
    assert len(narrow_spy) == 4


@pytest.mark.gpu  # the interpreter keeps float32 dots: both settings would run the same kernel there
@pytest.mark.parametrize(("preset", "dtype"), [("turboquant_4bit_nc", torch.bfloat16), ("tq3", torch.float16)])
def test_narrow_rotation_dots_16bit(preset, dtype, narrow_spy, monkeypatch):
    """The in-kernel rotation's Hadamard dots on the query's 16-bit operands with H from `hadamard_table`
    (`ROT16`, the GPU's default for parked rotations, here for every one) against tf32 ones on H built in
    registers: the products are exact either way, so the outputs
    agree to the float32 sums' rounding, decode and verify, split or not."""
    monkeypatch.setattr(narrow, "QROT", 1)
    for run in _steps(preset, 128, seed=23, dtype=dtype):
        for splits in (None, 3):
            outs = []
            for on in (2, 0):
                monkeypatch.setattr(narrow, "ROT16", on)
                outs.append(run(num_splits=splits).float())
            assert not outs[0].isnan().any()
            err = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
            assert err < 4e-3, (splits, err)  # 16-bit outputs: a last-bit flip at most
    assert len(narrow_spy) == 8


@triton.jit
def _signs_kernel(q_ptr, r_ptr, o_ptr, h_ptr, D: tl.constexpr, N: tl.constexpr, ROT16: tl.constexpr):
    n = tl.arange(0, N)
    x = narrow._q_signed(q_ptr, r_ptr, 0, n, n < N - 1, D, ROT16)  # the last column is padding
    d = tl.arange(0, D)
    tl.store(o_ptr + d[:, None] * N + n[None, :], x.to(tl.float32))
    tl.store(h_ptr + d[:, None] * D + d[None, :], narrow._sylvester(D, q_ptr.dtype.element_ty).to(tl.float32))


@triton_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rot16", [0, 1])
def test_query_signs_and_sylvester(dtype, rot16):
    """The rotation's pieces: `_q_signed` flips each query coordinate by the sign bit of R's first row (an
    XOR, on the 16-bit words with ROT16) and zeroes padded columns; `_sylvester` builds H from the parity
    as a sign bit, exactly, in each dtype."""
    d, n = 32, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n - 1, d, generator=gen).to(DEV, dtype)
    r = torch.randn(d, generator=gen).to(DEV)
    out = torch.empty(d, n, device=DEV)
    h = torch.empty(d, d, device=DEV)
    _signs_kernel[(1,)](q, r, out, h, D=d, N=n, ROT16=rot16)
    want = (q.float() * torch.where(r > 0, 1.0, -1.0)[None, :]).T.cpu()
    assert torch.equal(out.cpu()[:, : n - 1], want)
    assert (out.cpu()[:, n - 1] == 0).all()
    i = torch.arange(d)
    parity = torch.tensor([bin(int(x)).count("1") % 2 for x in (i[:, None] & i[None, :]).flatten()]).view(d, d)
    assert torch.equal(h.cpu(), 1.0 - 2.0 * parity.float())
    table = narrow.hadamard_table(d, dtype, DEV)
    assert table.dtype == dtype and torch.equal(table.float().cpu(), h.cpu())
    assert narrow.hadamard_table(d, dtype, DEV) is table  # built once


@pytest.mark.parametrize(("preset", "dtype"), [("turboquant_4bit_nc", torch.bfloat16), ("tq3", torch.bfloat16),
                                               ("turboquant_4bit_nc", torch.float32)])  # fmt: skip
def test_narrow_parked_query_equals_held(preset, dtype, narrow_spy, monkeypatch):
    """The in-kernel rotated query parked in the program's output rows and read back (`_park_q4`)
    gives the outputs of the slices held in registers, bit for bit: decode and verify, the output
    written directly (one split) and split-K partials. (The interpreter parks float32 models' queries
    only: a bfloat16 output row has no room for its float32 slices.)"""
    monkeypatch.setattr(narrow, "QROT", 1)
    for run in _steps(preset, 128, seed=17, dtype=dtype):
        for splits in (None, 1, 3):
            outs = []
            for on in (1, 0):
                monkeypatch.setattr(narrow, "PARK", on)
                outs.append(run(num_splits=splits))
            assert not outs[0].isnan().any()
            assert torch.equal(outs[0], outs[1])
    assert len(narrow_spy) == 12


@pytest.mark.parametrize(
    ("preset", "d", "dtype"),
    [("tq3", 128, torch.bfloat16), ("tq_k4v4_ub", 64, torch.bfloat16), ("tq_k3v3_ub", 128, torch.bfloat16),
     ("tq_k4v2_nc", 128, torch.float32), ("turboquant_k3v4_nc", 128, torch.bfloat16)],
)  # fmt: skip
def test_narrow_unrotates_values_in_kernel(preset, d, dtype, narrow_spy, monkeypatch):
    """Codebook values taken out of the rotated space in each program's epilogue (`VROT`, `VROT_DECODE`:
    Hadamard dots over the slices, butterflies, signs) against `finish._finish_kernel`'s rotation back
    after the combine: the same outputs to rounding, decode and verify, one split (the kernel writes
    the output) and several, 4 and 8 coordinates per slice (3-bit values: tq_k3v3_ub); min-max values
    (turboquant_k3v4_nc), two Hadamard blocks (d = 96) and d = 256 (`VROT_MAX_D`) are not taken."""
    lay = _layout(preset, d=d)
    assert narrow.unrotates_values(lay, d, 5) == lay.rotated_values
    assert not narrow.unrotates_values(lay, d, 1)  # decode steps: `VROT_DECODE`
    assert not narrow.unrotates_values(_layout("tq3", d=96), 96, 5)
    assert not narrow.unrotates_values(_layout("tq3", d=256), 256, 5)  # `VROT_MAX_D`
    assert not narrow.unrotates_values(_layout("tq_k3v3_ub", d=64), 64, 5)  # 8 coordinates per slice
    monkeypatch.setattr(narrow, "VROT", 0)
    assert not narrow.unrotates_values(lay, d, 5)
    monkeypatch.setattr(narrow, "VROT_DECODE", 1)
    assert narrow.unrotates_values(lay, d, 1) == lay.rotated_values
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 outputs: a last-bit flip at most
    for run in _steps(preset, d, seed=19, dtype=dtype):
        for splits in (None, 1, 3):
            outs = []
            for on in (1, 0):
                monkeypatch.setattr(narrow, "VROT", on)
                monkeypatch.setattr(narrow, "VROT_DECODE", on)
                outs.append(run(num_splits=splits).float())
            assert not outs[0].isnan().any()
            err = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
            assert err < tol, (splits, err)
    assert len(narrow_spy) == 12


def test_rotates_query_rule(monkeypatch):
    """By default the kernel rotates the query of decode steps at d = 128 with 4-bit keys: over
    exact-copy layouts holding the slices and prefetching their first pages (`QROT_EXACT_DECODE`),
    over the others parking them (`PARK_DECODE`); verify steps, 3-bit keys and other head sizes take
    `rotate_rows`; QROT = 1 rotates in every eligible step."""
    tq3, nc4 = _layout("tq3", d=128), _layout("turboquant_4bit_nc", d=128)
    assert narrow.rotates_query(tq3, 128, 1) and narrow.exact_decode_rotation(tq3, 128, 1)
    assert not narrow.parks_query(tq3, 128, 1)
    assert narrow.rotates_query(nc4, 128, 1) and narrow.parks_query(nc4, 128, 1)
    assert not narrow.rotates_query(tq3, 128, 5) and not narrow.rotates_query(nc4, 128, 5)
    assert not narrow.rotates_query(_layout("turboquant_3bit_nc", d=128), 128, 1)
    assert not narrow.rotates_query(_layout("tq3", d=64), 64, 1)
    assert not narrow.rotates_query(_layout("turboquant_4bit_nc", d=64), 64, 1)
    monkeypatch.setattr(narrow, "QROT", 1)
    assert narrow.rotates_query(tq3, 128, 5) and narrow.rotates_query(nc4, 128, 5)
    monkeypatch.setattr(narrow, "QROT", 0)
    monkeypatch.setattr(narrow, "QROT_EXACT_DECODE", 0)
    monkeypatch.setattr(narrow, "PARK_DECODE", 0)
    assert not narrow.rotates_query(tq3, 128, 1) and not narrow.rotates_query(nc4, 128, 1)
    monkeypatch.setattr(narrow, "_interpreting", lambda: False)
    assert narrow.prefetch_pages(16, tuned=True) > 0 and narrow.prefetch_pages(16) == 0


@pytest.mark.parametrize("tau", [0.5, 8.0])
def test_narrow_lazy_rescale(tau, narrow_spy, monkeypatch):
    """Lazy online-softmax rescaling (accumulators rescaled only when a column's maximum grows by more
    than LAZY_TAU) on decode and verify batches, exact-copy layouts included; 0.5 rescales often,
    8 rarely (random scores). (The eager update is every other narrow test's.)"""
    monkeypatch.setattr(narrow, "LAZY_TAU", tau)
    monkeypatch.setattr(narrow, "LAZY_MIN_COLS", 8)
    for splits in (None, 3):
        _check_one_step("turboquant_4bit_nc", 8, 2, 128, [300, 77, 150, 9], [5, 1, 3, 5], seed=6, num_splits=splits)
        _check_one_step("tq3", 12, 3, 64, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=splits)
    assert len(narrow_spy) == 4


def test_narrow_column_groups_rule(monkeypatch):
    """Two column groups (N / 2 and 8) where the real columns fill at most N / 2 + 8 of a padded N >= 32."""
    assert narrow.col_groups(5, 4) == (16, 8) and narrow.col_groups(6, 4) == (16, 8)  # 20, 24 of 32
    assert narrow.col_groups(3, 7) == (16, 8)  # 21 of 32
    assert narrow.col_groups(7, 4) == (32, 0) and narrow.col_groups(8, 4) == (32, 0)  # 28, 32: one group
    assert narrow.col_groups(1, 4) == (8, 0) and narrow.col_groups(4, 4) == (16, 0)
    assert narrow.col_groups(5, 3) == (16, 0)
    lay = _layout("turboquant_4bit_nc")
    key = narrow.plan(lay, 128, 4, 5, 64, 32768, 132, DEV)[4]
    monkeypatch.setattr(narrow, "SPLIT_COLS", 0)
    assert narrow.col_groups(5, 4) == (32, 0)
    assert narrow.plan(lay, 128, 4, 5, 64, 32768, 132, DEV)[4] != key  # a launch key of its own


def test_int8_keys_rule(monkeypatch):
    """4-bit codebook keys take the int8 path (`KEYS_I8`) in decode steps of 16-bit models, and in verify steps
    only over min-max values; float32 models, other key widths and head sizes under 64 keep the fp16 slices."""
    bit4, tq3, k4v4 = _layout("turboquant_4bit_nc"), _layout("tq3"), _layout("tq_k4v4_nc")
    assert narrow.keys_i8(bit4, 128, False, 1) and narrow.keys_i8(bit4, 64, False, 1)
    assert narrow.keys_i8(bit4, 128, False, 5)  # min-max values: verify too
    assert narrow.keys_i8(tq3, 128, False, 1) and not narrow.keys_i8(tq3, 128, False, 5)
    assert narrow.keys_i8(k4v4, 128, False, 1) and not narrow.keys_i8(k4v4, 128, False, 5)
    assert not narrow.keys_i8(bit4, 128, True, 1)  # float32 model
    assert not narrow.keys_i8(bit4, 32, False, 1)  # 16 code bytes per key: under an int8 dot's K
    for preset in ("turboquant_3bit_nc", "tq_k2v4_nc", "tq4"):
        assert not narrow.keys_i8(_layout(preset), 128, False, 1), preset
    monkeypatch.setattr(narrow, "KEYS_I8", 0)
    assert not narrow.keys_i8(bit4, 128, False, 1)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3"])
@pytest.mark.parametrize("qlen", [1, 5])
def test_int8_keys_match_fp16_slices(preset, qlen, narrow_spy, monkeypatch):
    """The same step with int8 keys and with the fp16 slice decoders: both are the reference's attention to bf16
    rounding (the 15-bit fixed-point query and the fp16 query round differently)."""
    run = _layer_step(preset, [37, 90, 5], qlen, seed=3, hq=8, hkv=2, d=128)
    monkeypatch.setattr(narrow, "KEYS_I8", 1)
    a = run(None).float()
    monkeypatch.setattr(narrow, "KEYS_I8", 0)
    b = run(None).float()
    assert narrow_spy and not a.isnan().any()
    assert float((a - b).norm() / b.norm()) < 4e-3


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "turboquant_3bit_nc", "tq_k4v4_ub"])
@pytest.mark.parametrize("tau", [0.0, 8.0])
def test_narrow_column_groups(preset, tau, narrow_spy, monkeypatch):
    """Verify steps of 5 tokens x a group of 4 (20 real columns) run as two column groups of 16 + 8 over
    the same decoded slices (`col_groups`), and as one group of 32: both match the reference, with the
    eager and the lazy rescale, one split and several; 4- and 3-bit codes (4 and 8 slices), min-max and
    codebook values, exact sink / window copies (tq3)."""
    monkeypatch.setattr(narrow, "LAZY_TAU", tau)
    for split_cols in (1, 0):
        monkeypatch.setattr(narrow, "SPLIT_COLS", split_cols)
        for splits in (None, 3):
            _check_one_step(preset, 8, 2, 128, [300, 77, 150, 9], [5, 1, 3, 5], seed=6, num_splits=splits)
    assert len(narrow_spy) == 4


@pytest.mark.parametrize("byte_values", [1, 0])
def test_narrow_value_decoders(byte_values, monkeypatch):
    """2-bit codebook values of 32-row verify programs use `shfl_slices_b8` decoders in `paged_decode`'s
    kernel only; the narrow kernel must be handed its own: the byte-word permutes (`prmt_slices_b8`)
    where `narrow.byte_values` says so, else the two-words-per-register ones. (The interpreter runs no
    inline PTX, so the decoders are stand-ins and the launch is recorded, not run.)"""
    monkeypatch.setattr(narrow, "BYTE_VALUES_VERIFY", byte_values)
    monkeypatch.setattr(
        paged_decode, "_asm_for", lambda layout, side, bits, pairs=None, join=False: (f"{side}-pair",) * 4
    )
    monkeypatch.setattr(paged_decode, "_asm_b8", lambda layout: ("v-bytes",) * 4)
    monkeypatch.setattr(paged_decode, "_asm_prmt_b8", lambda layout: ("v-prmt-bytes",) * 4)
    got = {}

    def record(*args, **kw):
        got["vasm"] = args[17]
        raise StopIteration  # nothing to run

    monkeypatch.setattr(narrow, "launch", record)
    hq, hkv, d, ctx, ql = 8, 2, 128, [40, 20], [5, 5]
    fmt = make_layer_format("tq_k4v2_nc", 3, hkv, d, torch.bfloat16)
    meta = make_meta(ctx, ql, 16, 12, DEV)
    store = KVCacheStore([fmt], 12, 16, 3, 3, DEV)
    q, k, v = (torch.randn(sum(ql), h, d).to(DEV, torch.bfloat16) for h in (hq, hkv, hkv))
    lay = layout_for_format(fmt, DEV)
    assert narrow.eligible(lay, 5, hq // hkv)
    assert narrow.byte_values(lay, 5) == bool(byte_values)
    with pytest.raises(StopIteration):
        paged_decode.decode_attention(q, k, v, store.pages[0], lay, meta, d**-0.5)
    assert got["vasm"] == (("v-prmt-bytes",) if byte_values else ("v-pair",)) * 4


def test_narrow_value_rows_rule(monkeypatch):
    """The value words' row order (`value_rows`): byte-word values only; decode steps (the tuned table), verify
    steps only by their knobs (off since the thirty-third session)."""
    tq3, k4v2, k4v4 = (_layout(p, 2, 128) for p in ("tq3", "tq_k4v2_nc", "tq_k4v4_ub"))
    assert narrow.value_rows(tq3, 1) and narrow.value_rows(k4v2, 1) and not narrow.value_rows(k4v4, 1)
    assert not narrow.value_rows(tq3, 5) and not narrow.value_rows(k4v2, 5)
    monkeypatch.setattr(narrow, "VALUE_ROWS_VERIFY_EXACT", 1)
    assert narrow.value_rows(tq3, 5) and not narrow.value_rows(k4v2, 5)
    monkeypatch.setattr(narrow, "BYTE_VALUES", 0)
    assert not narrow.value_rows(tq3, 1)


@pytest.mark.parametrize("rows", [0, 1])
@pytest.mark.parametrize("preset", ["tq3", "tq_k4v2_nc"])
def test_narrow_value_rows_match_reference(preset, rows, narrow_spy, monkeypatch):
    """Decode and verify with the value words' rows in memory order and reordered (the accumulator rows
    then name other output coordinates): both agree with the reference, d = 128 and 64."""
    for knob in ("VALUE_ROWS", "VALUE_ROWS_VERIFY", "VALUE_ROWS_VERIFY_EXACT"):
        monkeypatch.setattr(narrow, knob, rows)
    _check_one_step(preset, 8, 2, 128, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=3)
    _check_one_step(preset, 12, 3, 64, [300, 77, 150, 9], [5, 1, 3, 5], seed=6)
    assert len(narrow_spy) == 2


@pytest.mark.parametrize("preset", SLICED)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 128), (12, 3, 64)])
def test_verify_matches_reference(preset, hq, hkv, d, spy, monkeypatch):
    """`paged_decode`'s kernel on verify batches (1 + k query tokens, causal among themselves, mixed
    with a decode row and a request whose window spans its drafts), one split and several."""
    monkeypatch.setattr(narrow, "ENABLED", False)
    for splits in (None, 3):
        _check_one_step(preset, hq, hkv, d, [300, 77, 150, 9], [5, 1, 3, 5], seed=6, num_splits=splits)
    assert len(spy) == 2


@pytest.mark.parametrize(
    ("phased_rows", "chunks", "fold", "byte_rows"), [(16, 2, 1, 16), (32, 4, 1, 64), (64, 2, 0, 64), (64, 2, 1, 32)]
)
def test_exact_pass_variants(phased_rows, chunks, fold, byte_rows, spy, monkeypatch):
    """The exact sink / window pass both ways (phased: statistics before the packed loop, values
    after it in column chunks; or one pass after the loop), with the folded and the old packed-loop
    masks, 2-bit value words loaded transposed or not, on decode (16-row programs) and verify (32-row)
    batches, one split and several."""
    monkeypatch.setattr(paged_decode, "EXACT_PHASED_ROWS", phased_rows)
    monkeypatch.setattr(paged_decode, "EXACT_CHUNKS", chunks)
    monkeypatch.setattr(paged_decode, "FOLD_EXACT_MASK", fold)
    monkeypatch.setattr(paged_decode, "BYTE_VALUES_ROWS", byte_rows)
    monkeypatch.setattr(narrow, "ENABLED", False)  # tq3 / tq3s steps would go there
    for splits in (None, 3):
        _check_one_step("tq3", 8, 2, 128, [300, 77, 150, 9], [5, 1, 3, 5], seed=6, num_splits=splits)
        _check_one_step("tq3s", 8, 2, 64, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=splits)
    assert len(spy) == 4


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3"])
def test_store_then_decode_steps(preset, spy):
    """Prefill through the store kernel, then decode steps reading what it wrote (Triton backend vs
    reference backend, step after step)."""
    steps = [([0, 0], [90, 41]), ([90, 41], [1, 1]), ([91, 42], [1, 1])]
    errs = backend_step_errors(preset, 8, 2, 64, steps, gen_seed=3, meta_seed=4, device=DEV)
    assert max(errs) < TOL, errs
    assert len(spy) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("preset", "hq", "hkv", "d"),
    [("turboquant_4bit_nc", 32, 8, 128), ("turboquant_4bit_nc", 9, 3, 64), ("tq3", 28, 4, 128), ("tq3s", 32, 8, 128),
     ("tq_k4v4_nc", 16, 2, 256)],
)  # fmt: skip
@pytest.mark.parametrize("narrow_on", [True, False])
def test_decode_gpu_real_sizes(preset, hq, hkv, d, narrow_on, spy, monkeypatch):
    """Real sizes, both kernels (exact-copy layouts too), decode with one and many splits, verify."""
    monkeypatch.setattr(narrow, "ENABLED", narrow_on)
    _check_one_step(preset, hq, hkv, d, [9000, 3000, 17, 1], [1, 1, 1, 1], seed=1)
    _check_one_step(preset, hq, hkv, d, [20000], [1], seed=2)  # one long request: split-K
    _check_one_step(preset, hq, hkv, d, [5000, 2047, 64], [5, 5, 5], seed=3)  # verify
    verify_here = paged_decode.eligible(_layout(preset, hkv, d), 5, d, hq // hkv)  # GQA 7: 64 rows, general kernel
    assert len(spy) == 2 + verify_here


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("preset", "hq", "hkv", "d"), [("turboquant_3bit_nc", 32, 8, 128), ("tq_k3v2_ub", 16, 2, 256)])
def test_narrow_3bit_gpu_real_sizes(preset, hq, hkv, d, narrow_spy):
    """3-bit codes at real sizes: decode, one long request (split-K), verify."""
    _check_one_step(preset, hq, hkv, d, [9000, 3000, 17, 1], [1, 1, 1, 1], seed=1)
    _check_one_step(preset, hq, hkv, d, [20000], [1], seed=2)
    qlen = 5 if hq // hkv <= 4 else 3
    _check_one_step(preset, hq, hkv, d, [5000, 2047, 64], [qlen] * 3, seed=3)
    assert len(narrow_spy) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("lookup", "pair_tables", "join"), [("shfl", 1, 1), ("prmt", 1, 1), ("shfl", 2, 1), ("shfl", 1, 0), ("shfl", 1, 2)]
)
@pytest.mark.parametrize(
    "preset",
    [
        *("turboquant_4bit_nc", "tq_k4v4_nc", "tq3", "tq_k4v4_ub", "tq_k2v4_nc", "tq_k4v2_nc", *NARROW3),
        *("fp8", "turboquant_k8v4", "tq4", "tq_k8v3_nc", "tq_k4v8_nc"),
    ],
)
@pytest.mark.parametrize(("qlen", "narrow_on"), [(1, True), (1, False), (5, True), (5, False)])
def test_asm_decoders_equal_gathers(preset, lookup, pair_tables, join, qlen, narrow_on, monkeypatch):
    """The inline-PTX slice decoders (shuffle or PRMT codebook lookups, pair tables of 2-bit codes,
    magic-number min-max values; shuffled pairs joined by a permute or an add, `join` = JOIN_ADD) must produce
    the fp16 operands bit for bit: outputs identical to the gather path on the same pages, for decode (both
    kernels) and for verify rows (tq3's through the narrow kernel too)."""
    if preset in (*NARROW3, "fp8", "turboquant_k8v4", "tq4", "tq_k8v3_nc", "tq_k4v8_nc") and not narrow_on:
        pytest.skip("3- and 5-bit codes and fp8 sides have no decoders outside the narrow kernel")
    if pair_tables == 2 and preset not in ("tq3", "tq_k2v4_nc", "tq_k4v2_nc", "tq_k3v2_ub"):
        pytest.skip("PAIR_TABLES = 2 changes only 2-bit codebook decoders")
    by_default = preset in ("tq_k4v4_nc", "tq_k4v4_ub") and qlen == 1  # `join_add` at JOIN_ADD = 1
    if join != 1 and (lookup != "shfl" or preset in NARROW3 or (join == 0) != by_default):
        pytest.skip("JOIN_ADD = 0 / 2 change the 2- / 4-bit shuffle decoders of steps that join / do not by default")
    monkeypatch.setattr(paged_decode, "JOIN_ADD", join)
    monkeypatch.setattr(narrow, "ENABLED", narrow_on)
    monkeypatch.setattr(paged_decode, "PAIR_TABLES", pair_tables)
    monkeypatch.setattr(paged_decode, "PRMT2_DECODE", 0)  # PAIR_TABLES alone picks the 2-bit decoders
    d, hq, hkv, bs = 128, 32, 8, 16
    ctx = [3000, 777, 1500]
    gen = torch.Generator().manual_seed(7)
    fmt = make_layer_format(preset, 3, hkv, d, torch.bfloat16)
    nblocks = sum((c + qlen + bs - 1) // bs for c in ctx) + 4
    meta = make_meta(ctx, [qlen] * 3, bs, nblocks, DEV, seed=7)
    store = KVCacheStore([fmt], nblocks, bs, len(ctx) + 1, len(ctx) + 1, DEV)
    fill_context(store, 0, meta, ctx, gen)
    T = 3 * qlen
    q, k, v = (torch.randn(T, h, d, generator=gen).to(DEV, torch.bfloat16) for h in (hq, hkv, hkv))
    fmt.write(store.pages[0], k, v, meta.slot_mapping)
    monkeypatch.setattr(paged_decode, "MAX_QUERY_LEN", qlen)
    outs = []
    for mode in (lookup, "gather"):
        monkeypatch.setattr(paged_decode, "LOOKUP", mode)
        lay = layout_for_format(fmt, DEV)
        assert paged_decode.eligible(lay, qlen, d)
        outs.append(
            paged_attention(q, k, v, store.pages[0], lay, meta, d**-0.5, ring=store.ring[0], sinks=store.sinks[0])
        )
    assert torch.equal(outs[0], outs[1])


PRESETS_JOIN = ("turboquant_4bit_nc", "tq_k4v4_nc", "tq_k4v4_ub", "tq3", "tq_k2v4_nc")


def test_join_add_rule(monkeypatch):
    """`join_add`: decode steps over 4-bit codebook keys and values at JOIN_ADD = 1 (verify steps and other
    layouts keep the permute); every step at 2; none at 0."""
    lays = {p: layout_for_format(make_layer_format(p, 3, 2, 128, torch.bfloat16), "cpu") for p in PRESETS_JOIN}
    want = {("tq_k4v4_nc", 1), ("tq_k4v4_ub", 1)}
    got = {(p, q) for p, lay in lays.items() for q in (1, 5) if paged_decode.join_add(lay, q)}
    assert got == want
    monkeypatch.setattr(paged_decode, "JOIN_ADD", 2)
    assert all(paged_decode.join_add(lay, q) for lay in lays.values() for q in (1, 5))
    monkeypatch.setattr(paged_decode, "JOIN_ADD", 0)
    assert not any(paged_decode.join_add(lay, q) for lay in lays.values() for q in (1, 5))


def test_prefetch_pages_rule(monkeypatch):
    """`prefetch_pages`: off by the knob and under the interpreter; else whole stages of key tiles' pages,
    rounded to a power of two."""
    monkeypatch.setattr(narrow, "PREFETCH", 0)
    assert narrow.prefetch_pages(16) == 0
    monkeypatch.setattr(narrow, "PREFETCH", 1)
    monkeypatch.setattr(narrow, "_interpreting", lambda: True)
    assert narrow.prefetch_pages(16) == 0
    monkeypatch.setattr(narrow, "_interpreting", lambda: False)
    assert narrow.prefetch_pages(16) == triton.next_power_of_2(narrow.NUM_STAGES * narrow.BLOCK_N // 16)
    assert narrow.prefetch_pages(1024) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "tq_k4v4_ub", "turboquant_3bit_nc"])
@pytest.mark.parametrize("qlen", [1, 5])
def test_narrow_prefetch_changes_nothing(preset, qlen, narrow_spy, monkeypatch):
    """The L2 prefetch of each program's first pages is a hint: outputs bit for bit those without it, for
    requests shorter than one prefetch, longer ones split many ways, and a request the exact copies
    cover entirely (tq3)."""
    bs = 16
    run = _layer_step(preset, [9000, 40, 3, 1500], qlen, 11, hq=32, hkv=8, bs=bs)
    outs = []
    monkeypatch.setattr(narrow, "QROT_EXACT_DECODE", 0)  # (its steps prefetch whatever PREFETCH says)
    for pf in (0, 1):
        monkeypatch.setattr(narrow, "PREFETCH", pf)
        # a new configuration's first launch records its occupancy, which the split planner reads: warm
        # it, so that both runs of the planned split count take the same splits
        run(None)
        outs += [run(None), run(7)]
    assert narrow.prefetch_pages(bs) > 0
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert len(narrow_spy) == 6


@pytest.mark.parametrize("lanes", [0, 2])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "turboquant_3bit_nc"])
def test_narrow_lane_sums(preset, lanes, narrow_spy, monkeypatch):
    """Per-lane partial sums (`LANE_SUMS`, here off or in every lazy step) against the reference: verify
    steps of mixed lengths, split and unsplit, and decode steps; lengths that leave partial tiles at the
    ends, tile edges between a request's first and last query positions (30 and 62 with 5 query tokens),
    and (tq3) tiles at the sink and window edges."""
    monkeypatch.setattr(narrow, "LANE_SUMS", lanes)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9, 62], [5, 1, 3, 5, 4], seed=9)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9, 62], [5, 5, 5, 5, 5], seed=10, num_splits=3)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9, 62], [1, 1, 1, 1, 1], seed=11, num_splits=3)
    assert len(narrow_spy) == 3


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3"])
def test_narrow_whole_tiles_change_nothing(preset, narrow_spy, monkeypatch):
    """Whole tiles in a loop of their own without masks (`TAIL_MASK`) skip only selects that keep
    everything: outputs bit for bit in the interpreter. On the GPU, within one bf16 rounding: the H200 gave
    other bits in the thirtieth session (not bit-equal), and met this bound in the thirty-first."""
    run = _layer_step(preset, [300, 77, 30, 9, 62], 5, 12)
    outs = []
    for tail in (0, 2):
        monkeypatch.setattr(narrow, "TAIL_MASK", tail)
        outs.append(run(3))
    if DEV.type == "cpu":  # the interpreter runs the same float32 operations either way
        assert torch.equal(outs[0], outs[1])
    else:  # ptxas may fuse an unmasked loop's norm multiply into the softmax's subtract (one rounding less)
        torch.testing.assert_close(outs[1], outs[0], rtol=2**-7, atol=1e-4)
    assert len(narrow_spy) == 2


@pytest.mark.parametrize("tail", [0, 2])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3", "turboquant_3bit_nc"])
def test_narrow_tail_loops(preset, tail, narrow_spy, monkeypatch):
    """A split's whole tiles in a loop without masks, and the tiles before and after them (sink edge,
    window, causal, partial) in loops that mask (`TAIL_MASK`; 2: exact-copy layouts too; the default, 1, runs
    in every other test), or one masked loop (0), against the reference: split and unsplit verify
    steps whose first and last query positions straddle tile edges (30 and 62 with 5 tokens), one-tile
    requests, decode steps."""
    monkeypatch.setattr(narrow, "TAIL_MASK", tail)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9, 62], [5, 1, 3, 5, 4], seed=15)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9, 62], [5, 5, 5, 5, 5], seed=16, num_splits=3)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9, 62], [1, 1, 1, 1, 1], seed=17, num_splits=3)
    assert len(narrow_spy) == 3


@pytest.mark.parametrize("rows32", [0, 1])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq3"])
def test_narrow_page_rows_in_32_and_64_bits(preset, rows32, narrow_spy, monkeypatch):
    """The narrow kernel's page rows and addresses in 32-bit arithmetic (`paged.rows32`: every page
    tensor under 2 GiB) and in 64-bit arithmetic, on decode (split) and verify batches."""
    monkeypatch.setattr(narrow, "ROWS32", rows32)
    _check_one_step(preset, 8, 2, 128, [300, 77, 150, 9], [1, 1, 1, 1], seed=5, num_splits=3)
    _check_one_step(preset, 8, 2, 128, [300, 77, 150, 9], [5, 1, 3, 5], seed=6)
    assert len(narrow_spy) == 2


@pytest.mark.parametrize("defer, lazy_tau", [(True, 0.0), (False, 0.5), (True, 0.5), (True, 8.0)])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc", "tq3"])
def test_narrow_decode_sums(preset, defer, lazy_tau, narrow_spy, monkeypatch):
    """Decode steps with the softmax denominator and min-max zero terms summed after the key loop
    (`DECODE_SUMS`' DEFER; exact-copy layouts ignore it) and / or the lazy rescale, whose small threshold
    here makes the running maxima grow past it mid-sequence (the rare rescale branch taken), on split and
    unsplit batches; verify steps alongside are untouched."""
    monkeypatch.setattr(narrow, "_decode_sums", lambda layout, d, n_cols: (defer, lazy_tau > 0))
    monkeypatch.setattr(narrow, "LAZY_TAU", lazy_tau or narrow.LAZY_TAU)
    _check_one_step(preset, 8, 2, 128, [300, 77, 150, 9], [1, 1, 1, 1], seed=7, num_splits=3)
    _check_one_step(preset, 8, 2, 128, [300, 77, 150, 9], [1, 1, 1, 1], seed=8)
    assert len(narrow_spy) == 2


def test_decode_sums_table(monkeypatch):
    """`DECODE_SUMS` picks per layout for decode steps only; the A/B knob switches deferring off."""
    assert narrow.defer_sums(_layout("turboquant_3bit_nc"), 128, 8)
    assert not narrow.defer_sums(_layout("turboquant_3bit_nc"), 128, 32)  # verify
    assert not narrow.defer_sums(_layout("turboquant_4bit_nc"), 128, 8)  # lazy with lane sums instead
    assert narrow.lazy_tau(_layout("turboquant_4bit_nc"), 128, 8) == narrow.LAZY_TAU
    assert not narrow.defer_sums(_layout("turboquant_4bit_nc", d=64), 64, 8)
    assert narrow.lazy_tau(_layout("tq3"), 128, 8) == narrow.LAZY_TAU
    assert narrow.lazy_tau(_layout("tq_k4v4_nc"), 128, 8) == 0.0
    assert narrow.lazy_tau(_layout("tq_k4v4_nc"), 128, 32) == narrow.LAZY_TAU
    monkeypatch.setattr(narrow, "DEFER_SUMS", 0)
    assert not narrow.defer_sums(_layout("turboquant_3bit_nc"), 128, 8)
    # the A/B knobs' modes: 1 is verify steps and the decode steps of the layouts `DECODE_SUMS` gives lane sums
    assert not narrow.lane_sums(_layout("tq3"), 128, 1) and narrow.lane_sums(_layout("tq3"), 128, 5)
    assert narrow.lane_sums(_layout("turboquant_4bit_nc"), 128, 1)
    assert not narrow.lane_sums(_layout("turboquant_4bit_nc", d=64), 64, 1)
    monkeypatch.setattr(narrow, "LANE_SUMS", 2)
    assert narrow.lane_sums(_layout("tq3"), 128, 1)
    # the split loop: min-max values at d = 128 without exact copies in every step, `TAIL_VERIFY` in verify steps
    tail = narrow.tail_mask
    assert tail(_layout("turboquant_4bit_nc"), 128, 1) and tail(_layout("turboquant_4bit_nc"), 128, 5)
    assert not tail(_layout("tq3"), 128, 1) and not tail(_layout("tq3"), 128, 5)
    assert not tail(_layout("tq4"), 128, 1) and tail(_layout("tq4"), 128, 5)
    assert not tail(_layout("tq_k4v4_nc"), 128, 1) and tail(_layout("tq_k4v4_ub"), 128, 2)
    assert not tail(_layout("tq_k4v2_nc"), 128, 5)
    assert not tail(_layout("turboquant_4bit_nc", d=64), 64, 1) and tail(_layout("turboquant_4bit_nc", d=64), 64, 5)
    monkeypatch.setattr(narrow, "TAIL_MASK", 2)
    assert tail(_layout("tq3"), 128, 1)
    monkeypatch.setattr(narrow, "TAIL_MASK", 0)
    assert not tail(_layout("turboquant_4bit_nc"), 128, 1) and not tail(_layout("tq4"), 128, 5)


@pytest.mark.parametrize("transposed", [0, 1])
@pytest.mark.parametrize("preset", ["tq4", "tq_k5v4_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc"])
def test_narrow_key_planes_transposed(preset, transposed, narrow_spy, monkeypatch):
    """3- and 5-bit key word planes gathered [keys, units] or [units, keys] and transposed in registers
    (`paged_decode.KEY_PLANES_T`), on decode (split) and verify batches."""
    monkeypatch.setattr(paged_decode, "KEY_PLANES_T", transposed)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9], [1, 1, 1, 1], seed=13, num_splits=3)
    _check_one_step(preset, 8, 2, 128, [300, 77, 30, 9], [5, 1, 3, 5], seed=14)
    assert len(narrow_spy) == 2


def test_rows32_is_the_int32_element_bound():
    from tqserve.attention.paged import rows32

    assert rows32(torch.empty(2**31 - 1, dtype=torch.uint8, device="meta"))
    assert not rows32(torch.empty(2**31, dtype=torch.uint8, device="meta"))
    assert rows32(torch.empty(2**31 - 1, dtype=torch.bfloat16, device="meta"))  # bf16 pages: element offsets
    assert not rows32(torch.empty(16, device="meta"), torch.empty(2**31, dtype=torch.float16, device="meta"))
