"""Triton paged attention over bf16 / fp8 / TurboQuant pages: one kernel for decode, verify, extend.

One program serves (a block of query tokens) x (all query heads of one KV head) x (one split of
the key range): the rows of its tensor-core tile are (token, head-in-group) pairs, so every page is
read once per KV head (GQA) and decode still uses `tl.dot` (the group is padded to 16 rows).

Packed TurboQuant keys are never expanded to memory: the query is rotated once (y = x R^T), each
score is `norm * <Rq, c[idx]>` with the centroids looked up two at a time from a 4^b-entry table of
fp16 pairs (b <= 4; per element from the 2^b centroids above that), and codebook
values are accumulated in the rotated space and rotated back once at the output. Min-max values
(vLLM's `v = zero + idx * scale`) are accumulated as `(p * scale) @ (idx - h) + sum(p * (zero + h * scale))`,
the fp16 tile `idx - h` built from the index bits without int -> float conversions.

Exact copies (sink + recent window) follow the position rule of `attention/reference.py`: key p is
read exact for query position q iff `p < S` or `q - p < W`; positions of this step come from the
fresh k/v, older window positions from the ring, the first S from the sink buffer. Only key tiles
that can hold an exact key take that branch, so the bulk of a long context reads pages only.

Decode / verify over packed pages double-buffers in registers (`PREFETCH`): the packed words, norms
and scales of the next key tile are loaded while the current one is decoded.

Grids depend on host integers only (`max_query_len`, `max_seq_len`, `num_reqs`): no device sync.

`paged_attention` is the entry point for every step: extend steps over packed pages go to
`paged_extend.py`, decode steps over 2- / 4-bit codebook keys to `paged_decode.py` (sliced operands,
faster there by measurement); this kernel serves the rest.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tqserve.attention.finish import finish_parts
from tqserve.attention.rotate import rotate_rows
from tqserve.attention.tuning import group_pad, pick_config, pick_splits

DENSE, CODEBOOK, MINMAX = 0, 1, 2
LAST_LAUNCH: dict = {}  # the last decode / verify kernel launched (this, sliced or narrow; benchmarks read registers)
# Decoding paths for b <= 4 bits (benchmarks / debugging switch them off to compare with the plain
# index unpack + per-element centroid load + int -> float conversion they replace).
# "prefetch": register double buffering of the packed tiles in decode / verify (tuning.py decides
# where it applies; off here forces the old single-buffered loop).
FAST = {"pairs": True, "ints": True, "f16join": False, "prefetch": True}
# page rows in 32 bits where `rows32` allows (A/B knob)
ROWS32 = 1
# Extra compile options for the attention kernel on the GPU (benchmarks: e.g. {"maxnreg": 168}).
LAUNCH_OPTS: dict = {}
LOG2E = 1.4426950408889634


@dataclass
class PageLayout:
    """How one layer's page tensors are read. Built from a KV format by `layout_for_format`."""

    head_dim: int
    key_mode: int  # DENSE or CODEBOOK
    val_mode: int  # DENSE, CODEBOOK or MINMAX
    key_bits: int = 16
    val_bits: int = 16
    key_scaled: bool = False  # dense keys carry a per-token-head scale (fp8)
    val_scaled: bool = False
    key_name: str = "k"
    key_scale_name: str | None = None  # fp8 scale or TurboQuant norm
    val_name: str = "v"
    val_scale_name: str | None = None  # fp8 scale, TurboQuant norm or min-max scale
    val_zero_name: str | None = None  # min-max zero
    key_codebook: torch.Tensor | None = None  # [2^b] float32 centroids (scaled 1/sqrt(d))
    val_codebook: torch.Tensor | None = None
    key_pairs: torch.Tensor | None = None  # [4^b] int32: fp16 c[p & M] | fp16 c[p >> b] << 16 (b <= 4)
    val_pairs: torch.Tensor | None = None
    key_cb16: torch.Tensor | None = None  # [2^b] fp16 centroids: per-element lookups, no conversion
    val_cb16: torch.Tensor | None = None
    key_rotation: torch.Tensor | None = None  # R [d, d] float32, y = R x
    val_rotation: torch.Tensor | None = None
    sink: int = 0
    window: int = 0

    @property
    def rotated_values(self) -> bool:
        return self.val_mode == CODEBOOK

    @property
    def packed(self) -> bool:
        return self.key_mode != DENSE or self.val_mode != DENSE


