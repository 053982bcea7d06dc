"""Triton extend (chunked-prefill) attention over packed pages: TurboQuant codebook keys / values and
min-max values, with the exact sink + recent-window rule.

`paged.py`'s kernel serves every query shape with one program per (16 query tokens x GQA group); for
packed pages that decodes each key / value tile for only 64 query rows. Extend chunks have many query
tokens per request, so this kernel gives a program up to 256 rows (query tokens x the GQA group of one
KV head) and decodes every key and value tile once per program into fp16 tensor-core operands:

- codebook keys: tile = fp16 `c[idx] * norm` (pair-table gathers, `paged._pairs`), scored against the
  rotated query (y = x R^T) scaled by softmax scale * log2(e); min-max values: tile = fp16
  `(idx - h) * scale + (zero + h * scale)` from the fp16 `1024 + idx` trick (`paged._ints`); codebook
  values: tile = fp16 `c[idx] * norm`, accumulated in the rotated space and rotated back once
  (x = y R) after the kernel, as `paged.py` does. The per-token norms / scales are folded into the
  decoded tile (one multiply per key element) instead of the score / probability tiles (one per
  query row and key).
- exact copies (sink + window, position rule of `attention/reference.py`): a key tile that can hold an
  exact key also loads the exact rows (`paged._load_exact`: fresh k / v, ring, sinks) and scores them
  against the unrotated query; exact values of rotated-value presets are rotated into the accumulator's
  space (x R^T, one small dot per such tile) so one accumulator serves both.
- the key range of a program runs in three loops: the first tile when it can hold sinks, then the bulk
  of the prefix that every row sees in full and no row reads exact (no masks, packed words of the next
  tile loaded while this one is decoded), then the tail near the diagonal (causal mask, window).

Any mix of requests in the batch (query_start_loc / seq_lens / block_tables), split-K over the key
range for few long requests (combined by `finish.finish_parts`), no host sync, grids from host
integers only, no dequantized copy of the cache. Rows whose keys are all masked end with zeros.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tqserve.attention.finish import finish_parts
from tqserve.attention.paged import (
    CODEBOOK,
    DENSE,
    FAST,
    LOG2E,
    PageLayout,
    _as_f16,
    _indices,
    _interpreting,
    _ints,
    _load_exact,
    _load_side,
    _num_sms,
    _pairs,
    _row_major,
    _tile_rows,
    _widen,
    centroid_tables,
)
from tqserve.attention.rotate import rotate_rows
from tqserve.attention.tuning import group_pad, pick_splits

LAST_LAUNCH: dict = {}  # the last compiled extend kernel (benchmarks read registers / spills)
ENABLED = True  # paged.paged_attention dispatches extend steps over packed pages here (benchmarks: A/B)
# ... and over fp8 pages (dense 8-bit keys and values, `fp8` preset: their tiles become fp16 operands here as
# `turboquant_k8v4`'s fp8 keys do); 0: the general kernel (`attention/paged.py`), for A/B timing
FP8 = 1


def takes(layout) -> bool:
    """Whether extend steps over this layout come here: packed pages, or fp8 ones (`FP8`)."""
    fp8 = layout.key_mode == DENSE and layout.key_bits == 8 and layout.val_mode == DENSE and layout.val_bits == 8
    return ENABLED and (layout.packed or bool(FP8) and fp8)


@dataclass(frozen=True)
class ExtendConfig:
    rows: int  # query rows per program (query tokens x padded GQA group)
    block_n: int  # keys per tile
    num_warps: int
    lazy: bool = False  # conditional accumulator rescaling
    prefetch: bool = True  # register double buffering of the bulk loop's packed tiles


# Benchmarks may pin a configuration to compare variants.
OVERRIDE: dict[str, ExtendConfig] = {}
# Smallest key tile compiled for the GPU: with 16-key tiles, triton 3.6 on sm_90 computes wrong
# results for 3- and 5-bit keys at d = 64 (H100, 2026-11-26: relative error 0.1-1.4 against the
# reference for 1, 2, 4 or 8 warps and 16 or 32 rows; 32-key tiles exact). The tuned table never
# picks them; the interpreter (CI's tiny shapes) still runs them.
MIN_GPU_BLOCK_N = 32


def extend_config(group: int, head_dim: int, exact: bool) -> ExtendConfig:
    """Static launch configuration (no autotuning). H200 sweeps of 2026-11-26 (2048-token chunk over
    32K, d 128, GQA 4; docs/benchmarks.md "Extend"): 256 rows x 64 keys on 16 warps beat 128 rows on
    8 warps (4bit_nc 293 vs 241 TFLOP/s, tq4 188 vs 151) although it spills a little at the
    128-register cap: each decoded tile serves twice the rows. Measured in the same run, not yet the
    default (not measured for every preset): without the register prefetch 4bit_nc 299, tq4 218;
    lazy rescaling 4bit_nc 325 but tq4 158. d 256 keeps 64 rows x 32 keys on 8 warps (the
    accumulator is rows x d fp32 in registers)."""
    if "extend" in OVERRIDE:
        return OVERRIDE["extend"]
    dp = triton.next_power_of_2(head_dim)
    if dp >= 256:
        return ExtendConfig(64, 32, 8)
    return ExtendConfig(256, 64, 16)


@triton.jit
def _load_words_t(ptr, tok, nmask, BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):
    """`paged._load_words` transposed: packed words [DP // 8, BN] (group-major). Key tiles are
    decoded in this orientation so the gathers need no layout change and the decoded tile is stored
    for the tensor cores with 8 coordinates (16 bytes) per store."""
    G: tl.constexpr = DP // 8
    NB: tl.constexpr = D * BITS // 8
    g = tl.arange(0, G)
    gm = (g[:, None] < D // 8) & nmask[None, :]
    if BITS == 4:
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + tok[None, :] * (NB // 4) + g[:, None], mask=gm, other=0)
    elif BITS == 2:
        w = tl.load(ptr.to(tl.pointer_type(tl.int16)) + tok[None, :] * (NB // 2) + g[:, None], mask=gm, other=0)
    elif BITS > 4:
        base = ptr + tok[None, :] * NB + g[:, None] * BITS
        w = tl.zeros([G, BN], dtype=tl.int64)
        for kb in tl.static_range(BITS):
            w = w | (tl.load(base + kb, mask=gm, other=0).to(tl.int64) << (8 * kb))
    else:
        base = ptr + tok[None, :] * NB + g[:, None] * BITS
        w = tl.zeros([G, BN], dtype=tl.int32)
        for kb in tl.static_range(BITS):
            w = w | (tl.load(base + kb, mask=gm, other=0).to(tl.int32) << (8 * kb))
    return w


@triton.jit
def _tree8_t(e0, e1, e2, e3, e4, e5, e6, e7, BN: tl.constexpr, DP: tl.constexpr):
    """`paged._tree8` for group-major [DP // 8, BN] tiles -> [BN, DP] in coordinate order."""
    x = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(tl.permute(x, (1, 0, 2, 3, 4)), (BN, DP))


@triton.jit
def _centroids_t(w, tbl, BITS: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, PAIRS: tl.constexpr):
    """fp16 centroids [BN, DP] of codebook indices from group-major words: through the pair table
    (b <= 5: 4^b int32 entries of two fp16 centroids, `paged._pairs`; 4 KB at 5 bits), else one fp16
    codebook gather per coordinate."""
    w = _widen(w, BITS)
    if PAIRS and BITS <= 5:
        PM: tl.constexpr = (1 << (2 * BITS)) - 1
        t0 = tl.load(tbl + (w & PM).to(tl.int32))
        t1 = tl.load(tbl + ((w >> (2 * BITS)) & PM).to(tl.int32))
        t2 = tl.load(tbl + ((w >> (4 * BITS)) & PM).to(tl.int32))
        t3 = tl.load(tbl + ((w >> (6 * BITS)) & PM).to(tl.int32))
        x = _as_f16(_tree8_t(t0, t0 >> 16, t1, t1 >> 16, t2, t2 >> 16, t3, t3 >> 16, BN, DP))
    else:
        M: tl.constexpr = (1 << BITS) - 1
        c0 = tl.load(tbl + (w & M).to(tl.int32))
        c1 = tl.load(tbl + ((w >> BITS) & M).to(tl.int32))
        c2 = tl.load(tbl + ((w >> (2 * BITS)) & M).to(tl.int32))
        c3 = tl.load(tbl + ((w >> (3 * BITS)) & M).to(tl.int32))
        c4 = tl.load(tbl + ((w >> (4 * BITS)) & M).to(tl.int32))
        c5 = tl.load(tbl + ((w >> (5 * BITS)) & M).to(tl.int32))
        c6 = tl.load(tbl + ((w >> (6 * BITS)) & M).to(tl.int32))
        c7 = tl.load(tbl + ((w >> (7 * BITS)) & M).to(tl.int32))
        x = _tree8_t(c0, c1, c2, c3, c4, c5, c6, c7, BN, DP)
    return x


@triton.jit
def _load_keys(kp_ptr, ks_ptr, tokp, nmask, d, dmask, KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr,
               KEY_SCALED: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """Undecoded key tile: dense rows or group-major packed words, and the per-token scale / norm."""
    if KEY_MODE == 0:
        raw = tl.load(kp_ptr + tokp[:, None] * D + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    else:
        raw = _load_words_t(kp_ptr, tokp, nmask, KEY_BITS, D, DP, BN)
    if KEY_SCALED:
        sc = tl.load(ks_ptr + tokp, mask=nmask, other=0.0).to(tl.float32)
    else:
        sc = tl.zeros([BN], dtype=tl.float32)
    return raw, sc


@triton.jit
def _load_kv(
    kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, tokp, nmask, d, dmask,
    KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, KEY_SCALED: tl.constexpr,
    VAL_MODE: tl.constexpr, VAL_BITS: tl.constexpr, VAL_SCALED: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Everything one key tile reads from the pages, undecoded (keys `_load_keys`, values
    `paged._load_side`)."""
    kr, ksc = _load_keys(kp_ptr, ks_ptr, tokp, nmask, d, dmask, KEY_MODE, KEY_BITS, KEY_SCALED, D, DP, BN)
    vr, vsc, vze = _load_side(vp_ptr, vs_ptr, vz_ptr, tokp, nmask, d, dmask, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BN)
    return kr, ksc, vr, vsc, vze


@triton.jit
def _key_tile(kr, ksc, kcb_ptr, KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, KEY_SCALED: tl.constexpr,
              DP: tl.constexpr, BN: tl.constexpr, PAIRS: tl.constexpr, KT: tl.constexpr):  # fmt: skip
    """Key tile [BN, DP] as the score operand: dense pages (scaled: x * scale), or codebook
    `c[idx] * norm` in fp16 (the norm folded into the tile once per key element)."""
    if KEY_MODE == 0:
        if KEY_SCALED:
            k = (kr.to(tl.float32) * ksc[:, None]).to(KT)
        else:
            k = kr.to(KT)
    else:  # kr: group-major words (`_load_words_t`)
        kc = _centroids_t(kr, kcb_ptr, KEY_BITS, DP, BN, PAIRS)
        k = (kc * ksc.to(tl.float16)[:, None]).to(KT)
    return k


@triton.jit
def _val_tile(vr, vsc, vze, vcb_ptr, VAL_MODE: tl.constexpr, VAL_BITS: tl.constexpr, VAL_SCALED: tl.constexpr,
              DP: tl.constexpr, BN: tl.constexpr, PAIRS: tl.constexpr, VT: tl.constexpr):  # fmt: skip
    """Value tile [BN, DP] as the P @ V operand. Min-max: `zero + idx * scale` computed as
    `(idx - h) * scale + (zero + h * scale)` with the centred fp16 index tile built from the index
    bits (exact), one fp16 multiply-add per element. Codebook: `c[idx] * norm` (rotated space)."""
    if VAL_MODE == 0:
        if VAL_SCALED:
            v = (vr.to(tl.float32) * vsc[:, None]).to(VT)
        else:
            v = vr.to(VT)
    elif VAL_MODE == 1:
        if PAIRS and VAL_BITS <= 4:
            vc = _pairs(vr, vcb_ptr, VAL_BITS, DP, BN, False)
        else:
            vc = tl.load(vcb_ptr + _indices(vr, VAL_BITS, DP, BN))
        v = (vc * vsc.to(tl.float16)[:, None]).to(VT)
    elif VAL_BITS <= 4:
        HI: tl.constexpr = ((1 << VAL_BITS) - 1) // 2
        c = _ints(vr, VAL_BITS, DP, BN, False) - (1024.0 + HI)  # exact in fp16
        if VT == tl.float32:  # float32 models: no fp16 rounding of the dequantized values
            v = c.to(tl.float32) * vsc[:, None] + (vze + HI * vsc)[:, None]
        else:
            v = (c * vsc.to(tl.float16)[:, None] + (vze + HI * vsc).to(tl.float16)[:, None]).to(VT)
    else:
        HALF: tl.constexpr = ((1 << VAL_BITS) - 1) * 0.5
        c = _indices(vr, VAL_BITS, DP, BN).to(tl.float32) - HALF
        v = (c * vsc[:, None] + (vze + HALF * vsc)[:, None]).to(VT)
    return v


@triton.jit
def _softmax_pv(acc, m_i, l_i, s, v, VT: tl.constexpr, PREC: tl.constexpr, LAZY: tl.constexpr):
    """Online softmax update with the masked scores s [BM, BN] (log2 domain) and value tile v.
    LAZY: the accumulator is rescaled only when some row's running max grew by more than 8 (a
    factor 256) since the last rescale (FlashAttention-4's conditional rescaling): until then
    p = exp2(s - m_i) <= 256, exact in fp16 and harmless to the fp32 sums; one block-wide max
    per tile instead of rows x d multiplies."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY:
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc += tl.dot(p.to(VT), v, input_precision=PREC)
        return acc, m_i, l_i
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(VT), v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _page_tile(
    acc, m_i, l_i, qv, n0, kr, ksc, vr, vsc, vze, kcb_ptr, vcb_ptr, qpos, kv_hi,
    DP: tl.constexpr, BN: tl.constexpr,
    KEY_MODE: tl.constexpr, KEY_BITS: tl.constexpr, KEY_SCALED: tl.constexpr,
    VAL_MODE: tl.constexpr, VAL_BITS: tl.constexpr, VAL_SCALED: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, PAIRS: tl.constexpr,
    KT: tl.constexpr, VT: tl.constexpr, PREC: tl.constexpr, LAZY: tl.constexpr,
):  # fmt: skip
    """One key tile read from the pages. MASK: causal + key range + the keys a row reads exact
    (p < S or q - p < W; those come from `_exact_tile`)."""
    k = _key_tile(kr, ksc, kcb_ptr, KEY_MODE, KEY_BITS, KEY_SCALED, DP, BN, PAIRS, KT)
    s = tl.dot(qv, tl.trans(k), input_precision=PREC)
    if MASK:
        n = n0 + tl.arange(0, BN)
        ok = (n[None, :] <= qpos[:, None]) & (n < kv_hi)[None, :]
        if SINK > 0:
            ok = ok & (n >= SINK)[None, :]
        if WINDOW > 0:
            ok = ok & (qpos[:, None] - n[None, :] >= WINDOW)
        s = tl.where(ok, s, float("-inf"))
    v = _val_tile(vr, vsc, vze, vcb_ptr, VAL_MODE, VAL_BITS, VAL_SCALED, DP, BN, PAIRS, VT)
    return _softmax_pv(acc, m_i, l_i, s, v, VT, PREC, LAZY)


@triton.jit
def _exact_tile(
    acc, m_i, l_i, qx, rt, n0, n_lo, n_hi, qpos,
    kn_ptr, vn_ptr, rk_ptr, rv_ptr, sk_ptr, sv_ptr, ctx, q_start, stride_knt, stride_vnt,
    seq_slot, sink_slot, kvh,
    HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, ROT_VALUES: tl.constexpr,
    VT: tl.constexpr, XT: tl.constexpr, PREC: tl.constexpr, LAZY: tl.constexpr,
):  # fmt: skip
    """Exact keys n0 .. n0 + BN - 1 within [n_lo, n_hi): sinks (p < S) and window (q - p < W)
    copies (`paged._load_exact`: fresh k / v, ring, sinks), scored against the unrotated query.
    Rotated-value presets rotate the exact values into the accumulator's space (x R^T)."""
    n = n0 + tl.arange(0, BN)
    d = tl.arange(0, DP)
    dmask = d < D
    inr = (n >= n_lo) & (n < n_hi)
    need = inr & (n < SINK)
    ex = (n < SINK)[None, :]
    if WINDOW > 0:
        need = need | inr
        ex = ex | (qpos[:, None] - n[None, :] < WINDOW)
    kx = _load_exact(
        kn_ptr, rk_ptr, sk_ptr, n, need, d, dmask, ctx, q_start, stride_knt,
        seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
    )  # fmt: skip
    s = tl.dot(qx, tl.trans(kx.to(XT)), input_precision=PREC)
    ok = ex & inr[None, :] & (n[None, :] <= qpos[:, None])
    s = tl.where(ok, s, float("-inf"))
    vx = _load_exact(
        vn_ptr, rv_ptr, sv_ptr, n, need, d, dmask, ctx, q_start, stride_vnt,
        seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
    )  # fmt: skip
    if ROT_VALUES:
        v = tl.dot(vx.to(VT), rt, input_precision=PREC).to(VT)  # y = x R^T
    else:
        v = vx.to(VT)
    return _softmax_pv(acc, m_i, l_i, s, v, VT, PREC, LAZY)


@triton.jit(do_not_specialize=["stride_ls"])  # = tokens x heads: one binary for every step size
def _extend_kernel(
    q_ptr,  # [T, Hq, D] queries against page keys: rotated for codebook keys, pre-scaled, key operand dtype
    qx_ptr,  # [T, Hq, D] unrotated queries against exact keys, pre-scaled, model dtype
    kn_ptr,  # [T, Hkv, D] this step's keys (exact)
    vn_ptr,
    kp_ptr,  # key payload [nb, Hkv, BS, D] dense, or [nb, Hkv, BS, D*b/8] uint8 packed
    ks_ptr,  # key scale / norm [nb, Hkv, BS]
    vp_ptr,
    vs_ptr,
    vz_ptr,
    kcb_ptr,  # codebooks [2^b] fp16, or pair tables [4^b] int32 (b <= 4)
    vcb_ptr,
    rk_ptr,  # ring [num_seq_slots, Hkv, W, D]
    rv_ptr,
    sk_ptr,  # sinks [num_sink_slots, Hkv, S, D]
    sv_ptr,
    rot_ptr,  # R^T [D, D] of the value rotation in the value operand dtype (rotated values + exact copies)
    qsl_ptr,
    seqlen_ptr,
    bt_ptr,
    seqslot_ptr,
    sinkslot_ptr,
    out_ptr,  # [(splits,) T, Hq, D]
    lse_ptr,  # [splits, T, Hq] (split mode only)
    stride_qt,
    stride_qxt,
    stride_knt,
    stride_vnt,
    stride_bt,
    stride_os,
    stride_ot,
    stride_ls,
    stride_lt,
    split_n,  # keys per split (multiple of BLOCK_N)
    qk_scale,  # softmax scale * log2(e)
    HKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEY_MODE: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_SCALED: tl.constexpr,
    VAL_MODE: tl.constexpr,
    VAL_BITS: tl.constexpr,
    VAL_SCALED: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for float32 models (no TF32 rounding), else "tf32" (unused by 16-bit dots)
    PAIRS: tl.constexpr = True,
    PREFETCH: tl.constexpr = True,
    LAZY: tl.constexpr = False,  # conditional rescaling of the accumulator (`_softmax_pv`)
):
    BM: tl.constexpr = BLOCK_Q * GP
    HAS_EXACT: tl.constexpr = (SINK > 0) or (WINDOW > 0)
    ROT_VALUES: tl.constexpr = VAL_MODE == 1
    pid_q = tl.program_id(0)
    pid_rh = tl.program_id(1)
    pid_s = tl.program_id(2)
    req = pid_rh // HKV
    kvh = pid_rh % HKV
    q_start = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seqlen_ptr + req)
    qb0 = pid_q * BLOCK_Q
    if qb0 >= qlen:
        return
    ctx = seq_len - qlen  # position of this step's first token

    rows = tl.arange(0, BM)
    qi = rows // GP
    hh = rows % GP
    row_ok = (qb0 + qi < qlen) & (hh < G)
    tok = (q_start + qb0 + qi).to(tl.int64)
    qpos = ctx + qb0 + qi
    hq = kvh * G + hh
    d = tl.arange(0, DP)
    dmask = d < D
    qmask = row_ok[:, None] & dmask[None, :]
    # operand types: decoded packed tiles are fp16 (3 more mantissa bits than bf16, small values);
    # dense pages and exact copies keep the model dtype; the CPU interpreter gets float32 dots.
    if DOT_F32:
        KT = tl.float32
        VT = tl.float32
        XT = tl.float32
    else:
        XT = kn_ptr.dtype.element_ty
        KT = tl.float16
        VT = tl.float16
        if KEY_MODE == 0:
            if not kp_ptr.dtype.element_ty.is_fp8():
                KT = kp_ptr.dtype.element_ty
        if VAL_MODE == 0:
            if not vp_ptr.dtype.element_ty.is_fp8():
                VT = vp_ptr.dtype.element_ty
    # prepared on the host: rotated for codebook keys, scaled by softmax scale * log2(e), in the key
    # operand's dtype, so the tile feeds the tensor cores unchanged (from shared memory)
    qv = tl.load(q_ptr + tok[:, None] * stride_qt + hq[:, None] * D + d[None, :], mask=qmask, other=0.0)
    seq_slot = tl.load(seqslot_ptr + req).to(tl.int64)
    sink_slot = tl.load(sinkslot_ptr + req).to(tl.int64)

    q_min = ctx + qb0  # first row's position; every row sees keys <= q_min
    kv_end = tl.minimum(seq_len, q_min + BLOCK_Q)  # keys beyond the block's last query are masked
    lo = pid_s * split_n
    hi = tl.minimum(kv_end, lo + split_n)
    # bulk [b0, b1): full tiles every row sees, no exact key for any row (p >= S, q - p >= W)
    b0 = lo
    if SINK > 0:
        b0 = tl.maximum(lo, tl.minimum(hi, tl.cdiv(SINK, BLOCK_N) * BLOCK_N))
    b1 = tl.minimum(hi, q_min + 1 - WINDOW)
    b1 = tl.maximum(b0, b0 + (b1 - b0) // BLOCK_N * BLOCK_N)

    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    bt_row = bt_ptr + req * stride_bt

    # ---- head: the first tile when it holds sink keys (read exact below), masked
    for n0 in range(lo, b0, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        kr, ksc, vr, vsc, vze = _load_kv(
            kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, _tile_rows(bt_row, n, n < hi, kvh, HKV, BS), n < hi, d, dmask,
            KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N,
        )  # fmt: skip
        acc, m_i, l_i = _page_tile(
            acc, m_i, l_i, qv, n0, kr, ksc, vr, vsc, vze, kcb_ptr, vcb_ptr, qpos, hi,
            DP, BLOCK_N, KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED,
            SINK, WINDOW, True, PAIRS, KT, VT, PREC, LAZY,
        )  # fmt: skip

    # ---- bulk: no masks, no exact copies; the next tile's packed words are loaded while this one
    # is decoded (register double buffering), block-table entries one tile further ahead
    if PREFETCH:
        n_a = b0 + tl.arange(0, BLOCK_N)
        kr_nx, ksc_nx, vr_nx, vsc_nx, vze_nx = _load_kv(
            kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, _tile_rows(bt_row, n_a, n_a < b1, kvh, HKV, BS), n_a < b1, d,
            dmask, KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N,
        )  # fmt: skip
        tokp_nx = _tile_rows(bt_row, n_a + BLOCK_N, n_a + BLOCK_N < b1, kvh, HKV, BS)
    for n0 in range(b0, b1, BLOCK_N):
        if PREFETCH:
            kr, ksc, vr, vsc, vze = kr_nx, ksc_nx, vr_nx, vsc_nx, vze_nx
            n1 = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            kr_nx, ksc_nx, vr_nx, vsc_nx, vze_nx = _load_kv(
                kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, tokp_nx, n1 < b1, d, dmask,
                KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N,
            )  # fmt: skip
            tokp_nx = _tile_rows(bt_row, n1 + BLOCK_N, n1 + BLOCK_N < b1, kvh, HKV, BS)
        else:
            n = n0 + tl.arange(0, BLOCK_N)
            kr, ksc, vr, vsc, vze = _load_kv(
                kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, _tile_rows(bt_row, n, n < b1, kvh, HKV, BS), n < b1, d, dmask,
                KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N,
            )  # fmt: skip
        acc, m_i, l_i = _page_tile(
            acc, m_i, l_i, qv, n0, kr, ksc, vr, vsc, vze, kcb_ptr, vcb_ptr, qpos, hi,
            DP, BLOCK_N, KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED,
            SINK, WINDOW, False, PAIRS, KT, VT, PREC, LAZY,
        )  # fmt: skip

    # ---- tail: keys near the diagonal (causal mask; window keys are read exact below)
    for n0 in range(b1, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        kr, ksc, vr, vsc, vze = _load_kv(
            kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, _tile_rows(bt_row, n, n < hi, kvh, HKV, BS), n < hi, d, dmask,
            KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N,
        )  # fmt: skip
        acc, m_i, l_i = _page_tile(
            acc, m_i, l_i, qv, n0, kr, ksc, vr, vsc, vze, kcb_ptr, vcb_ptr, qpos, hi,
            DP, BLOCK_N, KEY_MODE, KEY_BITS, KEY_SCALED, VAL_MODE, VAL_BITS, VAL_SCALED,
            SINK, WINDOW, True, PAIRS, KT, VT, PREC, LAZY,
        )  # fmt: skip

    # ---- exact copies: the sink keys of this split, then the window keys near the diagonal
    if HAS_EXACT:
        qx = tl.load(qx_ptr + tok[:, None] * stride_qxt + hq[:, None] * D + d[None, :], mask=qmask, other=0.0)
        if ROT_VALUES:
            rt = tl.load(rot_ptr + d[:, None] * D + d[None, :], mask=dmask[:, None] & dmask[None, :], other=0.0)
        else:
            rt = qx  # unused
        if SINK > 0:
            if lo < SINK:
                acc, m_i, l_i = _exact_tile(
                    acc, m_i, l_i, qx, rt, lo, lo, tl.minimum(hi, SINK), qpos,
                    kn_ptr, vn_ptr, rk_ptr, rv_ptr, sk_ptr, sv_ptr, ctx, q_start, stride_knt, stride_vnt,
                    seq_slot, sink_slot, kvh, HKV, D, DP, BLOCK_N, SINK, WINDOW, ROT_VALUES, VT, XT, PREC, LAZY,
                )  # fmt: skip
        if WINDOW > 0:
            w_lo = tl.maximum(lo, tl.maximum(SINK, q_min + 1 - WINDOW))
            for n0 in range(w_lo, hi, BLOCK_N):
                acc, m_i, l_i = _exact_tile(
                    acc, m_i, l_i, qx, rt, n0, w_lo, hi, qpos,
                    kn_ptr, vn_ptr, rk_ptr, rv_ptr, sk_ptr, sv_ptr, ctx, q_start, stride_knt, stride_vnt,
                    seq_slot, sink_slot, kvh, HKV, D, DP, BLOCK_N, SINK, WINDOW, ROT_VALUES, VT, XT, PREC, LAZY,
                )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    obase = out_ptr + pid_s * stride_os + tok[:, None] * stride_ot + hq[:, None] * D + d[None, :]
    tl.store(obase, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + pid_s * stride_ls + tok * stride_lt + hq, lse, mask=row_ok)


_RT_CACHE: dict = {}  # id(R) -> (weakref to R, {dtype: R^T})


def _rotation_t(rot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """R^T, contiguous, in `dtype`, built once per rotation matrix (a layout's R lives as long as
    its backend) and dtype."""
    ent = _RT_CACHE.get(id(rot))
    if ent is None or ent[0]() is not rot:
        for k in [k for k, (ref, _) in _RT_CACHE.items() if ref() is None]:
            del _RT_CACHE[k]
        ent = _RT_CACHE[id(rot)] = (weakref.ref(rot), {})
    if dtype not in ent[1]:
        ent[1][dtype] = rot.T.contiguous().to(dtype)
    return ent[1][dtype]


_PAIRS_CACHE: dict = {}  # id(codebook) -> (weakref to it, pair table)


def _key_pairs(layout: PageLayout) -> torch.Tensor | None:
    """Pair table of the key codebook: the layout's for b <= 4, built here (once per codebook) for
    5-bit keys (1024 entries), None above."""
    if layout.key_pairs is not None or layout.key_bits != 5 or layout.key_codebook is None:
        return layout.key_pairs
    cb = layout.key_codebook
    ent = _PAIRS_CACHE.get(id(cb))
    if ent is None or ent[0]() is not cb:
        for k in [k for k, (ref, _) in _PAIRS_CACHE.items() if ref() is None]:
            del _PAIRS_CACHE[k]
        h = cb.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        p = torch.arange(1024, device=cb.device)
        ent = _PAIRS_CACHE[id(cb)] = (weakref.ref(cb), (h[p % 32] | (h[p // 32] << 16)).to(torch.int32).contiguous())
    return ent[1]


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pages: dict[str, torch.Tensor],
    layout: PageLayout,
    meta,
    scale: float,
    ring: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as `paged.paged_attention` (which dispatches here for extend steps over packed
    pages): q [T, Hq, d]; k_new, v_new [T, Hkv, d]; returns [T, Hq, d] in q's dtype, rows past
    `meta.num_tokens` zeroed."""
    T, hq, d = q.shape
    hkv = k_new.shape[1]
    group = hq // hkv
    gp = group_pad(group)
    dp = triton.next_power_of_2(d)
    kp = pages[layout.key_name]
    vp = pages[layout.val_name]
    bs = kp.shape[2]
    dev = q.device
    q = _row_major(q)
    k_new = _row_major(k_new)
    v_new = _row_major(v_new)
    exact = bool(layout.sink or layout.window)
    if layout.window and ring is None or layout.sink and sinks is None:
        raise ValueError("layout keeps exact copies but no ring / sink buffers were given")
    cfg = extend_config(group, d, exact)
    if cfg.block_n < MIN_GPU_BLOCK_N and not _interpreting():
        raise ValueError(f"extend key tiles of {cfg.block_n} keys are not supported on the GPU (>= {MIN_GPU_BLOCK_N})")
    block_q = max(1, cfg.rows // gp)
    n_qblocks = triton.cdiv(max(1, meta.max_query_len), block_q)
    splits = num_splits or pick_splits(meta.num_reqs, hkv, n_qblocks, meta.max_seq_len, cfg.block_n, _num_sms(dev))
    tiles = triton.cdiv(max(1, meta.max_seq_len), cfg.block_n)
    split_n = triton.cdiv(tiles, splits) * cfg.block_n
    splits = triton.cdiv(tiles * cfg.block_n, split_n)

    if out is None:
        out = torch.empty_like(q)
    qx = q
    model_f32 = q.dtype == torch.float32
    dot_f32 = _interpreting() or model_f32
    if layout.key_mode == CODEBOOK:
        q = rotate_rows(q, layout.key_rotation, hadamard=True)  # y = R x; R is a `Rotation`
    if dot_f32:
        kt = torch.float32
    elif layout.key_mode == CODEBOOK or kp.element_size() == 1:
        kt = torch.float16  # decoded / fp8 key tiles are fp16 operands
    else:
        kt = kp.dtype
    q = (q.float() * (scale * LOG2E)).to(kt)
    xt = torch.float32 if dot_f32 else qx.dtype
    if exact and (layout.key_mode == CODEBOOK or kt != xt):
        qx = (qx.float() * (scale * LOG2E)).to(xt)
    elif exact:
        qx = q
    rotated = layout.rotated_values
    direct = splits == 1 and not rotated
    if direct:
        part = out
    else:
        part = torch.empty((splits, T, hq, d), device=dev, dtype=torch.float32)
    lse = torch.empty((splits, T, hq), device=dev, dtype=torch.float32) if splits > 1 else part
    dummy = kp
    ks = pages[layout.key_scale_name] if layout.key_scale_name else dummy
    vs = pages[layout.val_scale_name] if layout.val_scale_name else dummy
    vz = pages[layout.val_zero_name] if layout.val_zero_name else dummy
    kcb, vcb, pairs = centroid_tables(layout, FAST["pairs"], model_f32)
    if pairs:
        kpairs = _key_pairs(layout)  # the extend kernel also pairs 5-bit keys
        kcb = kpairs if kpairs is not None else kcb
    kcb = kcb if kcb is not None else dummy
    vcb = vcb if vcb is not None else dummy
    rot = _rotation_t(layout.val_rotation, torch.float32 if dot_f32 else torch.float16) if rotated and exact else dummy
    rk, rv = ring if ring is not None else (k_new, v_new)
    sk, sv = sinks if sinks is not None else (k_new, v_new)
    grid = (n_qblocks, meta.num_reqs * hkv, splits)
    LAST_LAUNCH["kernel"] = _extend_kernel[grid](
        q, qx, k_new, v_new, kp, ks, vp, vs, vz, kcb, vcb, rk, rv, sk, sv, rot,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.seq_slots, meta.sink_slots,
        part, lse,
        q.stride(0), qx.stride(0), k_new.stride(0), v_new.stride(0), meta.block_tables.stride(0),
        part.stride(0) if not direct else 0, hq * d, lse.stride(0) if splits > 1 else 0, hq,
        split_n, scale * LOG2E,
        HKV=hkv, G=group, GP=gp, D=d, DP=dp, BS=bs, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        KEY_MODE=layout.key_mode, KEY_BITS=layout.key_bits, KEY_SCALED=layout.key_scaled,
        VAL_MODE=layout.val_mode, VAL_BITS=layout.val_bits, VAL_SCALED=layout.val_scaled,
        SINK=layout.sink, WINDOW=layout.window, SPLIT=splits > 1,
        DOT_F32=dot_f32, PREC="ieee" if model_f32 else "tf32", PAIRS=pairs,
        PREFETCH=cfg.prefetch and FAST["prefetch"], LAZY=cfg.lazy, num_warps=cfg.num_warps, num_stages=1,
    )  # fmt: skip
    return finish_parts(part, lse, out, splits, 1, layout, meta, T, hq, d)
