"""Triton paged attention vs the torch reference backend (attention/reference.py).

CPU: tiny shapes under the Triton interpreter (set here when no GPU is present). GPU: real sizes.
Every case draws fresh random inputs, mixes decode / verify / extend requests with sequence lengths
that are not multiples of the block size, and poisons the output with NaN so an unwritten element
fails the test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from paged_cases import backend_step_errors, fill_context, make_meta
from triton_env import DEV, triton_kernels

from tqserve.attention.paged import layout_for_format, paged_attention
from tqserve.attention.reference import KVCacheStore, ReferenceBackend
from tqserve.kvquant.presets import make_layer_format

pytestmark = triton_kernels

TOL = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _check_one_step(preset, hq, hkv, d, ctx, qlens, bs=16, seed=0, num_splits=None, pad=0, q_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    fmt = make_layer_format(preset, 3, hkv, d, torch.bfloat16)
    nblocks = sum((c + q + bs - 1) // bs for c, q in zip(ctx, qlens)) + 4
    meta = make_meta(ctx, qlens, bs, nblocks, DEV, seed=seed, pad_tokens=pad)
    store = KVCacheStore([fmt], nblocks, bs, len(ctx) + 1, len(ctx) + 1, DEV)
    fill_context(store, 0, meta, ctx, gen)
    t = meta.num_tokens + pad
    q = (torch.randn(t, hq, d, generator=gen) * q_scale).to(DEV, torch.bfloat16)
    k = torch.randn(t, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    v = torch.randn(t, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    mine = copy.deepcopy(store)
    ref = ReferenceBackend(store).forward(
        0, q[: meta.num_tokens], k[: meta.num_tokens], v[: meta.num_tokens], meta, d**-0.5
    )
    fmt.write(mine.pages[0], k, v, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k, v, mine.pages[0], layout_for_format(fmt, DEV), meta, d**-0.5,
        ring=mine.ring[0], sinks=mine.sinks[0], out=out, num_splits=num_splits,
    )  # fmt: skip
    assert not out.isnan().any(), "unwritten output elements"
    if pad:
        assert (out[meta.num_tokens :] == 0).all()
    err = _rel(out[: meta.num_tokens], ref)
    assert err <= TOL, f"{preset} hq={hq} hkv={hkv} d={d}: rel err {err:.2e}"


MIXED = ([37, 0, 150], [1, 21, 5])  # decode, extend from scratch, verify 1+4


@pytest.mark.parametrize("fp8_paths", [True, False])
def test_fp8_pages_take_the_narrow_and_extend_kernels(monkeypatch, fp8_paths):
    """fp8 pages: decode / verify steps run the narrow kernel (`paged_decode.FP8_NARROW`) and extend steps the
    extend kernel (`paged_extend.FP8`); with both off, the general kernel. The reference agrees either way."""
    from tqserve.attention import paged_decode, paged_extend
    from tqserve.attention import paged_decode_narrow as narrow

    monkeypatch.setattr(paged_decode, "FP8_NARROW", int(fp8_paths))
    monkeypatch.setattr(paged_extend, "FP8", int(fp8_paths))
    calls = {"narrow": 0, "extend": 0}
    for name, module, attr in (("narrow", narrow, "launch"), ("extend", paged_extend, "extend_attention")):
        real = getattr(module, attr)
        monkeypatch.setattr(
            module, attr, lambda *a, _r=real, _n=name, **k: (calls.__setitem__(_n, calls[_n] + 1), _r(*a, **k))[1]
        )
    _check_one_step("fp8", 8, 2, 128, [37, 70, 1], [1, 5, 1], seed=3)  # decode and verify rows
    _check_one_step("fp8", 8, 2, 128, [0, 90], [40, 33], seed=4)  # extend rows
    assert calls == ({"narrow": 1, "extend": 1} if fp8_paths else {"narrow": 0, "extend": 0})


@pytest.mark.parametrize(
    "preset,hq,hkv,d",
    [
        ("auto", 3, 3, 64),  # GQA 1, odd head count
        ("fp8", 4, 1, 64),  # GQA 4
        ("turboquant_4bit_nc", 7, 1, 64),  # GQA 7 (padded group)
        ("turboquant_3bit_nc", 8, 1, 64),  # GQA 8
        ("turboquant_k8v4", 4, 2, 64),
        ("tq_k8v3_ub_s4_w16", 8, 2, 128),  # fp8 keys, 3-bit codebook values, sink + window
        ("tq_k4v8_nc", 7, 1, 128),  # fp8 values
        ("tq_k4v3_ub_s4_w16", 4, 1, 64),  # rotated values + sink + window
        ("tq_k3v2_nc_s2_w8", 7, 1, 128),
    ],
)
def test_paged_matches_reference(preset, hq, hkv, d):
    _check_one_step(preset, hq, hkv, d, *MIXED, seed=hq * 100 + d)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq_k4v3_ub_s4_w16"])
def test_split_k_matches_reference(preset):
    _check_one_step(preset, 4, 1, 64, [150, 77], [1, 3], num_splits=3, seed=7, pad=2)


def test_head_dim_256():
    _check_one_step("tq_k4v4_s2_w8", 2, 1, 256, [40], [3], seed=3)


def test_backend_two_steps_matches_reference():
    """Store kernel + attention + ring refresh through the backend, prefill then decode/verify."""
    steps = [([0, 0], [45, 20]), ([45, 20], [1, 4])]
    errs = backend_step_errors("tq_k4v3_ub_s4_w16", 4, 2, 64, steps, 11, 5, DEV, nblocks=32)
    assert max(errs) <= TOL, f"rel err per step {errs}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset,hq,hkv,d",
    [
        ("auto", 32, 8, 128),
        ("fp8", 28, 4, 128),
        ("turboquant_4bit_nc", 32, 8, 128),
        ("turboquant_3bit_nc", 56, 8, 128),
        ("turboquant_k8v4", 16, 16, 64),
        ("tq_k4v3_ub_s4_w128", 32, 8, 128),
        ("tq_k3v2_ub_s4_w128", 8, 1, 256),
    ],
)
def test_paged_gpu_real_sizes(preset, hq, hkv, d):
    ctx, ql = [3001, 0, 777, 1500, 64], [1, 300, 5, 1, 130]
    _check_one_step(preset, hq, hkv, d, ctx, ql, seed=1)
    _check_one_step(preset, hq, hkv, d, [9000], [1], seed=2)  # few requests: split-K path


# One step of the GPU engine (SmolLM2 shapes, bf16, prefix-cache test): 16 requests of 1..16 new
# tokens resuming mostly at block boundaries. 64-row programs with 32-key tiles (16 tokens x group
# 3 padded to 4; 5-token verify at GQA 7 or 8) crashed or computed wrong scores with 4 warps.
ENGINE_QL = [1, 8, 14, 10, 5, 15, 2, 16, 11, 10, 7, 7, 4, 16, 12, 3]
ENGINE_CTX = [16, 16, 48, 112, 224, 288, 544, 144, 400, 80, 336, 128, 464, 240, 160, 48]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset,hq,hkv,d,verify",
    [
        ("tq4", 9, 3, 64, False),
        ("tq3", 9, 3, 64, False),
        ("tq4s", 9, 3, 64, False),
        ("tq_k5v3_ub", 9, 3, 64, False),  # 5-bit keys, no exact copies: 32-key tiles too
        ("tq4", 8, 1, 64, False),
        ("tq4", 16, 2, 128, False),
        ("tq3", 28, 4, 128, True),
        ("tq4", 32, 4, 64, True),
    ],
)
def test_wide_rows_short_key_tiles(preset, hq, hkv, d, verify):
    ql = [5] * len(ENGINE_QL) if verify else ENGINE_QL
    _check_one_step(preset, hq, hkv, d, ENGINE_CTX, ql, seed=5)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize(
    "preset",
    ["auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq4", "tq3", "tq_k2v6_nc"],
)
def test_decode_verify_matches_reference(preset, prefetch):
    """Decode / verify shape class only (every request adds at most 16 tokens): several key tiles per
    split, a split that ends inside a tile, with and without the register-prefetched loop."""
    from tqserve.attention import paged

    old = paged.FAST["prefetch"]
    paged.FAST["prefetch"] = prefetch
    try:
        _check_one_step(preset, 8, 2, 64, [300, 77, 150], [1, 5, 1], seed=23, num_splits=2)
    finally:
        paged.FAST["prefetch"] = old


# ---- extend kernel for packed pages (attention/paged_extend.py): paged_attention dispatches every
# step with max_query_len > 16 over a packed layout to it. Batches mix long extend chunks (several
# query blocks, an unmasked bulk of whole key tiles, a diagonal tail), a chunk from scratch, decode
# and verify requests; lengths are not multiples of the block size.
EXTEND_MIXED = ([150, 0, 37, 300], [40, 33, 1, 5])


def _extend_cfg(small: bool):
    from tqserve.attention import paged_extend

    # small: 16 rows x 16 keys (32 on the GPU), so tiny shapes still run many query blocks and key tiles
    return paged_extend.ExtendConfig(16, _small_keys(), 4) if small else None


def _small_keys() -> int:
    """Smallest extend key tile: 16 under the interpreter, `paged_extend.MIN_GPU_BLOCK_N` on the GPU."""
    from tqserve.attention import paged_extend

    return 16 if paged_extend._interpreting() else paged_extend.MIN_GPU_BLOCK_N


def _with_extend_cfg(cfg, fn):
    from tqserve.attention import paged_extend

    old = dict(paged_extend.OVERRIDE)
    if cfg is not None:
        paged_extend.OVERRIDE["extend"] = cfg
    try:
        fn()
    finally:
        paged_extend.OVERRIDE.clear()
        paged_extend.OVERRIDE.update(old)


@pytest.mark.parametrize(
    "preset,hq,hkv,d,small",
    [
        ("turboquant_4bit_nc", 4, 4, 64, False),  # GQA 1
        ("turboquant_3bit_nc", 8, 2, 64, False),  # GQA 4, 3-bit keys and min-max values
        ("turboquant_3bit_nc", 8, 2, 64, True),
        ("tq4", 7, 1, 64, False),  # GQA 7 (padded group), 5-bit keys, rotated 3-bit values, sink 4 + window 32
        ("tq4", 7, 1, 64, True),
        ("tq3", 8, 1, 128, False),  # GQA 8, rotated 2-bit values, sink 4 + window 48
        ("turboquant_k8v4", 4, 1, 64, False),  # fp8 keys + min-max values
        ("tq_k4v3_ub_s4_w16", 4, 2, 256, False),  # d 256
    ],
)
def test_extend_matches_reference(preset, hq, hkv, d, small):
    _with_extend_cfg(_extend_cfg(small), lambda: _check_one_step(preset, hq, hkv, d, *EXTEND_MIXED, seed=hq + d, pad=3))


def test_extend_refuses_16_key_tiles_on_the_gpu(monkeypatch):
    """16-key extend tiles compute wrong 3- / 5-bit scores on sm_90 (`paged_extend.MIN_GPU_BLOCK_N`):
    outside the interpreter such a configuration is a clear error before any launch, not a wrong
    result."""
    from tqserve.attention import paged_extend

    monkeypatch.setattr(paged_extend, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="key tiles of 16 keys"):
        _with_extend_cfg(
            paged_extend.ExtendConfig(16, 16, 4),
            lambda: _check_one_step("turboquant_3bit_nc", 8, 2, 64, [20], [17], seed=1),
        )


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq_k3v2_nc_s2_w8"])
def test_extend_split_k_matches_reference(preset):
    """Split-K over the key range (few long requests): partial results + log-sum-exp, combined."""
    _with_extend_cfg(
        _extend_cfg(True), lambda: _check_one_step(preset, 4, 1, 64, [120, 45], [21, 18], num_splits=3, seed=5, pad=1)
    )


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq4"])
def test_extend_lazy_rescale_matches_reference(preset):
    """Conditional accumulator rescaling (ExtendConfig.lazy) with large scores (queries x 8), so the
    running max keeps growing by more than the threshold from tile to tile."""
    from tqserve.attention import paged_extend

    cfg = paged_extend.ExtendConfig(16, _small_keys(), 4, lazy=True)
    _with_extend_cfg(cfg, lambda: _check_one_step(preset, 4, 1, 64, [140, 30], [37, 20], seed=9, pad=1, q_scale=8.0))


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "tq3"])
def test_extend_no_prefetch_matches_reference(preset):
    """The bulk loop without register double buffering (ExtendConfig.prefetch=False)."""
    from tqserve.attention import paged_extend

    cfg = paged_extend.ExtendConfig(16, _small_keys(), 4, prefetch=False)
    _with_extend_cfg(cfg, lambda: _check_one_step(preset, 8, 2, 64, [130, 17], [40, 25], seed=13, pad=2))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset,hq,hkv,d",
    [
        ("turboquant_4bit_nc", 32, 8, 128),
        ("turboquant_3bit_nc", 32, 8, 128),
        ("turboquant_k8v4", 8, 8, 64),  # GQA 1
        ("tq4", 28, 4, 128),  # GQA 7
        ("tq3", 64, 8, 128),  # GQA 8
        ("tq_k4v3_ub_s4_w128", 32, 8, 128),
        ("tq_k3v2_ub_s4_w128", 16, 2, 256),  # d 256
        ("turboquant_4bit_nc", 8, 2, 64),  # d 64
    ],
)
def test_extend_gpu_real_sizes(preset, hq, hkv, d):
    ctx, ql = [3001, 0, 777, 1500, 64], [700, 300, 5, 129, 1]
    _check_one_step(preset, hq, hkv, d, ctx, ql, seed=1, pad=5)
    _check_one_step(preset, hq, hkv, d, [9000], [2048], seed=2)  # one long chunk over a prefix
    _check_one_step(preset, hq, hkv, d, [20000], [40], seed=3)  # few programs: split-K