def layout_for_format(fmt, device: torch.device | str) -> PageLayout:
    """Map a kvquant format (kvquant/base.py ExactFormat or kvquant/formats.py CodecFormat) to the
    kernel's page layout, with codebooks and rotation matrices moved to `device` once."""
    from tqserve.kvquant.formats import (
        CodecFormat,
        ExactCodec,
        Fp8CastCodec,
        Fp8ScaledCodec,
        MinMaxCodec,
        TurboQuantCodec,
    )
    from tqserve.kvquant.reference import tq_code_table

    d = fmt.head_dim
    lay = PageLayout(head_dim=d, key_mode=DENSE, val_mode=DENSE, sink=fmt.sink, window=fmt.window)
    if not isinstance(fmt, CodecFormat):
        return lay  # ExactFormat: pages "k" / "v"
    rot = fmt.rotation
    mat = rot.matrix.to(device=device, dtype=torch.float32) if rot is not None else None
    for side, codec in (("k", fmt.key_codec), ("v", fmt.value_codec)):
        if isinstance(codec, TurboQuantCodec):
            mode, bits, scaled, names = CODEBOOK, codec.bits, True, (f"{side}_idx", f"{side}_scale", None)
            cb = tq_code_table(codec.bits, d, device).float().contiguous()  # indexed by stored code
        elif isinstance(codec, MinMaxCodec):
            mode, bits, scaled, names = MINMAX, codec.bits, True, (f"{side}_idx", f"{side}_scale", f"{side}_zero")
            cb = None
        elif isinstance(codec, Fp8ScaledCodec):
            mode, bits, scaled, names, cb = DENSE, 8, True, (f"{side}_q", f"{side}_scale", None), None
        elif isinstance(codec, Fp8CastCodec):
            mode, bits, scaled, names, cb = DENSE, 8, False, (f"{side}_q", None, None), None
        elif isinstance(codec, ExactCodec):
            mode, bits, scaled, names, cb = DENSE, 16, False, (f"{side}_x", None, None), None
        else:
            raise NotImplementedError(f"no Triton path for codec {type(codec).__name__}")
        if mode != DENSE and not 1 <= bits <= 8:
            raise NotImplementedError(f"packed bits must be 1..8, got {bits}")
        if side == "k":
            if mode == MINMAX:
                raise NotImplementedError("min-max keys are not supported by the kernel")
            lay.key_mode, lay.key_bits, lay.key_scaled = mode, bits, scaled
            lay.key_name, lay.key_scale_name = names[0], names[1]
            lay.key_codebook, lay.key_rotation = cb, mat if mode == CODEBOOK else None
            lay.key_pairs = pair_table(cb, bits) if mode == CODEBOOK else None
            lay.key_cb16 = cb.half().contiguous() if mode == CODEBOOK else None
        else:
            lay.val_mode, lay.val_bits, lay.val_scaled = mode, bits, scaled
            lay.val_name, lay.val_scale_name, lay.val_zero_name = names
            lay.val_codebook, lay.val_rotation = cb, mat if mode == CODEBOOK else None
            lay.val_pairs = pair_table(cb, bits) if mode == CODEBOOK else None
            lay.val_cb16 = cb.half().contiguous() if mode == CODEBOOK else None
    return lay


def centroid_tables(layout: PageLayout, pairs: bool, model_f32: bool):
    """(key table, value table, pairs) a launcher passes: fp16 pair tables or fp16 centroids for
    bf16 / fp16 models; the float32 centroids (no pair tables) for float32 models, whose attention
    must match the float32 reference to the last bits (fp16 centroids differ by up to 2^-11)."""
    if model_f32:
        return layout.key_codebook, layout.val_codebook, False
    kcb = layout.key_pairs if pairs and layout.key_pairs is not None else layout.key_cb16
    vcb = layout.val_pairs if pairs and layout.val_pairs is not None else layout.val_cb16
    return kcb, vcb, pairs


def pair_table(codebook: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Two fp16 centroids per int32 entry, indexed by two consecutive b-bit indices (first one in the
    low bits): one 4-byte L1 gather decodes two elements, already packed as the MMA operand wants.
    None for b > 4 (a pair of more than 8 bits would not fit a small table)."""
    if bits > 4:
        return None
    n = 1 << bits
    h = codebook.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    p = torch.arange(n * n, device=codebook.device)
    return (h[p % n] | (h[p // n] << 16)).to(torch.int32).contiguous()


@triton.jit
def _load_words(ptr, tok, nmask, BITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):
    """Packed words [BN, DP // 8] of BN tokens' little-endian b-bit index streams: the 8 indices of
    each group of 8 coordinates span exactly BITS bytes (int32 for b <= 4, int64 above; int16 for
    b = 2 until `_widen`). One load per group for 4-bit (32-bit) and 2-bit (16-bit) streams, BITS byte
    loads otherwise."""
    G: tl.constexpr = DP // 8
    NB: tl.constexpr = D * BITS // 8
    g = tl.arange(0, G)
    gm = nmask[:, None] & (g[None, :] < D // 8)
    if BITS == 4:
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + tok[:, None] * (NB // 4) + g[None, :], mask=gm, other=0)
    elif BITS == 2:
        # widened only where decoded (`_widen`), so a prefetched tile is not waited for at the load
        w = tl.load(ptr.to(tl.pointer_type(tl.int16)) + tok[:, None] * (NB // 2) + g[None, :], mask=gm, other=0)
    elif BITS > 4:  # 8 indices of 5..8 bits span more than 32 bits
        base = ptr + tok[:, None] * NB + g[None, :] * BITS
        w = tl.zeros([BN, G], dtype=tl.int64)
        for kb in tl.static_range(BITS):
            w = w | (tl.load(base + kb, mask=gm, other=0).to(tl.int64) << (8 * kb))
    else:
        base = ptr + tok[:, None] * NB + g[None, :] * BITS
        w = tl.zeros([BN, G], dtype=tl.int32)
        for kb in tl.static_range(BITS):
            w = w | (tl.load(base + kb, mask=gm, other=0).to(tl.int32) << (8 * kb))
    return w


@triton.jit
def _widen(w, BITS: tl.constexpr):
    if BITS == 2:
        w = w.to(tl.int32) & 0xFFFF
    return w


@triton.jit
def _tree8(e0, e1, e2, e3, e4, e5, e6, e7, BN: tl.constexpr, DP: tl.constexpr):
    """[BN, DP // 8] tiles of the 8 coordinates of each group -> [BN, DP] in coordinate order; join
    adds a new minor dim, so the outermost join picks bit 0 of the coordinate within the group."""
    x = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(x, (BN, DP))


@triton.jit
def _indices(w, BITS: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr):
    """Indices [BN, DP] (int32) from the packed words of `_load_words` (split with shifts, interleaved
    back with the join tree, which keeps the 8 indices of a group in the same thread)."""
    w = _widen(w, BITS)
    M: tl.constexpr = (1 << BITS) - 1
    i0 = (w & M).to(tl.int32)
    i1 = ((w >> BITS) & M).to(tl.int32)
    i2 = ((w >> (2 * BITS)) & M).to(tl.int32)
    i3 = ((w >> (3 * BITS)) & M).to(tl.int32)
    i4 = ((w >> (4 * BITS)) & M).to(tl.int32)
    i5 = ((w >> (5 * BITS)) & M).to(tl.int32)
    i6 = ((w >> (6 * BITS)) & M).to(tl.int32)
    i7 = ((w >> (7 * BITS)) & M).to(tl.int32)
    return _tree8(i0, i1, i2, i3, i4, i5, i6, i7, BN, DP)


@triton.jit
def _as_f16(x):
    """int32 tile holding fp16 bit patterns in its low 16 bits -> fp16 tile (bit reinterpretation)."""
    return x.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _pairs(w, tbl, BITS: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, F16J: tl.constexpr):
    """Centroids [BN, DP] fp16 of b-bit codebook indices (b <= 4) from their packed words through the
    pair table: one int32 gather per two coordinates, split into the two fp16 halves (no conversion)."""
    w = _widen(w, BITS)
    PM: tl.constexpr = (1 << (2 * BITS)) - 1
    t0 = tl.load(tbl + (w & PM))  # coordinates 0, 1 of the group
    t1 = tl.load(tbl + ((w >> (2 * BITS)) & PM))  # 2, 3
    t2 = tl.load(tbl + ((w >> (4 * BITS)) & PM))  # 4, 5
    t3 = tl.load(tbl + ((w >> (6 * BITS)) & PM))  # 6, 7
    # F16J: halves become fp16 before the join tree (else the tree joins int32, converted at the end)
    if F16J:
        x = _tree8(
            _as_f16(t0), _as_f16(t0 >> 16), _as_f16(t1), _as_f16(t1 >> 16),
            _as_f16(t2), _as_f16(t2 >> 16), _as_f16(t3), _as_f16(t3 >> 16), BN, DP,
        )  # fmt: skip
    else:
        x = _as_f16(_tree8(t0, t0 >> 16, t1, t1 >> 16, t2, t2 >> 16, t3, t3 >> 16, BN, DP))
    return x


@triton.jit
def _ints(w, BITS: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, F16J: tl.constexpr):
    """1024 + idx [BN, DP] fp16 (exact) of b-bit indices (b <= 4) from their packed words, without
    int -> float conversions: the index bits are or-ed into the mantissa of fp16 1024 (0x6400).
    4-bit words make two halves per shift-and-or."""
    w = _widen(w, BITS)
    if BITS == 4:
        t0 = (w & 0x000F000F) | 0x64006400  # coordinates 0, 4
        t1 = ((w >> 4) & 0x000F000F) | 0x64006400  # 1, 5
        t2 = ((w >> 8) & 0x000F000F) | 0x64006400  # 2, 6
        t3 = ((w >> 12) & 0x000F000F) | 0x64006400  # 3, 7
        if F16J:  # coordinate k in the low halves, k + 4 in the high ones
            x = _tree8(
                _as_f16(t0), _as_f16(t1), _as_f16(t2), _as_f16(t3),
                _as_f16(t0 >> 16), _as_f16(t1 >> 16), _as_f16(t2 >> 16), _as_f16(t3 >> 16), BN, DP,
            )  # fmt: skip
        else:
            x = _as_f16(_tree8(t0, t1, t2, t3, t0 >> 16, t1 >> 16, t2 >> 16, t3 >> 16, BN, DP))
    else:
        M: tl.constexpr = (1 << BITS) - 1
        i0 = (w & M) | 0x6400
        i1 = ((w >> BITS) & M) | 0x6400
        i2 = ((w >> (2 * BITS)) & M) | 0x6400
        i3 = ((w >> (3 * BITS)) & M) | 0x6400
        i4 = ((w >> (4 * BITS)) & M) | 0x6400
        i5 = ((w >> (5 * BITS)) & M) | 0x6400
        i6 = ((w >> (6 * BITS)) & M) | 0x6400
        i7 = ((w >> (7 * BITS)) & M) | 0x6400
        if F16J:
            x = _tree8(
                _as_f16(i0), _as_f16(i1), _as_f16(i2), _as_f16(i3), _as_f16(i4), _as_f16(i5), _as_f16(i6), _as_f16(i7),
                BN, DP,
            )  # fmt: skip
        else:
            x = _as_f16(_tree8(i0, i1, i2, i3, i4, i5, i6, i7, BN, DP))
    return x


@triton.jit
def _tile_rows(bt_row_ptr, n, nmask, kvh, HKV: tl.constexpr, BS: tl.constexpr, ROWS32: tl.constexpr = False):
    """Token-head row inside the page tensors of key positions n (through the block table). Key
    positions are never negative: as unsigned numbers, // and % by a power-of-two block size are a
    shift and a mask (signed ones take 2-4 instructions each to round toward zero, and the kernels
    compute them once per layout the tile's rows are used in). ROWS32 (`rows32`): every offset into
    the page tensors fits int32, so rows and addresses skip 64-bit arithmetic."""
    nu = n.to(tl.uint32)
    page = tl.load(bt_row_ptr + (nu // BS).to(tl.int32), mask=nmask, other=0)
    if not ROWS32:
        page = page.to(tl.int64)
    return page * (HKV * BS) + kvh * BS + (nu % BS).to(page.dtype)


def rows32(*tensors: torch.Tensor) -> bool:
    """Whether every element offset into these tensors fits int32 (`_tile_rows`' ROWS32). The kernels read
    a tensor through its own element type or a wider one (packed uint8 pages as int16 / int32 words, fp16
    scalars as int32 pairs), whose offsets are smaller still."""
    return all(t.numel() < 2**31 for t in tensors)


@triton.jit
def _token_scalars(ptr, tokp, nmask):
    """The fp16 per-token scalars (norm, scale, zero) of page rows `tokp` as float32 (0 where masked),
    each read through the 32-bit word that holds it; the word's other half (maybe a row past the
    sequence) is shifted out. A 2-byte load is narrower than the pipeliner's asynchronous copies
    (cp.async moves 4, 8 or 16 bytes), so Triton leaves it a plain load that the key tile waits on: a
    DRAM round trip per tile (H100, Nsight Compute, fourteenth session: the largest stall of the
    decode loop). The word is copied ahead with the packed words; the half is picked by the row's
    parity. The tensor must start on a 4-byte boundary (callers check: `pair_scalars`)."""
    w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + (tokp >> 1), mask=nmask, other=0)  # rows are >= 0
    x = (w >> ((tokp & 1) * 16).to(tl.int32)).to(tl.int16).to(tl.float16, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _load_side(
    p_ptr, s_ptr, z_ptr, tokp, nmask, d, dmask,
    MODE: tl.constexpr, BITS: tl.constexpr, SCALED: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """What a key or value tile reads from the pages, still undecoded: the dense tile or the packed
    words, the per-token scale / norm (zeros if none) and the min-max zero (zeros if none)."""
    if MODE == 0:
        raw = tl.load(p_ptr + tokp[:, None] * D + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
    else:
        raw = _load_words(p_ptr, tokp, nmask, BITS, D, DP, BN)
    if SCALED:
        sc = tl.load(s_ptr + tokp, mask=nmask, other=0.0).to(tl.float32)
    else:
        sc = tl.zeros([BN], dtype=tl.float32)
    if MODE == 2:
        ze = tl.load(z_ptr + tokp, mask=nmask, other=0.0).to(tl.float32)
    else:
        ze = tl.zeros([BN], dtype=tl.float32)
    return raw, sc, ze


@triton.jit(do_not_specialize=["stride_ls"])  # = tokens x heads: one binary for every step size
def _paged_attn_kernel(
    q_ptr,  # [T, Hq, D] queries against page keys (rotated for codebook keys), any float dtype
    qx_ptr,  # [T, Hq, D] unrotated queries against exact keys (== q_ptr when keys are not rotated)
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
    qsl_ptr,
    seqlen_ptr,
    bt_ptr,
    seqslot_ptr,
    sinkslot_ptr,
    out_ptr,  # [(splits,) T, Hq, NPART, D]
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
    NPART: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for float32 models (no TF32 rounding of their attention), else "tf32" (unused)
    PAIRS: tl.constexpr = True,  # codebook tiles through the pair table (else kcb/vcb are the codebooks)
    INTS: tl.constexpr = True,  # min-max tiles as fp16 1024 + idx
    F16J: tl.constexpr = False,  # join decoded halves as fp16 (else as int32)
    PREFETCH: tl.constexpr = False,  # load tile i + 1 into registers while tile i is decoded
    ROWS32: tl.constexpr = False,  # page rows in 32 bits (`rows32`)
):
    BM: tl.constexpr = BLOCK_Q * GP
    HAS_EXACT: tl.constexpr = (SINK > 0) or (WINDOW > 0)
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
    if DOT_F32:  # the CPU interpreter computes bf16 dots wrongly; upcast there only
        dot_t = tl.float32
        pk_t = tl.float32
    else:
        dot_t = kn_ptr.dtype.element_ty
        pk_t = tl.float16  # decoded operands are small: fp16 keeps 3 more mantissa bits than bf16
    qv = tl.load(q_ptr + tok[:, None] * stride_qt + hq[:, None] * D + d[None, :], mask=qmask, other=0.0)
    if KEY_MODE == 0:
        qv = (qv.to(tl.float32) * qk_scale).to(dot_t)
    else:
        qv = (qv.to(tl.float32) * qk_scale).to(pk_t)
    if HAS_EXACT:
        qx = tl.load(qx_ptr + tok[:, None] * stride_qxt + hq[:, None] * D + d[None, :], mask=qmask, other=0.0)
        qx = (qx.to(tl.float32) * qk_scale).to(dot_t)
        seq_slot = tl.load(seqslot_ptr + req).to(tl.int64)
        sink_slot = tl.load(sinkslot_ptr + req).to(tl.int64)

    kv_end = tl.minimum(seq_len, ctx + qb0 + BLOCK_Q)  # keys beyond the block's last query are masked
    q_min = ctx + qb0
    lo = pid_s * split_n
    hi = tl.minimum(kv_end, lo + split_n)

    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DP], dtype=tl.float32)
    accx = tl.zeros([BM, DP], dtype=tl.float32)  # exact values when the page values are rotated

    bt_row = bt_ptr + req * stride_bt
    if PREFETCH:
        # Register double buffering (no software pipeliner: packed words are decoded in registers,
        # a shared-memory stage would only add a round trip): the packed words, norms and scales of
        # tile i + 1 are loaded while tile i is decoded, and the block-table entries one tile
        # further ahead, so no global load latency sits between two tiles.
        n_a = lo + tl.arange(0, BLOCK_N)
        tokp_a = _tile_rows(bt_row, n_a, n_a < hi, kvh, HKV, BS, ROWS32)
        kr_nx, ksc_nx, kze_nx = _load_side(
            kp_ptr, ks_ptr, ks_ptr, tokp_a, n_a < hi, d, dmask, KEY_MODE, KEY_BITS, KEY_SCALED, D, DP, BLOCK_N
        )
        vr_nx, vsc_nx, vze_nx = _load_side(
            vp_ptr, vs_ptr, vz_ptr, tokp_a, n_a < hi, d, dmask, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N
        )
        tokp_nx = _tile_rows(bt_row, n_a + BLOCK_N, n_a + BLOCK_N < hi, kvh, HKV, BS, ROWS32)

    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        if PREFETCH:
            kr, ksc, vr, vsc, vze = kr_nx, ksc_nx, vr_nx, vsc_nx, vze_nx
            n1 = n + BLOCK_N
            kr_nx, ksc_nx, kze_nx = _load_side(
                kp_ptr, ks_ptr, ks_ptr, tokp_nx, n1 < hi, d, dmask, KEY_MODE, KEY_BITS, KEY_SCALED, D, DP, BLOCK_N
            )
            vr_nx, vsc_nx, vze_nx = _load_side(
                vp_ptr, vs_ptr, vz_ptr, tokp_nx, n1 < hi, d, dmask, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N
            )
            tokp_nx = _tile_rows(bt_row, n1 + BLOCK_N, n1 + BLOCK_N < hi, kvh, HKV, BS, ROWS32)
        else:
            tokp = _tile_rows(bt_row, n, nmask, kvh, HKV, BS, ROWS32)
            kr, ksc, kze = _load_side(
                kp_ptr, ks_ptr, ks_ptr, tokp, nmask, d, dmask, KEY_MODE, KEY_BITS, KEY_SCALED, D, DP, BLOCK_N
            )

        # ---- scores against what the page stores
        if KEY_MODE == 0:
            s = tl.dot(qv, tl.trans(kr.to(dot_t)), input_precision=PREC)
            if KEY_SCALED:
                s = s * ksc[None, :]
        else:
            if PAIRS and KEY_BITS <= 4:
                kc = _pairs(kr, kcb_ptr, KEY_BITS, DP, BLOCK_N, F16J)
            else:
                kc = tl.load(kcb_ptr + _indices(kr, KEY_BITS, DP, BLOCK_N))
            s = tl.dot(qv, tl.trans(kc.to(pk_t)), input_precision=PREC)
            s = s * ksc[None, :]

        if HAS_EXACT:
            tile_exact = (n0 < SINK) | (n0 + BLOCK_N - 1 > q_min - WINDOW)
            if tile_exact:
                need, ex = _exact_masks(n, qpos, q_min, SINK, WINDOW)
                kx = _load_exact(
                    kn_ptr, rk_ptr, sk_ptr, n, nmask & need, d, dmask, ctx, q_start, stride_knt,
                    seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
                )  # fmt: skip
                sx = tl.dot(qx, tl.trans(kx.to(dot_t)), input_precision=PREC)
                s = tl.where(ex, sx, s)

        valid = row_ok[:, None] & nmask[None, :] & (n[None, :] <= qpos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if NPART == 2:
            accx = accx * alpha[:, None]
        m_i = m_new

        # ---- values
        if not PREFETCH:
            vr, vsc, vze = _load_side(
                vp_ptr, vs_ptr, vz_ptr, tokp, nmask, d, dmask, VAL_MODE, VAL_BITS, VAL_SCALED, D, DP, BLOCK_N
            )
        pp = p
        if HAS_EXACT:  # noqa: SIM102 (constexpr test, then a runtime one: must stay nested)
            if tile_exact:
                need, ex = _exact_masks(n, qpos, q_min, SINK, WINDOW)
                vx = _load_exact(
                    vn_ptr, rv_ptr, sv_ptr, n, nmask & need, d, dmask, ctx, q_start, stride_vnt,
                    seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
                )  # fmt: skip
                pe = tl.where(ex, p, 0.0)
                if NPART == 2:
                    accx += tl.dot(pe.to(dot_t), vx.to(dot_t), input_precision=PREC)
                else:
                    acc += tl.dot(pe.to(dot_t), vx.to(dot_t), input_precision=PREC)
                pp = tl.where(ex, 0.0, p)
        if VAL_MODE == 0:
            if VAL_SCALED:
                pp = pp * vsc[None, :]
            acc += tl.dot(pp.to(dot_t), vr.to(dot_t), input_precision=PREC)
        elif VAL_MODE == 1:
            if PAIRS and VAL_BITS <= 4:
                vc = _pairs(vr, vcb_ptr, VAL_BITS, DP, BLOCK_N, F16J)
            else:
                vc = tl.load(vcb_ptr + _indices(vr, VAL_BITS, DP, BLOCK_N))
            pp = pp * vsc[None, :]
            acc += tl.dot(pp.to(pk_t), vc.to(pk_t), input_precision=PREC)
        elif INTS and VAL_BITS <= 4:
            # v = zero + h * scale + (idx - h) * scale with the integer h = (2^b - 1) // 2: the tile
            # is built as fp16 1024 + idx from the index bits (no int -> float conversion) and centred
            # by one exact fp16 subtraction of 1024 + h. (Leaving the 1024 in the tile and
            # subtracting 1024 * sum(p * s) afterwards failed on the GPU: 0.6 relative error.)
            HI: tl.constexpr = ((1 << VAL_BITS) - 1) // 2
            vcen = _ints(vr, VAL_BITS, DP, BLOCK_N, F16J) - (1024.0 + HI)
            acc += tl.dot((pp * vsc[None, :]).to(pk_t), vcen.to(pk_t), input_precision=PREC)
            acc += tl.sum(pp * (vze + HI * vsc)[None, :], 1)[:, None]
        else:  # other min-max values
            vidx = _indices(vr, VAL_BITS, DP, BLOCK_N)
            # v = zero + idx * scale = (zero + h * scale) + (idx - h) * scale with h = (2^b - 1) / 2:
            # centred indices avoid cancelling two large terms after the low-precision dot.
            HALF: tl.constexpr = ((1 << VAL_BITS) - 1) * 0.5
            acc += tl.dot((pp * vsc[None, :]).to(pk_t), (vidx.to(tl.float32) - HALF).to(pk_t), input_precision=PREC)
            acc += tl.sum(pp * (vze + HALF * vsc)[None, :], 1)[:, None]

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    hoff = hq[:, None] * (NPART * D) + d[None, :]
    obase = out_ptr + pid_s * stride_os + tok[:, None] * stride_ot + hoff
    tl.store(obase, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
    if NPART == 2:
        tl.store(obase + D, (accx / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
    if SPLIT:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + pid_s * stride_ls + tok * stride_lt + hq, lse, mask=row_ok)


@triton.jit
def _exact_masks(n, qpos, q_min, SINK: tl.constexpr, WINDOW: tl.constexpr):
    """Which keys of a tile any row reads exact (`need`, per key: a sink, or inside the window of the
    block's first query) and which (row, key) pairs read exact (`ex`: the position rule)."""
    need = n < SINK
    ex = n[None, :] < SINK
    if WINDOW > 0:
        need = need | (n > q_min - WINDOW)
        ex = ex | (qpos[:, None] - n[None, :] < WINDOW)
    return need, ex


@triton.jit
def _load_exact(
    new_ptr, ring_ptr, sink_ptr, n, need, d, dmask, ctx, q_start, stride_nt,
    seq_slot, sink_slot, kvh, HKV: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Exact K or V rows [BN, DP] for key positions n: this step's tokens from the fresh tensor,
    older ones from the sink buffer (p < S) or the ring (entry p % W). Unneeded rows load zeros.
    One load through a per-row source pointer (three masked loads summed held three tiles of
    registers and their zero fills: the narrow kernel's exact pass reached 255 registers)."""
    fresh = n >= ctx
    rel = (q_start + n - ctx).to(tl.int64)
    row = new_ptr + rel * stride_nt + kvh * D
    if SINK > 0:
        srow = (sink_slot * HKV + kvh) * SINK + n
        row = tl.where((~fresh) & (n < SINK), sink_ptr + srow * D, row)
    if WINDOW > 0:
        rrow = (seq_slot * HKV + kvh) * WINDOW + n % WINDOW
        row = tl.where((~fresh) & (n >= SINK), ring_ptr + rrow * D, row)
    return tl.load(row[:, None] + d[None, :], mask=need[:, None] & dmask[None, :], other=0.0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SM count (cached: every launcher asks on every step)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """Token dim may be strided (a view into a fused qkv output); heads and dims must be packed."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def paged_attention(
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
    """Attention for every query token of the step, reading pages already holding this step's K/V.

    q [T, Hq, d]; k_new, v_new [T, Hkv, d] (exact, for the window rule). Returns [T, Hq, d] in q's
    dtype. Rows past `meta.num_tokens` (graph padding) are zeroed.
    """
    # ---- extend steps over packed pages: the dedicated many-rows kernel (attention/paged_extend.py)
    if meta.max_query_len > 16:
        from tqserve.attention import paged_extend

        if paged_extend.takes(layout):  # packed or fp8 pages (benchmarks switch it off to time this kernel's path)
            args = (q, k_new, v_new, pages, layout, meta, scale, ring, sinks, out, num_splits)
            return paged_extend.extend_attention(*args)
    # ---- end of the extend branch
    # ---- decode steps over 2- / 4-bit codebook keys: the sliced kernel (attention/paged_decode.py)
    from tqserve.attention import paged_decode

    if paged_decode.eligible(layout, meta.max_query_len, q.shape[-1], q.shape[1] // k_new.shape[1]):
        args = (q, k_new, v_new, pages, layout, meta, scale, ring, sinks, out, num_splits)
        return paged_decode.decode_attention(*args)
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
    cb_bits = layout.key_bits if layout.key_mode == CODEBOOK else 0
    cfg = pick_config(meta.max_query_len, group, d, layout.packed, bool(layout.sink or layout.window), cb_bits)
    n_qblocks = triton.cdiv(max(1, meta.max_query_len), cfg.block_q)
    splits = num_splits or pick_splits(meta.num_reqs, hkv, n_qblocks, meta.max_seq_len, cfg.block_n, _num_sms(dev))
    tiles = triton.cdiv(max(1, meta.max_seq_len), cfg.block_n)
    split_n = triton.cdiv(tiles, splits) * cfg.block_n
    splits = triton.cdiv(tiles * cfg.block_n, split_n)

    qx = q
    # The model's dtype, not the rotated query's (float32 for codebook keys): float32 models get
    # float32 operands and IEEE dots; bf16 / fp16 models fp16 / bf16 operands on tensor cores.
    model_f32 = qx.dtype == torch.float32
    if layout.key_mode == CODEBOOK:
        # y = R x for row vectors (x @ R^T): one launch for all heads of the step (attention/rotate.py)
        q = rotate_rows(q, layout.key_rotation, hadamard=True)  # y = R x; R is a `Rotation`
    npart = 2 if (layout.rotated_values and (layout.sink or layout.window)) else 1
    rotated = layout.rotated_values
    if out is None:
        out = torch.empty_like(qx)
    direct = splits == 1 and not rotated
    if direct:
        part = out
    else:
        part_shape = (splits, T, hq, npart * d) if splits > 1 else (1, T, hq, npart * d)
        part = torch.empty(part_shape, device=dev, dtype=torch.float32)
    lse = torch.empty((splits, T, hq), device=dev, dtype=torch.float32) if splits > 1 else part
    dummy = kp
    ks = pages[layout.key_scale_name] if layout.key_scale_name else dummy
    vs = pages[layout.val_scale_name] if layout.val_scale_name else dummy
    vz = pages[layout.val_zero_name] if layout.val_zero_name else dummy
    ints = FAST["ints"]
    kcb, vcb, pairs = centroid_tables(layout, FAST["pairs"], model_f32)
    kcb = kcb if kcb is not None else dummy
    vcb = vcb if vcb is not None else dummy
    rk, rv = ring if ring is not None else (k_new, v_new)
    sk, sv = sinks if sinks is not None else (k_new, v_new)
    if layout.window and ring is None or layout.sink and sinks is None:
        raise ValueError("layout keeps exact copies but no ring / sink buffers were given")
    stride_os = part.stride(0) if part.dim() == 4 and not direct else 0
    stride_ot = hq * npart * d
    grid = (n_qblocks, meta.num_reqs * hkv, splits)
    LAST_LAUNCH["kernel"] = _paged_attn_kernel[grid](
        q, qx, k_new, v_new, kp, ks, vp, vs, vz, kcb, vcb, rk, rv, sk, sv,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.seq_slots, meta.sink_slots,
        part, lse,
        q.stride(0), qx.stride(0), k_new.stride(0), v_new.stride(0), meta.block_tables.stride(0),
        stride_os, stride_ot, lse.stride(0) if splits > 1 else 0, hq,
        split_n, scale * LOG2E,
        HKV=hkv, G=group, GP=gp, D=d, DP=dp, BS=bs, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
        KEY_MODE=layout.key_mode, KEY_BITS=layout.key_bits, KEY_SCALED=layout.key_scaled,
        VAL_MODE=layout.val_mode, VAL_BITS=layout.val_bits, VAL_SCALED=layout.val_scaled,
        SINK=layout.sink, WINDOW=layout.window, NPART=npart, SPLIT=splits > 1,
        DOT_F32=_interpreting() or model_f32, PREC="ieee" if model_f32 else "tf32",
        PAIRS=pairs, INTS=ints,
        F16J=FAST["f16join"], PREFETCH=cfg.prefetch and FAST["prefetch"],
        ROWS32=bool(ROWS32) and rows32(kp, ks, vp, vs, vz),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({} if _interpreting() else LAUNCH_OPTS),
    )  # fmt: skip
    return finish_parts(part, lse, out, splits, npart, layout, meta, T, hq, d)
