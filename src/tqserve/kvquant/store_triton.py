"""Fused store kernels: rotate + quantize + pack + scale + write this step's K/V into page slots.

One launch per layer writes keys and values for every preset (exact, fp8 with / without scale,
TurboQuant codebook, min-max). The torch ground truth is `kvquant/reference.py` through each
format's `write`; tests compare the two on random inputs. Skipped writes (slot < 0) are masked
stores, so the grid depends only on the (padded) token count.

Per side the program holds a tile of BT tokens x head_dim for one KV head.

TurboQuant rotates with the randomized Hadamard transform itself rather than the dense R, in the
reference's fixed point (`reference.tq_rotate`): the row is scaled by the power of two of its
largest |x| and rounded to integers of at most 2^11 (one fma with 1.5 * 2^23), exact in fp16, the
signs flip its columns, and one tensor-core `tl.dot` per column tile of W <= 64 against the +-1
matrix H_W (one per program, shared by the tiles) sums exact integers (every partial sum at most
2^17, so no accumulation order rounds); log2(block / W) butterfly stages across the tiles finish
the block (exact below 2^24), and y = z / sqrt(block * ||xi||^2) takes the reference's IEEE float32
operations. So y, and with it every index, is the
reference's bit for bit, on any card and for any input dtype; the scales' sums are int32 sums of
terms rounded to 2^-21 (`reference.fixed_sum`), then IEEE float32 square root and division.
Quantizing is one table lookup per element (`_tq_lookup`): round(y * CS) picks a cell of a small
table that holds at most one Lloyd-Max boundary per cell, never near a cell edge; the entry gives
the number of boundaries below the cell and the cell's own boundary (one exact compare with y), so
the index is exactly the reference's bucketize count; the centroid follows from the index (on the
GPU by a warp shuffle from a per-lane table, `LANE_LUT`). On the GPU the lookup is inline PTX, so it
stays in the MMA layout of the rotated tile; 2-bit sides count their three boundaries by compares there
instead (`compare_ptx`, the same exact count).
4-bit TurboQuant indices are stored as sign-magnitude codes (`reference.to_codes`, `_codes`: one XOR of
each packed word, or of each index where the words are formed elsewhere); min-max codes are not.
Indices are packed 8 at a time into one b-byte group (one 1-, 2- or 4-byte store for b = 1, 2,
4; for odd b, 4 groups make b 32-bit words). Rotations whose Hadamard blocks don't fit the tiles
(a block of 8, or more than four tiles) use the dense float32 R product instead.

The gain-search encoder (scale modes `nc+search` / `unbiased+search`, presets tq4s / tq3s / `_ncs` /
`_ubs`) runs inside the same launch: for each gain of `reference.SEARCH_GAINS` (a runtime loop) the
rotated tiles are quantized at gain * y with the same table lookup, <y, c> and ||c||^2 are summed
in float32, and each row keeps the gain of the largest cosine (first maximum, as the reference's
argmax); its indices are then formed again and packed, with the mode's scale. Indices match the
reference except where two gains' cosines agree to float rounding (the cosines' summation order
differs; y itself is the reference's).
About 50 quantizations per element: many times slower than the plain encoder (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tqserve.kvquant.base import ExactFormat
from tqserve.kvquant.reference import FIX_BIAS, FIX_MIN_EXP, SCALE_QS, SIGN_MAGNITUDE_BITS

# codec kinds understood by the kernel
EXACT, TQ, MINMAX, FP8_SCALED, FP8_CAST, TQ_DENSE = 0, 1, 2, 3, 4, 5
SCALE_MODES = {"plain": 0, "nc": 1, "unbiased": 2}
FP8_MAX = 448.0
FP16_MAX = 65504.0
WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}
# TurboQuant sides of 2- or 4-bit codes in one Hadamard block: the rotation's output columns permuted so
# that each thread packs whole half groups of 4 codes in registers (`_half_cols`, `_pack_tile` GS = -1)
HALF_GROUPS = 1
# Scaled centroids by a warp shuffle from a lane table (`lane_table_ptx`) instead of a second load
# (H100, twenty-fourth session, 16K tokens, ms without / with: 4bit_nc 0.0524 / 0.0514, 3bit_nc 0.0537 /
# 0.0531, k3v4_nc 0.0547 / 0.0540, tq3 0.0650 / 0.0643, tq4 0.0836 / 0.0808, tq_k4v4_nc 0.0698 / 0.0686).
# Not for two 4-bit unbiased sides: there the 16 x 2 launch takes 128 registers instead of 80 (8
# programs per SM instead of 12) and tq_k4v4_ub ran 3% slower (0.0659 / 0.0679; capped at 80 or 96 it
# spills); LANE_LUT_TWO_4BIT_UB = 1 keeps the table there too
LANE_LUT = 1
LANE_LUT_TWO_4BIT_UB = 0
# 2-bit sides (three boundaries) count the boundaries below y from the sign bits of three subtractions
# (`compare_ptx`: 7 instructions per element with the centroid's shuffle), where the cell lookup takes an fma,
# a clamp, an address (two instructions), an 8-byte load and a compare. sm_90: tq3 2,304 -> 2,248 instructions,
# 96 -> 80 registers. H100, twenty-sixth session, store_bench --flush --slots pages, 16K tokens, % of copy
# (off / on, two rounds): tq3 42.2 / 45.1, 41.8 / 45.0
CMP_2BIT = 1
# The Hadamard tiles' signs applied to K / V as they are loaded (`_load_signed`: an XOR of the sign bit)
# instead of a float32 multiply per element of the fixed-point tile (`_rot_tile`), for one TurboQuant side
# in the 16 x 2 launch (`signs_at_load`; 2: every tiled side). sm_90 instructions per program (off -> on):
# 4bit_nc 2,032 -> 1,984, 3bit_nc 2,072 -> 2,032, tq3 2,400 -> 2,272 (but 96 -> 128 registers), tq4 2,848 ->
# 2,776, tq_k4v4_ub 2,488 -> 2,352 (80 -> 96 registers). H100, twenty-fifth session, store_bench --flush
# --slots pages, 16K tokens, two rounds, % of copy (off / on): 4bit_nc 55.4 / 56.7 and 54.9 / 56.7; slower
# elsewhere: 3bit_nc 50.5 / 46.7, tq3 42.0 / 39.9, tq_k4v4_ub 42.5 / 42.1, k3v4_nc 51.0 / 50.7, tq4 alike.
SIGNS_AT_LOAD = 1
# Elsewhere the signs flip the fixed-point tile's fp16 copy, the dot's operand, by an XOR of its sign bits
# (`_rot_tile`, SIGNS = 2: two columns per 32-bit instruction where the float32 multiply took a conversion
# of the sign and a multiply per element); 0: the multiply. sm_90: 96-104 instructions fewer for tq3, tq4,
# tq_k4v4_* (tq_k4v4_ub 80 -> 96 registers). H100, twenty-sixth session, same bench, points of copy gained:
# tq4 +0.5 to +0.9, tq_k4v4_ub +0.5 to +0.9, tq_k4v4_nc +0.1 to +0.6, tq3 -0.5 to +0.1
SIGN_XOR = 1
# nc sides of 3- or 4-bit codes (their boundaries' cells span under 32): the cell's boundary and base by two
# warp shuffles from lane tables (`_tq_lookup_lanes`), and the element's rounded ||c||^2 term by a third at
# the index found, instead of an 8-byte load at a 64-bit address, the scaled centroid's shuffle, an fma and a
# subtraction per element. 1: by `cell_lanes`' rule (both sides TurboQuant, or 4bit_nc's split launch), 2: every
# such side, 0: none. H200, thirty-seventh session, store 16K, us 1 / 8 layers, loads -> lanes (two calls):
# 4bit_nc 43.36 -> 42.02 / 39.68 -> 38.27 and 43.46 -> 42.11 / 39.56 -> 38.17 (the split key programs wait on
# memory most: ncu's long-scoreboard stalls lead); still slower for the 8 x 1 launches: 3bit_nc 45.95 -> 46.14 /
# 41.32 -> 41.67, k3v4_nc 45.95 -> 46.05 / 41.17 -> 41.38. Before the split (thirty-second session), sm_90
# instructions per program (off -> on): 4bit_nc 1,984 -> 1,888, 3bit_nc 2,040 -> 1,976, tq_k4v4_nc 2,376 ->
# 2,192 (126 -> 96 registers). H200, thirty-second session, `store_bench.py --flush --slots pages`, 16K
# tokens, two rounds, ms off / on: tq_k4v4_nc 0.0670 / 0.0658 and 0.0671 / 0.0659; slower with one TurboQuant
# side: 4bit_nc 0.0472 / 0.0476 (both rounds), 3bit_nc 0.0510 / 0.0519, k3v4_nc 0.0516 / 0.0528 (the
# store is not bound by issued instructions there).
CELL_LANES = 1
# nc sides of 3- or 4-bit codes without the lanes above: the lane table the index is shuffled from holds the
# element's rounded ||c||^2 term itself (`lane_table_ptx` of `nc_terms`), not the scaled centroid, so the
# term needs no fma and no subtraction per element (`_tq_tile_out`, LANES = -1)
TERM_LUT = 1
# Min-max codes by a saturating add (`_sat_index`): per element a multiply, an add.sat and an fma rounded toward
# zero, then one integer min, where `_floor_index` takes two float clamps (ALU instructions, the store's busier
# pipe), the add and the floor. Scaled by 2^-b, the add's saturation to [0, 1] is the clamp at 0, and
# floor(2^b v) <= 2^b only needs the min at the top. Exact: a power of two commutes with each rounding.
SAT_INDEX = 1
# The lookups' compare y > p as the sign bit of p - y (an FMA-pipe subtraction and a shift) instead of a
# compare and a select (two ALU instructions): IEEE subtraction without flush to zero is negative exactly
# where y > p; p is never -0 (`_cell_table` stores +0, which compares the same), +inf where a cell holds
# no boundary (+inf - y > 0). 0: the compare (read when the module loads: the PTX strings are built then)
CMP_SIGN = 1
# Keys and values stored by separate programs of the one launch (grid axis 2 picks the side; CUDA starts the
# programs of axis 2 = 0, the keys, first) instead of one program storing its tokens' keys, then their values:
# 1 by `split_sides`' rule, 0 never, 2 every launch. A program then holds one side's registers: 4bit_nc's key
# side builds at 64 without spills (16 programs per SM instead of 12; unsplit, it spills at 64). H200, thirty-fifth
# session, `benchmarks/store_ab.py`, 16K tokens, 1 / 8 layers, us, unsplit -> split:
#   4bit_nc (cap 64)   46.69 -> 45.66, 42.56 -> 42.10 (cap 80: 47.84, 44.10; cap 56: 48.83, 45.34)
#   tq3                57.34 -> 55.49, 53.15 -> 51.19
#   tq_k4v4_nc         62.94 -> 60.45, 58.58 -> 56.14
#   tq4                76.96 -> 75.26, 72.99 -> 70.84
# and slower for the one-side 3-bit launches (8 x 1): k3v4_nc 48.54 -> 49.98, 44.26 -> 46.12 (16 x 2 x 64: 59.68,
# 56.26), 3bit_nc 48.64 -> 50.66, 44.21 -> 46.65. Key and value programs interleaved (even / odd program ids)
# were slower than keys first: 4bit_nc at 64 registers 47.30 / 45.54, at 80 48.99 / 47.84. Value programs of two
# key programs' tiles (both tiles' rows loaded first) spill at 64 registers: 4bit_nc 45.54 -> 65.70, 41.93 -> 62.32.
SPLIT_SIDES = 1
# Split launches' program order: 1 every key program before the first value program, 2 values first, 3 interleaved.
# H200, thirty-sixth session, store 16K, us 1 / 8 layers, 1 / 2 / 3: 4bit_nc 44.16 / 45.44 / 44.86, 40.27 / 40.06 /
# 40.45; tq3 55.46 / 55.39 / 55.87, 50.74 / 50.79 / 51.33; tq4 74.91 / 74.75 / 82.91; tq_k4v4_nc all within 0.3%
SPLIT_ORDER = 1
# (Value programs of two token tiles in `_minmax_rows`' layout, both tiles' rows loaded first, spilled at the
# 64-register cap too: H200, thirty-sixth session, 4bit_nc 1 / 2 tiles 43.71 / 52.00 us, 8 layers 39.80 / 48.17.)
# K / V rows loaded where t < T rather than where the slot is >= 0, so the row loads do not wait for the slot
# mapping's load (two dependent memory round trips per program otherwise)
LOAD_BY_TOKEN = 1
# (An L2 prefetch, at each program's start, of the rows of the program 8, 16 or 24 x 132 launch slots later - about
# one wave - was slower everywhere: H200, thirty-seventh session, store 16K, us 1 / 8 layers, off -> 8 / 16 / 24:
# 4bit_nc 42.05 -> 44.86 / 44.93 / 44.67, 38.36 -> 41.24 / 41.18 / 40.83; tq3 54.91 -> 56.26 / 57.44 / 58.18;
# 3bit_nc 46.27 -> 47.46 / 48.58 / 49.92. Removed.)
# Min-max sides in `_minmax_rows`' layout (one row per thread group of 4, the min / max reduced in registers but for
# two shuffle stages, in bf16x2 / f16x2) instead of `_minmax_tile`'s: 1 in the tuned launches (a TurboQuant key side,
# d <= 128: 4bit_nc, k3v4_nc, 3bit_nc), 2 every such side (`minmax_rows`), 0 never. MINMAX_ROWS_CONTIG: a thread's
# columns contiguous (one store of its words; 3-bit codes only so) rather than each load instruction's. H200,
# thirty-sixth session, store 16K, us 1 / 8 layers, `_minmax_tile` -> rows (-> contiguous): 4bit_nc 45.18 -> 44.29
# (44.16) / 41.46 -> 40.53 (40.24); k3v4_nc 48.58 -> 46.30 (46.27) / 44.11 -> 41.29 (41.40); 3bit_nc 48.45 -> 46.24 /
# 44.03 -> 41.52 (contiguous); slower for k8v4 (fp8 keys, not tuned): 30.18 -> 31.58 (30.18) / 25.34 -> 26.16 (25.67)
MINMAX_ROWS = 1
MINMAX_ROWS_CONTIG = 1
# Half-group 16-bit code words (`HALF_GROUPS`, 4-bit codes) and their side's scales stored by inline PTX from the
# MMA-derived layout they are in (`_st_where`; `_pack_tile`'s GS = -2) instead of `tl.store`'s trip through shared
# memory: 1 where every TurboQuant side of the plan is such a side (`asm_store`), 2 every such side, 0 never. H200,
# thirty-sixth session, store 16K, us 1 / 8 layers, tl.store -> inline PTX for every side (words of any width):
# 4bit_nc 43.46 -> 43.23 / 39.68 -> 39.52, tq_k4v4_nc 59.42 -> 58.21 / 55.27 -> 53.92, tq4 72.38 -> 72.03 / 68.21
# -> 67.68; slower with byte words (tq3 54.30 -> 57.06 / 50.11 -> 52.37) and for the scales of 3-bit sides (3bit_nc
# 46.24 -> 46.69, k3v4_nc 46.11 -> 46.43). With 16-bit words only, tq3's 4-bit keys still lost (54.30 -> 55.36 /
# 50.18 -> 51.32; 4bit_nc 43.23 -> 43.07 / 39.68 -> 39.60, tq_k4v4_nc 59.62 -> 58.37 / 55.28 -> 54.01), hence the rule
ASM_STORE = 1
# The register cap of 4bit_nc-like launches (one TurboQuant side in the 16 x 2 launch) when the sides split
SPLIT_ONE_SIDE_MAXNREG = 64
_CMP_PTX = (
    "sub.rn.f32 d, pb, $2;\nmov.b32 m, d;\nshr.u32 m, m, 31;\nadd.s32 $0, bs, m;\n"
    if CMP_SIGN
    else "set.gt.u32.f32 m, $2, pb;\nsub.s32 $0, bs, m;\n"
)
# `_tq_lookup`'s PTX: the cell entry's count of boundaries below y, then the centroid at that index.
# Operands: $0 index, $1 centroid, $2 y, $3 a, $4 b (t = a * b + 1.5 * 2^23 picks the cell), $5 the bits
# of 1.5 * 2^23 less HALFC, $6 NCELL - 1, $7 the cell table, $8 the centroid column (a load) or the
# lane's table entry (a shuffle, `LANE_LUT`: the scaled centroid, or with `TERM_LUT` the nc term)
_CELL_PTX = (
    """
.reg .f32 t, pb, d;
.reg .b32 c, m, bs;
.reg .b64 ad;
fma.rn.f32 t, $3, $4, 0f4B400000;
mov.b32 c, t;
sub.s32 c, c, $5;
min.u32 c, c, $6;
mad.wide.u32 ad, c, 8, $7;
ld.global.nc.v2.b32 {pb, bs}, [ad];
"""
    + _CMP_PTX
)
_LOOKUP_LOAD = tl.constexpr("{" + _CELL_PTX + "mad.wide.s32 ad, $0, 4, $8;\nld.global.nc.b32 $1, [ad];\n}")
_LOOKUP_SHFL = tl.constexpr("{" + _CELL_PTX + "shfl.sync.idx.b32 $1, $8, $0, 0x1f, 0xffffffff;\n}")
# `_tq_lookup_lanes`' PTX: $0 index, $1 the index's ||c||^2 term (int32); $2 y, $3 a, $4 b, $5 the bits of
# 1.5 * 2^23 less HALFC plus the first lane's cell, $6 the last lane in use; $7 / $8 / $9 this lane's
# entries of the boundary, base and term tables
_CELL_LANES_PTX = tl.constexpr(
    """{
.reg .f32 t, pb, d;
.reg .b32 c, m, bs;
fma.rn.f32 t, $3, $4, 0f4B400000;
mov.b32 c, t;
sub.s32 c, c, $5;
min.s32 c, c, $6;
max.s32 c, c, 0;
shfl.sync.idx.b32 pb, $7, c, 0x1f, 0xffffffff;
shfl.sync.idx.b32 bs, $8, c, 0x1f, 0xffffffff;
"""
    + _CMP_PTX
    + """shfl.sync.idx.b32 $1, $9, $0, 0x1f, 0xffffffff;
}"""
)
# this lane's entry of a 32-entry int32 table at $1
_LANE_LOAD_PTX = tl.constexpr("""{
.reg .u32 l;
.reg .u64 ad;
mov.u32 l, %laneid;
mad.wide.u32 ad, l, 4, $1;
ld.global.nc.b32 $0, [ad];
}""")
# `reference.fixed_point`'s constants
_FIX_BIAS = tl.constexpr(FIX_BIAS)
_FIX_MIN_EXP = tl.constexpr(FIX_MIN_EXP)
_QS = tl.constexpr(2.0**SCALE_QS)
_RQS = tl.constexpr(2.0**-SCALE_QS)
# 1.5 * 2^23: adding it rounds a float32 below 2^22 in magnitude to an integer (half to even), which
# then sits in the low mantissa bits: bits(t) - _RND_BITS is that integer
_RND = tl.constexpr(12582912.0)
_RND_BITS = tl.constexpr(0x4B400000)
_RNDQ_BITS = tl.constexpr(0x4B400000 + (SCALE_QS << 23))  # bits of 1.5 * 2^(23 + SCALE_QS)
# TurboQuant table lookups through inline PTX on the GPU (`_tq_lookup`); the interpreter runs no PTX
_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
assert SIGN_MAGNITUDE_BITS == (4,), "the store's code words (`_word_codes`) are written for 4-bit codes"
_SM_BITS = tl.constexpr(4)


@triton.jit
def _fp16_round(x):
    """What the reference's `_fp16` stores, back in float32 (clamped to the fp16 range)."""
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16).to(tl.float32)


@triton.jit
def _mul_rn(a, b):
    """a * b rounded by itself: the compiler may not fuse it with a following add into an fma (the
    reference rounds both)."""
    if _ASM:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _rcp_rn(x):
    """1 / x correctly rounded (IEEE, as torch divides), without div.rn's numerator scaling."""
    if _ASM:
        return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _floor_index(u, LEVELS: tl.constexpr):
    """floor(u) clamped to [0, LEVELS] (u float32, an integer tensor out). Clamping first gives the
    same integer; on the GPU the floor is an add of 2^23 rounded toward zero, which leaves it in the
    low mantissa bits (a full-rate add where a float-to-int conversion runs at a quarter of the rate)."""
    u = tl.minimum(tl.maximum(u, 0.0), LEVELS * 1.0)
    if _ASM:
        t = tl.inline_asm_elementwise(
            "add.rz.f32 $0, $1, 0f4B000000;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1
        )
        return t.to(tl.int32, bitcast=True) - 0x4B000000
    else:
        return tl.floor(u).to(tl.int32)


_SAT_PTX = tl.constexpr("""{
.reg .f32 m, v;
mul.rn.f32 m, $1, $2;
add.rn.sat.f32 v, m, $3;
fma.rz.f32 $0, v, $4, 0f4B000000;
}""")


@triton.jit
def _sat_index(x, invs, offs, BITS: tl.constexpr):
    """min(floor(2^b * sat(x * invs + offs)), 2^b - 1) (float32, each step rounded once; invs, offs:
    [rows, 1] columns of inv and off times 2^-b), an int32 tensor: `_floor_index`'s index of u = x * inv + off."""
    z = tl.zeros_like(x)
    t = tl.inline_asm_elementwise(
        _SAT_PTX, "=r,r,r,r,r", [x, z + invs, z + offs, z + (1 << BITS) * 1.0], dtype=tl.float32, is_pure=True, pack=1
    )
    return tl.minimum(t.to(tl.int32, bitcast=True) - 0x4B000000, (1 << BITS) - 1)


@triton.jit
def _group_bits(gk, K: tl.constexpr, WD: tl.constexpr, BITS: tl.constexpr):
    """The bits of group K (stream bits [8 * BITS * K, 8 * BITS * (K + 1))) that fall in 32-bit word
    WD, shifted into place (0 where none do)."""
    SH: tl.constexpr = 8 * BITS * K - 32 * WD
    if SH >= 32 or SH <= -8 * BITS:
        return tl.zeros_like(gk)
    elif SH >= 0:
        return gk << SH
    else:
        return gk >> (-SH)


@triton.jit
def _half_cols(k, GS: tl.constexpr):
    """The coordinate each column of a 32-column tile holds: k itself, or with GS = -1 (`HALF_GROUPS`)
    column k = 16 w + 8 t + 2 c + e holds coordinate 4 (4 t + c) + 2 w + e. In the tensor cores'
    accumulator layout of the [16, 32] tile over two warps (sm_90, Triton 3.6: warp t takes the n8
    tiles 8 t and 16 + 8 t) a thread holds columns 16 w + 8 t + 2 c + e (lane % 4 = c) of its rows,
    so the 4 coordinates of a half group are one thread's, and `_pack_tile` packs them without the
    cross-lane sums that gather 8 consecutive columns from 4 lanes. GS = -8: over one warp (the launch
    of 3-bit sides) a thread holds columns 8 n + 2 c + e of its row, and column 8 n + 2 c + e holds
    coordinate 8 c + 2 n + e: a whole group of 8 codes (3 bytes of the stream) per thread."""
    if GS == -1 or GS == -2:
        return ((k // 8) % 2) * 16 + ((k // 2) % 4) * 4 + (k // 16) * 2 + k % 2
    elif GS == -8:
        return ((k // 2) % 4) * 8 + (k // 8) * 2 + k % 2
    else:
        return k


@triton.jit
def _st_where(ptr, val, mask):
    """tl.store(ptr, val, mask=mask) of 8-, 16- or 32-bit values as inline PTX, in val's own layout: `tl.store` moves
    the values of an MMA-derived layout to a coalescing one through shared memory first (a store, a barrier, a
    load and a barrier per call), where each thread's own few words can go out directly."""
    if val.dtype.primitive_bitwidth == 8:  # st.b8 stores the low byte of a 16-bit register
        tl.inline_asm_elementwise(
            "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b8 [$1], $2;\nmov.b32 $0, 0;\n}",
            "=r,l,h,r", [ptr, val.to(tl.int16), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif val.dtype.primitive_bitwidth == 16:
        tl.inline_asm_elementwise(
            "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b16 [$1], $2;\nmov.b32 $0, 0;\n}",
            "=r,l,h,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.static_assert(val.dtype.primitive_bitwidth == 32)
        tl.inline_asm_elementwise(
            "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b32 [$1], $2;\nmov.b32 $0, 0;\n}",
            "=r,l,r,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _codes(idx, BITS: tl.constexpr):
    """Sorted b-bit indices -> sign-magnitude codes (`reference.to_codes`): i >= h stays, i < h -> h - 1 - i."""
    H: tl.constexpr = 1 << (BITS - 1)
    return idx ^ ((H - 1) - (H - 1) * (idx >> (BITS - 1)))


@triton.jit
def _word_codes(w, ONES: tl.constexpr):
    """`_codes` of the 4-bit indices packed in w (int32; ONES: bit 0 of each of its nibbles): nibbles whose
    bit 3 is clear get bits 0-2 flipped."""
    return w ^ ((((w ^ -1) >> 3) & ONES) * 7)


@triton.jit
def _pack_tile(
    pay_ptr,
    tokp,
    tok_ok,
    idx,
    col0,
    BITS: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    W: tl.constexpr,
    GS: tl.constexpr,
    CODES: tl.constexpr = False,
):
    """Write indices [BT, W] of columns col0.. as the little-endian b-bit stream; columns >= D are
    not written. CODES: sorted TurboQuant indices, stored as their codes (`_codes`).

    GS = 0: 8 indices make one b-byte word, one store (b in 1, 2, 4; pay_ptr an int8 / int16 /
    int32 view of the page). GS = 8, 16, 32: GS indices make b words of GS bits (pay_ptr viewed
    as int8 / int16 / int32); word w is the sum of the indices overlapping stream bits
    [GS*w, GS*w + GS), each shifted into place (shift amounts are compile-time per column).
    GS = -1 (`HALF_GROUPS`): the tile's columns are in `_half_cols` order, so the 4 indices of each
    half group (coordinates 4 h .. 4 h + 3) are columns (t, e) of one (w, c); they are packed where
    they are, in registers, into one 4b-bit word each (b in 2, 4; pay_ptr an int8 / int16 view).
    GS = -2: GS = -1 stored by inline PTX from the layout the words are in (`asm_store`, 16-bit words).
    GS = -8: the columns in `_half_cols`' one-warp order, so each thread holds a whole group of 8
    codes (coordinates 8 h .. 8 h + 7); its b bytes are stored one by one (pay_ptr an int8 view)."""
    WORDS: tl.constexpr = (GS < 0 and GS != -8) or GS == 0  # these paths remap whole words instead
    if CODES and BITS == _SM_BITS and not WORDS:
        idx = _codes(idx, BITS)
    if GS == -8:
        i4 = tl.permute(tl.reshape(idx, (BT, W // 8, 4, 2)), (0, 2, 1, 3))  # [.., c, n, e]
        gv = tl.sum(tl.reshape(i4, (BT, W // 8, 8)) << (tl.arange(0, 8) * BITS)[None, None, :], 2)
        g = col0 // 8 + tl.arange(0, W // 8)
        m = tok_ok[:, None] & (g[None, :] < D // 8)
        base = pay_ptr + tokp[:, None] * (D * BITS // 8) + g[None, :] * BITS
        for b in tl.static_range(BITS):
            tl.store(base + b, ((gv >> (8 * b)) & 0xFF).to(pay_ptr.dtype.element_ty), mask=m)
    elif GS < 0:
        i5 = tl.permute(tl.reshape(idx, (BT, 2, 2, 4, 2)), (0, 2, 3, 1, 4))  # [.., t, c, w, e]
        i3 = tl.reshape(i5, (BT, W // 4, 4))
        w = tl.sum(i3 << (tl.arange(0, 4) * BITS)[None, None, :], 2)
        if CODES and BITS == _SM_BITS:
            w = _word_codes(w, 0x1111)
        g = col0 // 4 + tl.arange(0, W // 4)
        m = tok_ok[:, None] & (g[None, :] < D // 4)
        wp = pay_ptr + tokp[:, None] * (D // 4) + g[None, :]
        if GS == -2 and _ASM:  # `asm_store`
            _st_where(wp, w.to(pay_ptr.dtype.element_ty), m)
        else:
            tl.store(wp, w.to(pay_ptr.dtype.element_ty), mask=m)
    elif GS == 0:
        G: tl.constexpr = W // 8
        g = col0 // 8 + tl.arange(0, G)
        i3 = tl.reshape(idx, (BT, G, 8))
        w = tl.sum(i3 << (tl.arange(0, 8) * BITS)[None, None, :], 2)
        if CODES and BITS == _SM_BITS:
            w = _word_codes(w, 0x11111111)
        m = tok_ok[:, None] & (g[None, :] < D // 8)
        tl.store(pay_ptr + tokp[:, None] * (D // 8) + g[None, :], w.to(pay_ptr.dtype.element_ty), mask=m)
    elif GS == 32:
        # 8 indices -> one 8b-bit group (int64 when 8b > 32), 4 groups -> b words (the groups'
        # bit ranges [8bk, 8bk + 8b) cut at word edges 32w): 1-2 ops per index instead of b
        NW: tl.constexpr = W // 32
        g = col0 // 32 + tl.arange(0, NW)
        m = tok_ok[:, None] & (g[None, :] < D // 32)
        base = pay_ptr + tokp[:, None] * (D * BITS // 32) + g[None, :] * BITS
        i4 = tl.reshape(idx, (BT, NW, 4, 8))
        if 8 * BITS > 32:
            i4 = i4.to(tl.int64)
        gv = tl.sum(i4 << (tl.arange(0, 8) * BITS)[None, None, None, :], 3)
        ev, od = tl.split(tl.reshape(gv, (BT, NW, 2, 2)))
        g0, g2 = tl.split(ev)
        g1, g3 = tl.split(od)
        for w in tl.static_range(BITS):
            word = _group_bits(g0, 0, w, BITS) | _group_bits(g1, 1, w, BITS)
            word = word | _group_bits(g2, 2, w, BITS) | _group_bits(g3, 3, w, BITS)
            tl.store(base + w, word.to(tl.int32).to(pay_ptr.dtype.element_ty), mask=m)
    else:
        NG: tl.constexpr = W // GS
        i3 = tl.reshape(idx, (BT, NG, GS))
        j = tl.arange(0, GS)
        g = col0 // GS + tl.arange(0, NG)
        m = tok_ok[:, None] & (g[None, :] < D // GS)
        base = pay_ptr + tokp[:, None] * (D * BITS // GS) + g[None, :] * BITS
        for w in tl.static_range(BITS):
            sh = j * BITS - GS * w
            lsh = tl.minimum(tl.maximum(sh, 0), 31)[None, None, :]
            rsh = tl.minimum(tl.maximum(-sh, 0), 31)[None, None, :]
            part = tl.where((sh >= 0)[None, None, :], i3 << lsh, i3 >> rsh)
            part = tl.where(((sh > -BITS) & (sh < GS))[None, None, :], part, 0)
            tl.store(base + w, tl.sum(part, 2).to(pay_ptr.dtype.element_ty), mask=m)


@triton.jit
def _tq_lookup(
    y, a, b, tab_ptr, NCELL: tl.constexpr, HALFC: tl.constexpr, SCALED: tl.constexpr, LUT: tl.constexpr,
    CMP: tl.constexpr,
):  # fmt: skip
    """(#{boundaries < y}, its centroid) per element of rotated coordinates y, by one table lookup.

    a * b is y * CS (cells per unit of y) to within a few float ulps (z * (f * CS) will do): its
    nearest integer picks a table cell (t = a * b + 1.5 * 2^23, one fma, holds it in its low
    mantissa bits). `_cell_table` puts at most one boundary p in each cell and none within 5% of
    a cell edge, so the rounding of a * b never changes the count; the count itself is exact in
    y: the cells below y's hold `base` boundaries, and y > p adds the cell's own. A cell entry is
    two int32 (bits of p, +inf where the cell has none; base); the centroids' float32 bits follow
    the NCELL entries and are read at the index found. A second, dependent load, but a warp's
    gathers touch half the cache lines of 16-byte entries that also held c[base] and c[base + 1]
    (H100: turboquant_4bit_nc store 0.0588 -> 0.0495 ms, tq_k4v4_ub 0.0801 -> 0.0688).
    SCALED picks the centroid column read: 0 the centroids, L (their count) the centroids times
    2^SCALE_QS that `_tq_scale_terms` takes.
    |y| <= 1.01 stays inside the table; the unsigned clamp keeps NaN or out-of-range rows in it.

    On the GPU the lookup is one inline-PTX block (an 8-byte load per element, its address by one
    wide multiply-add, then the centroid's 4 bytes), an elementwise op in whatever layout y has: a
    `tl.load` gather made Triton move 64-bit pointer tensors from the MMA layout to a blocked one
    through shared memory and the results back. The interpreter, which runs no PTX, takes the same
    steps in Triton.

    LUT (GPU, the scaled centroids only): `lane_table_ptx`'s lane table, from which the centroid is
    taken by a warp shuffle instead of the second load (with `TERM_LUT` the table holds nc terms instead,
    and the second value returned is their int32 bits). CMP (GPU, with LUT): `compare_ptx`'s block, which
    counts the boundaries below y by compares instead of the cell table."""
    b = tl.zeros_like(y) + b  # a column or a scalar: the asm takes whole tiles
    if _ASM:
        z32 = tl.zeros(y.shape, dtype=tl.int32)
        c5 = z32 + (0x4B400000 - HALFC)
        c6 = z32 + (NCELL - 1)
        cells = z32.to(tl.int64) + tab_ptr.to(tl.int64)
        if LUT != "":
            # the lane's table entry: one pure op of constant operands in every element and call (computed once)
            tb = tl.inline_asm_elementwise(LUT, "=r,r", [z32], dtype=tl.int32, is_pure=True, pack=1)
        if LUT != "" and CMP != "":
            idx, cv = tl.inline_asm_elementwise(
                CMP, "=r,=r,r,r", [y, tb], dtype=(tl.int32, tl.float32), is_pure=True, pack=1
            )
        elif LUT != "":
            idx, cv = tl.inline_asm_elementwise(
                _LOOKUP_SHFL, "=r,=r,r,r,r,r,r,l,r", [y, a, b, c5, c6, cells, tb],
                dtype=(tl.int32, tl.float32), is_pure=True, pack=1,
            )  # fmt: skip
        else:
            cents = z32.to(tl.int64) + (tab_ptr + 2 * NCELL + SCALED).to(tl.int64)
            idx, cv = tl.inline_asm_elementwise(
                _LOOKUP_LOAD, "=r,=r,r,r,r,r,r,l,l", [y, a, b, c5, c6, cells, cents],
                dtype=(tl.int32, tl.float32), is_pure=True, pack=1,
            )  # fmt: skip
    else:
        t = a * b + 12582912.0
        cell = (t.to(tl.int32, bitcast=True) - (0x4B400000 - HALFC)).to(tl.uint32, bitcast=True)
        cell = tl.minimum(cell, NCELL - 1).to(tl.int32) * 2
        up = y > tl.load(tab_ptr + cell).to(tl.float32, bitcast=True)
        idx = tl.load(tab_ptr + cell + 1) + up.to(tl.int32)
        cv = tl.load(tab_ptr + 2 * NCELL + SCALED + idx).to(tl.float32, bitcast=True)
    return idx, cv


@triton.jit
def _lane_entry(z32, ptr):
    """This lane's entry of the 32-entry table at ptr, in every element of z32's shape (one pure op of
    uniform operands: computed once per thread)."""
    p = z32.to(tl.int64) + ptr.to(tl.int64)
    return tl.inline_asm_elementwise(_LANE_LOAD_PTX, "=r,l", [p], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _tq_lookup_lanes(y, a, b, tab_ptr, NCELL: tl.constexpr, HALFC: tl.constexpr, L: tl.constexpr, LANES: tl.constexpr):
    """(#{boundaries < y}, round(c^2 * 2^SCALE_QS) of that index's centroid c) per element: `_tq_lookup`'s
    cell (a * b picks it, the same fma), clamped to the cells [lo, hi] around the boundaries (LANES =
    `lane_cells`), whose boundary and base come from lane tables by two warp shuffles, and the term by a
    third (`_cell_table`'s lane tables; hi - lo and the centroid count L below 32). No load in the
    element's chain, no address arithmetic, and the nc scale's term (`_tq_scale_terms`, exact in int32)
    without the centroid, an fma or a subtraction."""
    LO: tl.constexpr = (LANES - 1) // 64
    SPAN: tl.constexpr = (LANES - 1) % 64
    T0: tl.constexpr = 2 * NCELL + 2 * L
    b = tl.zeros_like(y) + b
    if _ASM:
        z32 = tl.zeros(y.shape, dtype=tl.int32)
        c5 = z32 + (0x4B400000 - HALFC + LO)
        c6 = z32 + SPAN
        lp = _lane_entry(z32, tab_ptr + T0)
        lb = _lane_entry(z32, tab_ptr + T0 + 32)
        lt = _lane_entry(z32, tab_ptr + T0 + 64)
        idx, term = tl.inline_asm_elementwise(
            _CELL_LANES_PTX, "=r,=r,r,r,r,r,r,r,r,r", [y, a, b, c5, c6, lp, lb, lt],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        t = a * b + 12582912.0
        cell = t.to(tl.int32, bitcast=True) - (0x4B400000 - HALFC + LO)
        cell = tl.maximum(tl.minimum(cell, SPAN), 0)
        up = y > tl.load(tab_ptr + T0 + cell).to(tl.float32, bitcast=True)
        idx = tl.load(tab_ptr + T0 + 32 + cell) + up.to(tl.int32)
        term = tl.load(tab_ptr + T0 + 64 + idx)
    return idx, term


@triton.jit
def _tq_tile_out(
    z, f, fc, col0, pay_ptr, tokp, tok_ok, tab_ptr,
    BITS: tl.constexpr, SCALE_MODE: tl.constexpr, GS: tl.constexpr, NCELL: tl.constexpr, HALFC: tl.constexpr,
    D: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, LUT: tl.constexpr, CMP: tl.constexpr,
    LANES: tl.constexpr,
):  # fmt: skip
    """Quantize and pack the rotated unit-vector coordinates y = z * f [BT, W] (z: the exact integer
    Hadamard sums, float32; f, fc = f * CS: [BT, 1] columns); return the elements' int32 terms of the
    scale's sum (`_tq_scale_terms`; LANES > 0, nc only: from `_tq_lookup_lanes`; LANES = -1, nc only: the
    lane table's terms, `TERM_LUT`)."""
    y = z * f
    if LANES > 0:
        idx, part = _tq_lookup_lanes(y, z, fc, tab_ptr, NCELL, HALFC, 1 << BITS, LANES)
    elif LANES == -1 and _ASM:  # `TERM_LUT`: the shuffled lane entry is the nc term's int32 bits
        idx, tq = _tq_lookup(y, z, fc, tab_ptr, NCELL, HALFC, 1 << BITS, LUT, CMP)
        part = tq.to(tl.int32, bitcast=True)
    else:
        idx, cq = _tq_lookup(y, z, fc, tab_ptr, NCELL, HALFC, 1 << BITS, LUT, CMP)
        part = _tq_scale_terms(y, cq, SCALE_MODE)
    _pack_tile(pay_ptr, tokp, tok_ok, idx, col0, BITS, D, BT, W, GS, True)
    return part


@triton.jit
def _tq_scale_terms(y, cq, SCALE_MODE: tl.constexpr):
    """The elements' terms of ||c||^2 (nc) or <y, c> (unbiased) as `reference.fixed_sum` rounds them:
    round(term * 2^SCALE_QS), int32 (0: plain), from cq = c * 2^SCALE_QS (the table's scaled centroid
    column, exact). One fma forms the exact product plus 1.5 * 2^23 (nc: times 2^SCALE_QS, so the
    rounding falls on the same multiple) and rounds once; int32 sums of the terms are exact, so the
    tile order does not show."""
    if SCALE_MODE == 0:
        part = tl.zeros(y.shape, dtype=tl.int32)
    elif SCALE_MODE == 1:
        t = tl.fma(cq, cq, tl.full(y.shape, _RND * _QS, tl.float32))
        part = t.to(tl.int32, bitcast=True) - _RNDQ_BITS
    else:
        t = tl.fma(y, cq, tl.full(y.shape, _RND, tl.float32))
        part = t.to(tl.int32, bitcast=True) - _RND_BITS
    return part


@triton.jit
def _tq_gain_stats(y, g, gc, tab_ptr, NCELL: tl.constexpr, HALFC: tl.constexpr):
    """The elements' terms of <y, c> and ||c||^2 over this tile for c = c[nearest-centroid indices
    of g * y] (the gain-search candidate of gain g; gc = g * CS)."""
    _, cv = _tq_lookup(y * g, y, gc, tab_ptr, NCELL, HALFC, 0, "", "")
    return y * cv, cv * cv


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _row_sums2(a, b):
    """Row sums of two [BT, W] tensors in one reduction (one cross-warp exchange for both). The
    interpreter runs a custom combine function once per element in Python (100x the time of the
    search tests), so there it takes two plain sums: same float32 sums, summation order aside."""
    if _ASM:
        return tl.reduce((a, b), 1, _add2)
    else:
        return tl.sum(a, 1), tl.sum(b, 1)


@triton.jit
def _tq_pack_gain(y, g, gc, col0, pay_ptr, tokp, tok_ok, tab_ptr,
                  BITS: tl.constexpr, SCALE_MODE: tl.constexpr, GS: tl.constexpr,
                  NCELL: tl.constexpr, HALFC: tl.constexpr,
                  D: tl.constexpr, BT: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """Pack the indices of g * y (g, gc = g * CS: the rows' chosen gain, [BT, 1]); return the
    elements' int32 terms of the scale's sum over those indices (`_tq_scale_terms`)."""
    idx, cq = _tq_lookup(y * g, y, gc, tab_ptr, NCELL, HALFC, 1 << BITS, "", "")
    _pack_tile(pay_ptr, tokp, tok_ok, idx, col0, BITS, D, BT, W, GS, True)
    return _tq_scale_terms(y, cq, SCALE_MODE)


@triton.jit
def _tq_scale_store(n, a, sc_ptr, tokp, tok_ok, SCALE_MODE: tl.constexpr, ASM: tl.constexpr = False):
    """The stored fp16 scale of a TurboQuant row: n (plain), n / ||c|| (nc, a = ||c||^2) or n / <y, c>
    (unbiased, a = <y, c>), a float32; IEEE square root and division, as torch computes the reference
    (Triton's `/` and `tl.sqrt` are approximate)."""
    if SCALE_MODE == 0:
        sc = n
    elif SCALE_MODE == 1:
        sc = tl.math.div_rn(n, tl.maximum(tl.sqrt_rn(a), 1e-30))
    else:
        sc = tl.math.div_rn(n, tl.maximum(a, 1e-30))
    sc16 = tl.minimum(tl.maximum(sc, -65504.0), 65504.0).to(tl.float16)
    if ASM and _ASM:  # from the layout the scale is in (threads holding the same row store the same bits)
        _st_where((sc_ptr + tokp).to(tl.pointer_type(tl.int16)), sc16.to(tl.int16, bitcast=True), tok_ok)
    else:
        tl.store(sc_ptr + tokp, sc16, mask=tok_ok)


@triton.jit
def _tq_pick(dot, cc, g, best_cos, best_g):
    """Keep gain g where its cosine <y, c> / ||c|| beats the best so far (strictly: the first
    maximum wins, as the reference's argmax)."""
    cos = dot / tl.maximum(tl.sqrt(cc), 1e-30)
    up = cos > best_cos
    return tl.where(up, cos, best_cos), tl.where(up, g, best_g)


@triton.jit
def _unit_factor(n2, B: tl.constexpr):
    """1 / sqrt(B * n2) with IEEE float32 operations (0 for all-zero rows): y = float32(z) times this
    is the reference's R x / ||x|| on a Hadamard block of size B (B * n2 is exact, B a power of 2)."""
    f = _rcp_rn(tl.sqrt_rn(n2 * B))
    return tl.where(n2 > 0, f, 0.0)


@triton.jit
def _dense_y(xf, n2f, rot_ptr, c0, d, dmask, D: tl.constexpr, C: tl.constexpr):
    """y [BT, C] of columns c0.. on the dense path: z = xi @ S^T (S at rot_ptr, D x D, +-1 / 0: exact
    integer sums in float32), then per column j y = z * (1 / sqrt(b_j * n2)) with b_j the size of j's
    Hadamard block (float32 at rot_ptr + D * D), the reference's IEEE operations."""
    j = c0 + tl.arange(0, C)
    jm = j < D
    st = tl.load(rot_ptr + j[None, :] * D + d[:, None], mask=dmask[:, None] & jm[None, :], other=0.0)
    z = tl.dot(xf, st, input_precision="ieee")
    b = tl.load(rot_ptr + D * D + j, mask=jm, other=1.0)
    den = tl.sqrt_rn(n2f[:, None] * b[None, :])
    f = tl.math.div_rn(tl.full(den.shape, 1.0, tl.float32), den)
    return z * tl.where(n2f[:, None] > 0, f, 0.0)


@triton.jit
def _load_tile(x_ptr, xrow, row_ok, col0, W: tl.constexpr):
    """x[:, col0:col0 + W] in the input dtype (rows where row_ok is false: 0)."""
    c = col0 + tl.arange(0, W)
    return tl.load(x_ptr + xrow[:, None] + c[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _load_signed(x_ptr, xrow, row_ok, col0, sign_ptr, W: tl.constexpr, SIGNED: tl.constexpr):
    """`_load_tile`, with SIGNED the rotation's signs (fp16 +-1 at sign_ptr, by column) applied at once:
    16-bit inputs by an XOR of the sign bit, two columns per instruction, float32 ones by a multiply
    (exact either way). The fixed point and its rounding are symmetric, so signing before them gives
    the integers that flipping after them gives (`_rot_tile` then skips its multiply)."""
    x = _load_tile(x_ptr, xrow, row_ok, col0, W)
    if SIGNED:
        s = tl.load(sign_ptr + col0 + tl.arange(0, W))
        if x.dtype.primitive_bitwidth == 16:
            bit = (s.to(tl.int16, bitcast=True) >> 15) << 15  # 0 or 0x8000
            x = (x.to(tl.int16, bitcast=True) ^ bit[None, :]).to(x.dtype, bitcast=True)
        else:
            x = x * s.to(x.dtype)[None, :]
    return x


@triton.jit
def _absmax(x):
    """The rows' largest |x| (exact in the input dtype), float32."""
    return tl.max(tl.abs(x), 1).to(tl.float32)


@triton.jit
def _fixed_scale(amax):
    """(p = 2^k, 1 / p) per row from the float32 exponent field e of its largest |x|: k = FIX_BIAS - 127
    - e puts |x| * p below 2^FIX_BITS (`reference.fixed_point`); rows with e < FIX_MIN_EXP get 0, 0
    (all-zero rows)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    live = e >= _FIX_MIN_EXP
    p = tl.where(live, ((-e + _FIX_BIAS) << 23).to(tl.float32, bitcast=True), 0.0)
    rp = tl.where(live, ((e - (_FIX_BIAS - 254)) << 23).to(tl.float32, bitcast=True), 0.0)
    return p, rp


@triton.jit
def _fixed_point(x, p):
    """xi = x * p rounded half to even, as float32 and as int32: x * p is exact wherever it matters
    (p a power of two) and below 2^11, so adding 1.5 * 2^23 rounds it (one fma) and leaves the integer
    in the low mantissa bits; no conversion instruction on the way. xi^2 <= 2^22 and a row's sum of
    them <= 2^30: exact in int32."""
    t = tl.fma(x.to(tl.float32), p[:, None], tl.full(x.shape, _RND, tl.float32))
    return t - _RND, t.to(tl.int32, bitcast=True) - _RND_BITS


@triton.jit
def _rot_tile(xi, had_ptr, hw, col0, W: tl.constexpr, HS: tl.constexpr, NSPLIT: tl.constexpr, SIGNS: tl.constexpr = 0):
    """z = xi @ (diag(s) H_W) for the integer tile xi [BT, W] (float32, |xi| <= 2^11) at column col0,
    exact: the signs flip xi's columns, and xi and the +-1 of H are exact in fp16, so the tensor-core
    dot sums W <= 64 exact products into a float32 accumulator: every partial sum is an integer of
    at most 2^17, so no order or accumulator width can round it. had_ptr holds the unsigned H_HS
    (fp16, HS x HS), then the head's signs; hw is H_HS, loaded once per program for the tiles of width
    HS (a narrower tile takes the top-left W x W of H_HS, which is H_W in Sylvester order). One matrix
    for all tiles instead of one sign-folded matrix per tile: H100, 4bit_nc 0.0665 -> 0.0609 ms. SIGNS: 0
    multiplies xi by the signs, 1 takes xi with its signs already (`_load_signed`), 2 flips the sign bits
    of xi's fp16 copy (`SIGN_XOR`; exact: xi is an integer below 2^11, so the copy is xi itself)."""
    r = tl.arange(0, W)
    if W == HS:
        hm = hw
    else:
        hm = tl.load(had_ptr + r[:, None] * HS + r[None, :])
    if SIGNS == 0:
        xi = xi * tl.load(had_ptr + HS * HS + col0 + r).to(tl.float32)[None, :]
    xh = xi.to(tl.float16)
    if SIGNS == 2:
        bit = tl.load(had_ptr + HS * HS + col0 + r).to(tl.int16, bitcast=True) & -32768  # 0x8000 where s = -1
        xh = (xh.to(tl.int16, bitcast=True) ^ bit[None, :]).to(tl.float16, bitcast=True)
    if NSPLIT == 0:
        # the CPU interpreter: a float32 dot of the same integers (exact there too)
        z = tl.dot(xh.to(tl.float32), hm.to(tl.float32), input_precision="ieee")
    else:
        z = tl.dot(xh, hm)
    return z


@triton.jit
def _tq_side(
    x_ptr, xrow, ld_ok, tok_ok, tokp, pay_ptr, sc_ptr, tab_ptr, had_ptr, gain_ptr,
    BITS: tl.constexpr, SCALE_MODE: tl.constexpr, GS: tl.constexpr,
    NCELL: tl.constexpr, HALFC: tl.constexpr, CS: tl.constexpr, LUT: tl.constexpr, CMP: tl.constexpr,
    LANES: tl.constexpr,
    SEARCH: tl.constexpr, NGAIN: tl.constexpr,
    NSPLIT: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, G0: tl.constexpr,
    NT: tl.constexpr, O1: tl.constexpr, W1: tl.constexpr, O2: tl.constexpr, W2: tl.constexpr,
    O3: tl.constexpr, W3: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, SIGNS: tl.constexpr,
):  # fmt: skip
    """TurboQuant side by Hadamard tiles: the first block is G0 tiles of width W (G0 in 1, 2, 4,
    joined by butterflies), then up to NT - G0 more blocks of one tile each (offset Oi, width Wi);
    Bi is block i's size. In the reference's fixed point (`reference.tq_rotate`): the row's tiles
    are loaded, scaled by the power of two of its largest |x| and rounded to integers xi, whose
    Hadamard sums z are exact (`_rot_tile`, float32 butterflies of integers); n2 = ||xi||^2 (int32).
    Rotated coordinates are y = float32(z) * (1 / sqrt(Bi * n2)), quantized by `_tq_lookup`: the
    same float32 operations as the reference, so the same bits.

    SEARCH: the gain-search encoder. For each of the NGAIN gains at gain_ptr (1 first) the rows'
    <y, c> and ||c||^2 of the candidate indices (nearest centroids of gain * y) are summed over the
    tiles; each row keeps the gain of the largest cosine (first maximum wins), and its indices are
    formed again from gain * y (the same float32 product, so the same indices) and packed."""
    # same-width tiles are combined elementwise before one row reduction (reductions cross warps)
    sgn = had_ptr + W * W  # the head's signs, after H_W
    x0 = _load_signed(x_ptr, xrow, ld_ok, 0, sgn, W, SIGNS == 1)
    m = tl.abs(x0)
    if G0 > 1:
        x1 = _load_signed(x_ptr, xrow, ld_ok, W, sgn, W, SIGNS == 1)
        m = tl.maximum(m, tl.abs(x1))
    if G0 > 2:
        x2 = _load_signed(x_ptr, xrow, ld_ok, 2 * W, sgn, W, SIGNS == 1)
        x3 = _load_signed(x_ptr, xrow, ld_ok, 3 * W, sgn, W, SIGNS == 1)
        m = tl.maximum(m, tl.maximum(tl.abs(x2), tl.abs(x3)))
    amax = tl.max(m, 1).to(tl.float32)
    if NT > G0:
        xt1 = _load_signed(x_ptr, xrow, ld_ok, O1, sgn, W1, SIGNS == 1)
        amax = tl.maximum(amax, _absmax(xt1))
    if NT > G0 + 1:
        xt2 = _load_signed(x_ptr, xrow, ld_ok, O2, sgn, W2, SIGNS == 1)
        amax = tl.maximum(amax, _absmax(xt2))
    if NT > G0 + 2:
        xt3 = _load_signed(x_ptr, xrow, ld_ok, O3, sgn, W3, SIGNS == 1)
        amax = tl.maximum(amax, _absmax(xt3))
    p, rp = _fixed_scale(amax)
    hr = tl.arange(0, W)
    # H_W of every full-width tile (columns in `_half_cols` order: the output coordinates follow)
    hw = tl.load(had_ptr + hr[:, None] * W + _half_cols(hr, GS)[None, :])
    xf, xi = _fixed_point(x0, p)
    sq = xi * xi
    z0 = _rot_tile(xf, had_ptr, hw, 0, W, W, NSPLIT, SIGNS)
    if G0 > 1:
        xf, xi = _fixed_point(x1, p)
        sq += xi * xi
        z1 = _rot_tile(xf, had_ptr, hw, W, W, W, NSPLIT, SIGNS)
    if G0 > 2:
        xf, xi = _fixed_point(x2, p)
        sq += xi * xi
        z2 = _rot_tile(xf, had_ptr, hw, 2 * W, W, W, NSPLIT, SIGNS)
        xf, xi = _fixed_point(x3, p)
        sq += xi * xi
        z3 = _rot_tile(xf, had_ptr, hw, 3 * W, W, W, NSPLIT, SIGNS)
    n2 = tl.sum(sq, 1)
    if NT > G0:
        xf, xi = _fixed_point(xt1, p)
        n2 += tl.sum(xi * xi, 1)
        t1 = _rot_tile(xf, had_ptr, hw, O1, W1, W, NSPLIT, SIGNS)
    if NT > G0 + 1:
        xf, xi = _fixed_point(xt2, p)
        n2 += tl.sum(xi * xi, 1)
        t2 = _rot_tile(xf, had_ptr, hw, O2, W2, W, NSPLIT, SIGNS)
    if NT > G0 + 2:
        xf, xi = _fixed_point(xt3, p)
        n2 += tl.sum(xi * xi, 1)
        t3 = _rot_tile(xf, had_ptr, hw, O3, W3, W, NSPLIT, SIGNS)
    n2f = n2.to(tl.float32)  # <= 2^30: exact below 2^24, rounded once above, as the reference
    n = tl.sqrt_rn(n2f) * rp  # ||x||: sqrt(n2) scaled by a power of two, exactly
    # the first block's butterflied tiles za.. (columns 0, W, 2W, 3W), integers; y = za * f0, and so on
    if G0 == 1:
        za = z0
    elif G0 == 2:
        za = z0 + z1
        zb = z0 - z1
    else:
        # H_4 over the tile index (Sylvester): rows ++++, +-+-, ++--, +--+
        a = z0 + z1
        b = z0 - z1
        c = z2 + z3
        e = z2 - z3
        za = a + c
        zb = b + e
        zc = a - c
        zd = b - e
    f0 = _unit_factor(n2f, B0)[:, None]
    f1 = _unit_factor(n2f, B1)[:, None]
    f2 = _unit_factor(n2f, B2)[:, None]
    f3 = _unit_factor(n2f, B3)[:, None]
    if SEARCH:
        ya = za.to(tl.float32) * f0
        if G0 > 1:
            yb = zb.to(tl.float32) * f0
        if G0 > 2:
            yc = zc.to(tl.float32) * f0
            yd = zd.to(tl.float32) * f0
        if NT > G0:
            yt1 = t1.to(tl.float32) * f1
        if NT > G0 + 1:
            yt2 = t2.to(tl.float32) * f2
        if NT > G0 + 2:
            yt3 = t3.to(tl.float32) * f3
        best_cos = tl.full([BT], float("-inf"), tl.float32)
        best_g = tl.full([BT], 1.0, tl.float32)
        for gi in range(NGAIN):
            g = tl.load(gain_ptr + gi)
            gs = g * CS
            pd, pc = _tq_gain_stats(ya, g, gs, tab_ptr, NCELL, HALFC)
            if G0 > 1:
                d1, c1 = _tq_gain_stats(yb, g, gs, tab_ptr, NCELL, HALFC)
                pd += d1
                pc += c1
            if G0 > 2:
                d2, c2 = _tq_gain_stats(yc, g, gs, tab_ptr, NCELL, HALFC)
                d3, c3 = _tq_gain_stats(yd, g, gs, tab_ptr, NCELL, HALFC)
                pd += d2 + d3
                pc += c2 + c3
            dot, cc = _row_sums2(pd, pc)
            if NT > G0:
                d4, c4 = _row_sums2(*_tq_gain_stats(yt1, g, gs, tab_ptr, NCELL, HALFC))
                dot += d4
                cc += c4
            if NT > G0 + 1:
                d5, c5 = _row_sums2(*_tq_gain_stats(yt2, g, gs, tab_ptr, NCELL, HALFC))
                dot += d5
                cc += c5
            if NT > G0 + 2:
                d6, c6 = _row_sums2(*_tq_gain_stats(yt3, g, gs, tab_ptr, NCELL, HALFC))
                dot += d6
                cc += c6
            best_cos, best_g = _tq_pick(dot, cc, g, best_cos, best_g)
        g = best_g[:, None]
        gs = g * CS
        part = _tq_pack_gain(ya, g, gs, 0, pay_ptr, tokp, tok_ok, tab_ptr,
                             BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W)  # fmt: skip
        if G0 > 1:
            part += _tq_pack_gain(yb, g, gs, W, pay_ptr, tokp, tok_ok, tab_ptr,
                                  BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W)  # fmt: skip
        if G0 > 2:
            part += _tq_pack_gain(yc, g, gs, 2 * W, pay_ptr, tokp, tok_ok, tab_ptr,
                                  BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W)  # fmt: skip
            part += _tq_pack_gain(yd, g, gs, 3 * W, pay_ptr, tokp, tok_ok, tab_ptr,
                                  BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W)  # fmt: skip
        acc = tl.sum(part, 1)
        if NT > G0:
            acc += tl.sum(_tq_pack_gain(yt1, g, gs, O1, pay_ptr, tokp, tok_ok, tab_ptr,
                                        BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W1), 1)  # fmt: skip
        if NT > G0 + 1:
            acc += tl.sum(_tq_pack_gain(yt2, g, gs, O2, pay_ptr, tokp, tok_ok, tab_ptr,
                                        BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W2), 1)  # fmt: skip
        if NT > G0 + 2:
            acc += tl.sum(_tq_pack_gain(yt3, g, gs, O3, pay_ptr, tokp, tok_ok, tab_ptr,
                                        BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W3), 1)  # fmt: skip
    else:
        part = _tq_tile_out(za, f0, f0 * CS, 0, pay_ptr, tokp, tok_ok, tab_ptr,
                            BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W, LUT, CMP, LANES)  # fmt: skip
        if G0 > 1:
            part += _tq_tile_out(zb, f0, f0 * CS, W, pay_ptr, tokp, tok_ok, tab_ptr,
                                 BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W, LUT, CMP, LANES)  # fmt: skip
        if G0 > 2:
            part += _tq_tile_out(zc, f0, f0 * CS, 2 * W, pay_ptr, tokp, tok_ok, tab_ptr,
                                 BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W, LUT, CMP, LANES)  # fmt: skip
            part += _tq_tile_out(zd, f0, f0 * CS, 3 * W, pay_ptr, tokp, tok_ok, tab_ptr,
                                 BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W, LUT, CMP, LANES)  # fmt: skip
        acc = tl.sum(part, 1)
        if NT > G0:
            acc += tl.sum(_tq_tile_out(t1, f1, f1 * CS, O1, pay_ptr, tokp, tok_ok, tab_ptr,
                                       BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W1, LUT, CMP, LANES), 1)  # fmt: skip
        if NT > G0 + 1:
            acc += tl.sum(_tq_tile_out(t2, f2, f2 * CS, O2, pay_ptr, tokp, tok_ok, tab_ptr,
                                       BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W2, LUT, CMP, LANES), 1)  # fmt: skip
        if NT > G0 + 2:
            acc += tl.sum(_tq_tile_out(t3, f3, f3 * CS, O3, pay_ptr, tokp, tok_ok, tab_ptr,
                                       BITS, SCALE_MODE, GS, NCELL, HALFC, D, BT, W3, LUT, CMP, LANES), 1)  # fmt: skip
    ASM: tl.constexpr = GS == -2  # by inline PTX with the code words (`asm_store`)
    _tq_scale_store(n, acc.to(tl.float32) * _RQS, sc_ptr, tokp, tok_ok, SCALE_MODE, ASM)


@triton.jit
def _minmax_scale(lo, hi, LEVELS: tl.constexpr):
    """(zero, scale, 1 / scale, 0.5 - zero / scale) of the rows' minima lo and maxima hi (float32), as
    `reference.minmax_encode`'s float32 steps round them: zero and scale rounded to fp16, the scale the range
    times RN(1 / LEVELS), then the IEEE reciprocal and the offset, so that each element takes one multiply and
    one add (no division: it cost the kernel ~15% of its instructions); `_mul_rn` keeps the compiler from
    fusing them into an fma."""
    zero = _fp16_round(lo)
    sc = _fp16_round(tl.maximum((hi - zero) * (1.0 / LEVELS), 5.960464477539063e-08))
    inv = _rcp_rn(sc)
    return zero, sc, inv, 0.5 - _mul_rn(zero, inv)


@triton.jit
def _minmax_tile(
    xr, dmask, tok_ok, tokp, pay_ptr, sc_ptr, zr_ptr, BITS: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
    DP: tl.constexpr, GS: tl.constexpr, SAT: tl.constexpr,
):  # fmt: skip
    """Min-max codes, scale and zero of the rows xr [BT, DP] (input dtype), written where tok_ok."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    # row min / max in the input dtype (exact; two bf16 / fp16 lanes per instruction)
    lo = tl.min(tl.where(dmask[None, :], xr, float("inf")), 1).to(tl.float32)
    hi = tl.max(tl.where(dmask[None, :], xr, float("-inf")), 1).to(tl.float32)
    zero, sc, inv, off = _minmax_scale(lo, hi, LEVELS)
    if SAT and _ASM:  # `SAT_INDEX`
        sb = 1.0 / (LEVELS + 1)
        idx = _sat_index(xr.to(tl.float32), (inv * sb)[:, None], (off * sb)[:, None], BITS)
    else:
        idx = _floor_index(_mul_rn(xr.to(tl.float32), inv[:, None]) + off[:, None], LEVELS)
    _pack_tile(pay_ptr, tokp, tok_ok, idx, 0, BITS, D, BT, DP, GS)
    tl.store(sc_ptr + tokp, sc.to(tl.float16), mask=tok_ok)
    tl.store(zr_ptr + tokp, zero.to(tl.float16), mask=tok_ok)


@triton.jit
def _half_op(a, b, BF16: tl.constexpr, F16: tl.constexpr, IS_MIN: tl.constexpr):
    """min / max (IS_MIN) of a and b in their own float dtype by the PTX BF16 / F16 (`tl.minimum` and `tl.maximum`
    widen 16-bit floats to float32 first, one element per instruction, where ptxas pairs these); float32 inputs and
    the interpreter take `tl.minimum` / `tl.maximum`."""
    if _ASM and a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(BF16, "=h,h,h", [a, b], dtype=a.dtype, is_pure=True, pack=1)
    elif _ASM and a.dtype == tl.float16:
        return tl.inline_asm_elementwise(F16, "=h,h,h", [a, b], dtype=a.dtype, is_pure=True, pack=1)
    elif IS_MIN:
        return tl.minimum(a, b)
    else:
        return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return _half_op(a, b, "min.bf16 $0, $1, $2;", "min.f16 $0, $1, $2;", True)


@triton.jit
def _maximum(a, b):
    return _half_op(a, b, "max.bf16 $0, $1, $2;", "max.f16 $0, $1, $2;", False)


@triton.jit
def _minmax_rows(
    x_ptr, xrow, ld_ok, tok_ok, tokp, pay_ptr, sc_ptr, zr_ptr, BITS: tl.constexpr, D: tl.constexpr,
    BT: tl.constexpr, SAT: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """`_minmax_tile` in the row-group layout (`MINMAX_ROWS`): the rows as [4, BT, D / 32, 8], column (D / 4) k +
    8 j + e (ROWS 2, `MINMAX_ROWS_CONTIG`) or 8 k + 32 j + e (ROWS 1) at (k, t, j, e). Triton's layout for it (sm_90,
    Triton 3.6) spreads the threads over (k, t) and keeps j and e in registers, so a thread holds D / 4 columns of
    ONE row. The row min / max is then in-thread but for two shuffle stages, and the per-row scalars are computed
    once per thread (`_minmax_tile`'s [BT, D] layout gives a thread 4 rows of 8 columns: four shuffle stages per row
    for each of min and max, every per-row scalar 4 times). The 8 codes of (k, j) are word (D / 32) k + j (ROWS 2) or
    k + 4 j (ROWS 1) of the page row. Same per-element arithmetic as `_minmax_tile`."""
    NJ: tl.constexpr = D // 32
    LEVELS: tl.constexpr = (1 << BITS) - 1
    k = tl.arange(0, 4)[:, None, None, None]
    j = tl.arange(0, NJ)[None, None, :, None]
    e = tl.arange(0, 8)[None, None, None, :]
    # ROWS == 2: thread k holds columns [D k / 4, D (k + 1) / 4) (its words one store; each load instruction
    # reads 16 bytes every D / 2 per row) instead of 8 k + 32 j + e (64 contiguous bytes per row and instruction)
    col = (D // 4) * k + 8 * j + e if ROWS == 2 else 8 * k + 32 * j + e
    xr = tl.load(x_ptr + xrow[None, :, None, None] + col, mask=ld_ok[None, :, None, None], other=0.0)
    # the row min / max in the input dtype (exact; `tl.min` widens 16-bit floats to float32 first: one element per
    # instruction, where min.bf16x2 takes two); the interpreter reduces them in float32
    xm = xr if _ASM else xr.to(tl.float32)
    lo = tl.reduce(tl.reduce(tl.reduce(xm, 3, _minimum), 2, _minimum), 0, _minimum).to(tl.float32)  # [BT]
    hi = tl.reduce(tl.reduce(tl.reduce(xm, 3, _maximum), 2, _maximum), 0, _maximum).to(tl.float32)
    zero, sc, inv, off = _minmax_scale(lo, hi, LEVELS)
    x = xr.to(tl.float32)
    if SAT and _ASM:  # `SAT_INDEX`
        sb = 1.0 / (LEVELS + 1)
        idx = _sat_index(x, (inv * sb)[None, :, None, None], (off * sb)[None, :, None, None], BITS)
    else:
        idx = _floor_index(_mul_rn(x, inv[None, :, None, None]) + off[None, :, None, None], LEVELS)
    group = tl.sum(idx << (e * BITS), 3)  # [4, BT, NJ]: the 8 codes of (k, j), code e at bit BITS * e
    if BITS == 3:
        # ROWS == 2, D % 128 == 0: thread k's 3 NJ bytes are 3 NJ / 4 words of the page row from word 3 NJ k / 4
        # on; each 4 groups (96 bits) make 3 words
        NU: tl.constexpr = NJ // 4
        ev, od = tl.split(tl.reshape(group, (4, BT, NU, 2, 2)))
        g0, g2 = tl.split(ev)
        g1, g3 = tl.split(od)
        base = pay_ptr + tokp[None, :, None] * (3 * D // 32) + (3 * NU * tl.arange(0, 4))[:, None, None]
        base += 3 * tl.arange(0, NU)[None, None, :]
        for w in tl.static_range(3):
            word = _group_bits(g0, 0, w, 3) | _group_bits(g1, 1, w, 3)
            word = word | _group_bits(g2, 2, w, 3) | _group_bits(g3, 3, w, 3)
            tl.store(base + w, word.to(pay_ptr.dtype.element_ty), mask=tok_ok[None, :, None])
    else:
        kk = tl.arange(0, 4)[:, None, None]
        jj = tl.arange(0, NJ)[None, None, :]
        wp = pay_ptr + tokp[None, :, None] * (D // 8) + (NJ * kk + jj if ROWS == 2 else kk + 4 * jj)
        tl.store(wp, group.to(pay_ptr.dtype.element_ty), mask=tok_ok[None, :, None])
    # the row's scalars from thread k = 0 of its four, where they already are (no layout conversion)
    k2 = tl.arange(0, 4)[:, None]
    m = tok_ok[None, :] & (k2 == 0)
    tl.store(sc_ptr + tokp[None, :] + 0 * k2, tl.broadcast_to(sc.to(tl.float16)[None, :], (4, BT)), mask=m)
    tl.store(zr_ptr + tokp[None, :] + 0 * k2, tl.broadcast_to(zero.to(tl.float16)[None, :], (4, BT)), mask=m)


@triton.jit
def _store_side(
    x_ptr, stride_xt, t0, ld_ok, tok_ok, tokp, h, pay_ptr, sc_ptr, zr_ptr, tab_ptr, rot_ptr, had_ptr,
    gain_ptr, MODE: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr, SCALE_MODE: tl.constexpr,
    NCELL: tl.constexpr, HALFC: tl.constexpr, CS: tl.constexpr, LUT: tl.constexpr, CMP: tl.constexpr,
    LANES: tl.constexpr,
    SEARCH: tl.constexpr, NGAIN: tl.constexpr, NSPLIT: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
    W: tl.constexpr, G0: tl.constexpr, NT: tl.constexpr, O1: tl.constexpr, W1: tl.constexpr,
    O2: tl.constexpr, W2: tl.constexpr, O3: tl.constexpr, W3: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, SIGNS: tl.constexpr,
    SAT: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    t = t0 + tl.arange(0, BT)
    xrow = t.to(tl.int64) * stride_xt + h * D
    if MODE == 1:
        _tq_side(x_ptr, xrow, ld_ok, tok_ok, tokp, pay_ptr, sc_ptr, tab_ptr, had_ptr, gain_ptr,
                 BITS, SCALE_MODE, GS, NCELL, HALFC, CS, LUT, CMP, LANES, SEARCH, NGAIN, NSPLIT, D, BT, W, G0, NT,
                 O1, W1, O2, W2, O3, W3, B0, B1, B2, B3, SIGNS)  # fmt: skip
    elif MODE == 2 and ROWS:
        _minmax_rows(x_ptr, xrow, ld_ok, tok_ok, tokp, pay_ptr, sc_ptr, zr_ptr, BITS, D, BT, SAT, ROWS)
    else:
        d = tl.arange(0, DP)
        dmask = d < D
        m2 = tok_ok[:, None] & dmask[None, :]
        xr = tl.load(x_ptr + xrow[:, None] + d[None, :], mask=ld_ok[:, None] & dmask[None, :], other=0.0)
        x = xr.to(tl.float32)
        if MODE == 0:
            tl.store(pay_ptr + tokp[:, None] * D + d[None, :], x.to(pay_ptr.dtype.element_ty), mask=m2)
        elif MODE == 3:
            amax = tl.max(tl.abs(x), 1)
            # IEEE divisions (div_rn), as torch computes the reference: Triton's `/` is approximate
            sc = _fp16_round(
                tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 5.960464477539063e-08)
            )
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.broadcast_to(sc[:, None], x.shape)), -448.0), 448.0)
            tl.store(pay_ptr + tokp[:, None] * D + d[None, :], q.to(pay_ptr.dtype.element_ty), mask=m2)
            tl.store(sc_ptr + tokp, sc.to(tl.float16), mask=tok_ok)
        elif MODE == 4:
            q = tl.minimum(tl.maximum(x, -448.0), 448.0)
            tl.store(pay_ptr + tokp[:, None] * D + d[None, :], q.to(pay_ptr.dtype.element_ty), mask=m2)
        elif MODE == 2:
            _minmax_tile(xr, dmask, tok_ok, tokp, pay_ptr, sc_ptr, zr_ptr, BITS, D, BT, DP, GS, SAT)
        else:
            # dense rotation (block sizes the tiled Hadamard path does not cover), chunks of C columns, in
            # the reference's fixed point: z = xi @ S^T with S the +-1 / 0 matrix R scaled by sqrt(block)
            amax = tl.max(tl.where(dmask[None, :], tl.abs(x), 0.0), 1)
            p, rp = _fixed_scale(amax)
            xf, xi = _fixed_point(x, p)
            n2f = tl.sum(xi * xi, 1).to(tl.float32)
            n = tl.sqrt_rn(n2f) * rp
            # gain search: the rows' gain of the best cosine, y recomputed by chunk for every gain
            # (gain 1 without search); the chunk loop below then packs what that gain gives
            gc = tl.full([BT], 1.0, tl.float32)
            if SEARCH:
                best_cos = tl.full([BT], float("-inf"), tl.float32)
                for gi in range(NGAIN):
                    g = tl.load(gain_ptr + gi)
                    dot = tl.zeros([BT], dtype=tl.float32)
                    cc = tl.zeros([BT], dtype=tl.float32)
                    for c0 in tl.static_range(0, DP, C):
                        j = c0 + tl.arange(0, C)
                        y = _dense_y(xf, n2f, rot_ptr, c0, d, dmask, D, C)
                        _, cv = _tq_lookup(y * g, y, g * CS, tab_ptr, NCELL, HALFC, 0, "", "")
                        jm = (j < D)[None, :]
                        dot += tl.sum(tl.where(jm, y * cv, 0.0), 1)
                        cc += tl.sum(tl.where(jm, cv * cv, 0.0), 1)
                    best_cos, gc = _tq_pick(dot, cc, g, best_cos, gc)
            acc = tl.zeros([BT], dtype=tl.int32)
            for c0 in tl.static_range(0, DP, C):
                j = c0 + tl.arange(0, C)
                y = _dense_y(xf, n2f, rot_ptr, c0, d, dmask, D, C)
                if SEARCH:
                    idx, cq = _tq_lookup(
                        y * gc[:, None], y, (gc * CS)[:, None], tab_ptr, NCELL, HALFC, 1 << BITS, "", ""
                    )
                else:
                    idx, cq = _tq_lookup(y, y, CS, tab_ptr, NCELL, HALFC, 1 << BITS, LUT, CMP)
                acc += tl.sum(tl.where((j < D)[None, :], _tq_scale_terms(y, cq, SCALE_MODE), 0), 1)
                _pack_tile(pay_ptr, tokp, tok_ok, idx, c0, BITS, D, BT, C, GS, True)
            _tq_scale_store(n, acc.to(tl.float32) * _RQS, sc_ptr, tokp, tok_ok, SCALE_MODE)


@triton.jit(do_not_specialize=["T"])  # token count: one binary for every step size
def _store_kv_kernel(
    k_ptr, v_ptr, stride_kt, stride_vt, slot_ptr, T,
    kpay_ptr, ksc_ptr, kzr_ptr, ktab_ptr, vpay_ptr, vsc_ptr, vzr_ptr, vtab_ptr, rot_ptr, had_ptr, gain_ptr,
    HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, C: tl.constexpr,
    KMODE: tl.constexpr, KBITS: tl.constexpr, KGS: tl.constexpr,
    KNCELL: tl.constexpr, KHALFC: tl.constexpr, KCS: tl.constexpr, KLUT: tl.constexpr, KCMP: tl.constexpr,
    KLANES: tl.constexpr,
    VMODE: tl.constexpr, VBITS: tl.constexpr, VGS: tl.constexpr,
    VNCELL: tl.constexpr, VHALFC: tl.constexpr, VCS: tl.constexpr, VLUT: tl.constexpr, VCMP: tl.constexpr,
    VLANES: tl.constexpr,
    SCALE_MODE: tl.constexpr, SEARCH: tl.constexpr, NGAIN: tl.constexpr,
    NSPLIT: tl.constexpr, W: tl.constexpr, G0: tl.constexpr, NT: tl.constexpr, O1: tl.constexpr, W1: tl.constexpr,
    O2: tl.constexpr, W2: tl.constexpr, O3: tl.constexpr, W3: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, SIGNS: tl.constexpr,
    SAT: tl.constexpr, SPLIT: tl.constexpr, LOAD_BY_TOKEN: tl.constexpr, KROWS: tl.constexpr, VROWS: tl.constexpr,
):  # fmt: skip
    # `split_sides`, `SPLIT_ORDER`: SPLIT 1 / 2: grid axis 2 picks the side, CUDA starting the key (1) or the value
    # (2) programs first; 3: axis 0 holds 2 programs per token tile, keys and values interleaved
    if SPLIT == 3:
        t0 = (tl.program_id(0) // 2) * BT
        side = tl.program_id(0) % 2
    else:
        t0 = tl.program_id(0) * BT
        side = tl.program_id(2) if SPLIT != 2 else 1 - tl.program_id(2)
    h = tl.program_id(1)
    if SPLIT:
        if side == 0:
            ld_ok, ok, tokp = _rows(slot_ptr, T, t0, h, HKV, BS, BT, LOAD_BY_TOKEN)
            _store_side(k_ptr, stride_kt, t0, ld_ok, ok, tokp, h, kpay_ptr, ksc_ptr, kzr_ptr, ktab_ptr, rot_ptr,
                        had_ptr, gain_ptr, KMODE, KBITS, KGS, SCALE_MODE, KNCELL, KHALFC, KCS, KLUT, KCMP, KLANES,
                        SEARCH, NGAIN, NSPLIT, D, DP, BT, C, W, G0, NT, O1, W1, O2, W2, O3, W3,
                        B0, B1, B2, B3, SIGNS, SAT, KROWS)  # fmt: skip
        else:
            ld_ok, ok, tokp = _rows(slot_ptr, T, t0, h, HKV, BS, BT, LOAD_BY_TOKEN)
            _store_side(v_ptr, stride_vt, t0, ld_ok, ok, tokp, h, vpay_ptr, vsc_ptr, vzr_ptr, vtab_ptr, rot_ptr,
                        had_ptr, gain_ptr, VMODE, VBITS, VGS, SCALE_MODE, VNCELL, VHALFC, VCS, VLUT, VCMP, VLANES,
                        SEARCH, NGAIN, NSPLIT, D, DP, BT, C, W, G0, NT, O1, W1, O2, W2, O3, W3,
                        B0, B1, B2, B3, SIGNS, SAT, VROWS)  # fmt: skip
    else:
        ld_ok, ok, tokp = _rows(slot_ptr, T, t0, h, HKV, BS, BT, LOAD_BY_TOKEN)
        _store_side(k_ptr, stride_kt, t0, ld_ok, ok, tokp, h, kpay_ptr, ksc_ptr, kzr_ptr, ktab_ptr, rot_ptr,
                    had_ptr, gain_ptr, KMODE, KBITS, KGS, SCALE_MODE, KNCELL, KHALFC, KCS, KLUT, KCMP, KLANES,
                    SEARCH, NGAIN, NSPLIT, D, DP, BT, C, W, G0, NT, O1, W1, O2, W2, O3, W3,
                    B0, B1, B2, B3, SIGNS, SAT, KROWS)  # fmt: skip
        _store_side(v_ptr, stride_vt, t0, ld_ok, ok, tokp, h, vpay_ptr, vsc_ptr, vzr_ptr, vtab_ptr, rot_ptr,
                    had_ptr, gain_ptr, VMODE, VBITS, VGS, SCALE_MODE, VNCELL, VHALFC, VCS, VLUT, VCMP, VLANES,
                    SEARCH, NGAIN, NSPLIT, D, DP, BT, C, W, G0, NT, O1, W1, O2, W2, O3, W3,
                    B0, B1, B2, B3, SIGNS, SAT, VROWS)  # fmt: skip


@triton.jit
def _rows(slot_ptr, T, t0, h, HKV: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr, LOAD_BY_TOKEN: tl.constexpr):
    """Tokens [t0, t0 + BT): (whose K / V rows to load, whose pages to write, their page rows)."""
    t = t0 + tl.arange(0, BT)
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1)
    ok = slot >= 0
    # K / V rows load by t < T, not by the slot (`LOAD_BY_TOKEN`): the loads then need not wait for the slot
    # mapping's (skipped tokens' rows are quantized and not written; every store is masked by the slot)
    ld_ok = (t < T) if LOAD_BY_TOKEN else ok
    # page-row index (page, head, offset) in int32 arithmetic, widened once for the byte offsets
    slot = tl.where(ok, slot, 0).to(tl.uint32)
    tokp = ((slot // BS) * (HKV * BS) + h * BS + slot % BS).to(tl.int64)
    return ld_ok, ok, tokp


def _cell_table(cb: torch.Tensor, bnd: torch.Tensor, margin: float = 0.05) -> tuple[torch.Tensor, int, int, float]:
    """`_tq_lookup`'s table for centroids cb [L] and ascending boundaries bnd [L - 1] (float32):
    (int32 table: [NCELL, 2] flat (own boundary as bits, base), then the L centroids' bits, then
    theirs times 2^SCALE_QS (`_tq_scale_terms`), then, where the cells around the boundaries number at
    most 32 and L <= 32, the lane tables of `_tq_lookup_lanes` (3 x 32 entries at 2 NCELL + 2 L,
    `lane_cells`); NCELL,
    HALFC, CS). Cell k (k = round(y * CS) + HALFC) covers
    CS * y in [k - HALFC - 1/2, k - HALFC + 1/2). CS is picked so that every cell holds at most
    one boundary and none lies within `margin` of a cell edge (so y * CS may be computed with a
    few ulps of error), and the cells span |y| <= 1.01 (unit vectors, rounding included).
    Built once per plan from the host codebook (`tq_codebook` on the CPU): no device round trip."""
    assert cb.device.type == "cpu" and bnd.device.type == "cpu", "build the cell table from the host codebook"
    b64 = bnd.double()
    gap = float((b64[1:] - b64[:-1]).min()) if b64.numel() > 1 else 1.0
    span = max(1.01, float(b64.abs().max()) * 1.01)
    for i in range(400):
        cs = float(torch.tensor((1.0 + margin * 4 + 0.01 * i) / gap, dtype=torch.float32))
        v = b64 * cs
        if bool(((v - v.round()).abs() <= 0.5 - margin).all()):
            break
    else:  # pragma: no cover - 400 tries never all fail for Lloyd-Max boundaries
        raise ValueError("no cell width separates these boundaries")
    halfc = math.ceil(span * cs) + 1
    ncell = 2 * halfc + 1
    cell_of = (b64 * cs).round().long() + halfc  # each boundary's cell (distinct: cs > 1 / gap)
    assert cell_of.unique().numel() == cell_of.numel() and 0 < int(cell_of.min()) and int(cell_of.max()) < ncell - 1
    bits32 = (bnd.float() + 0.0).view(torch.int32).long() & 0xFFFFFFFF  # -0 + 0 = +0 (`CMP_SIGN`)
    cbits = cb.float().view(torch.int32).long() & 0xFFFFFFFF
    k = torch.arange(ncell)
    base = torch.searchsorted(cell_of, k)  # boundaries in cells below k
    own = torch.full((ncell,), 0x7F800000, dtype=torch.long)  # +inf: no boundary in this cell
    own[cell_of] = bits32
    cqbits = (cb.float() * 2.0**SCALE_QS).view(torch.int32).long() & 0xFFFFFFFF  # exact: a power of two
    parts = [torch.stack([own, base], 1).flatten(), cbits, cqbits]
    n = cb.numel()
    lo, hi = int(cell_of.min()) - 1, int(cell_of.max()) + 1
    if hi - lo < 32 and n <= 32:
        # `_tq_lookup_lanes`' lane tables: lane j holds cell lo + j's boundary bits and base (cells lo and
        # hi hold no boundary, and every cell below lo / above hi has theirs: a cell clamped to [lo, hi]
        # gives the same count; lanes past hi repeat it), then index j's nc term round(c_j^2 * 2^SCALE_QS)
        # (`reference.fixed_sum`'s rounding of the exact float64 square; lanes past the count repeat)
        k = torch.clamp(torch.arange(32) + lo, max=hi)
        terms = torch.tensor(nc_terms(cb), dtype=torch.long)
        parts += [own[k], base[k], terms[torch.arange(32) % n]]
    tab = torch.cat(parts).to(torch.uint32).view(torch.int32)
    return tab, ncell, halfc, cs


def nc_terms(cb: torch.Tensor) -> list[int]:
    """round(c^2 * 2^SCALE_QS) per centroid c (float32, host), half to even: `_tq_scale_terms`' nc term, which
    rounds the exact square (the float64 square of a float32 is exact)."""
    return [int(v) for v in torch.round(cb.float().double() ** 2 * 2.0**SCALE_QS).long()]


def lane_cells(tab: torch.Tensor, ncell: int, n: int) -> int:
    """`_tq_lookup_lanes`' LANES for `_cell_table`'s table (NCELL cells, n centroids): 0 where it holds
    no lane tables, else 1 + 64 lo + (hi - lo) for the cells [lo, hi] they cover (the tables themselves
    sit at 2 NCELL + 2 n)."""
    if tab.numel() == 2 * ncell + 2 * n:
        return 0
    held = (tab[0 : 2 * ncell : 2].to(torch.int64) & 0xFFFFFFFF) != 0x7F800000  # cells with a boundary
    k = torch.arange(ncell)
    lo, hi = int(torch.where(held, k, ncell).min()) - 1, int(torch.where(held, k, -1).max()) + 1
    return 1 + 64 * lo + (hi - lo)


def lane_table_ptx(entries: list[int]) -> str:
    """PTX that sets $0 to entry l mod L of `entries` (L = len(entries) <= 32, float32 bits) in lane l:
    a select tree on the bits of the lane id over immediates. `_tq_lookup` (LUT) takes the centroid of
    the index it finds from this register by `shfl.sync.idx`: one shuffle per element instead of an
    address (two instructions) and a load that waits on the first."""
    n = len(entries)
    assert n & (n - 1) == 0 and 2 <= n <= 32
    lines = [".reg .b32 l, q;", ".reg .pred p;", "mov.u32 l, %laneid;"]
    level = []
    for i, e in enumerate(entries):
        lines += [f".reg .b32 e0_{i};", f"mov.b32 e0_{i}, {e & 0xFFFFFFFF:#x};"]
        level.append(f"e0_{i}")
    k = 0
    while len(level) > 1:  # bit k of the lane picks within each pair of the level below
        lines += [f"and.b32 q, l, {1 << k};", "setp.ne.u32 p, q, 0;"]
        nxt = []
        for i in range(0, len(level), 2):
            r = f"e{k + 1}_{i // 2}"
            lines += [f".reg .b32 {r};", f"selp.b32 {r}, {level[i + 1]}, {level[i]}, p;"]
            nxt.append(r)
        level, k = nxt, k + 1
    lines.append(f"mov.b32 $0, {level[0]};")
    return "{\n" + "\n".join(lines) + "\n}"


def compare_ptx(bnd: torch.Tensor) -> str:
    """`_tq_lookup`'s CMP block for ascending float32 boundaries bnd (at most 3): $0 = #{bnd < y} for y in
    $2, as the sum of the sign bits of p - y (IEEE subtraction, no flush to zero: negative exactly where
    y > p, and +0 where they are equal); $1 = the centroid at $0 by a shuffle of the lane table entry $3.
    Three subtractions, a shift and two shift-adds, no load."""
    assert bnd.device.type == "cpu", "build the compare block from the host codebook"
    bits = [int(b) & 0xFFFFFFFF for b in bnd.float().view(torch.int32).numpy()]
    assert 1 <= len(bits) <= 3
    lines = [".reg .f32 d;", ".reg .b32 u, n;"]
    for i, b in enumerate(bits):
        lines += [f"sub.rn.f32 d, 0f{b:08X}, $2;", "mov.b32 u, d;", "shr.u32 u, u, 31;"]
        lines.append("mov.u32 n, u;" if i == 0 else "add.s32 n, n, u;")
    lines += ["mov.u32 $0, n;", "shfl.sync.idx.b32 $1, $3, $0, 0x1f, 0xffffffff;"]
    return "{\n" + "\n".join(lines) + "\n}"


def _tile_plan(blocks: list[int], wmax: int) -> tuple | None:
    """(W, G0, NT, [(offset, width)] of the other blocks) for `_tq_side`, or None
    when the Hadamard blocks don't fit it (then the dense R product is used)."""
    first = blocks[0]
    w = min(first, wmax)
    g0 = first // w
    tail = blocks[1:]
    if w < 16 or g0 not in (1, 2, 4) or g0 + len(tail) > 4 or any(not 16 <= b <= w for b in tail):
        return None
    rest, off = [], first
    for b in tail:
        rest.append((off, b))
        off += b
    return w, g0, g0 + len(tail), rest


def _tile_matrices(signs: torch.Tensor, tiles: tuple) -> torch.Tensor:
    """`_rot_tile`'s buffer, flat: H_W (W the first tile's width, the widest; entries +-1 in Sylvester
    order, H[i, j] = (-1) ** popcount(i & j), exact in fp16), then the signs."""
    from tqserve.kvquant.rotation import fwht

    return torch.cat([fwht(torch.eye(tiles[0])).flatten(), signs.float()])


def _dense_signs(rot) -> torch.Tensor:
    """`_dense_y`'s buffer, flat float32: S = R with row j scaled by sqrt(b_j) (entries +-1 / 0: y = R x is
    S x / sqrt(b_j) per row), then the D block sizes b_j."""
    sizes = torch.cat([torch.full((b,), float(b)) for b in rot.blocks])
    s = (rot.matrix * sizes.sqrt()[:, None]).round()
    return torch.cat([s.flatten(), sizes]).float().contiguous()


class StorePlan:
    """Kernel arguments for one layer's format, built once (codebooks, signs, H moved to the device).

    `wmax` caps the width of one rotation tile (the benchmark sweeps it). By default 32 where 32-column
    tiles cover the first Hadamard block in at most four and no side runs the gain search (H100, one
    H_W for all tiles: 4bit_nc 0.0607 vs 0.0639 ms with 64, k3v4_nc 0.0585 vs 0.0592; both sides
    TurboQuant, earlier kernel: tq3 0.0767 vs 0.0886, tq4 0.1167 vs 0.1197), else 64."""

    def __init__(self, fmt, device: torch.device | str, wmax: int | None = None) -> None:
        from tqserve.kvquant.formats import (
            CodecFormat,
            ExactCodec,
            Fp8CastCodec,
            Fp8ScaledCodec,
            MinMaxCodec,
            TurboQuantCodec,
        )
        from tqserve.kvquant.reference import SEARCH_GAINS, tq_codebook
        from tqserve.kvquant.rotation import Rotation, hadamard_blocks

        self.head_dim = d = fmt.head_dim
        self.scale_mode = 0
        self.search = False
        self.gains: torch.Tensor | None = None
        self.rot = self.tiles = None
        self.had: torch.Tensor | None = None  # H_W and the signs (`_rot_tile`), fp16
        # per side: (mode, bits, payload name, scale name, zero name, (table, NCELL, HALFC, CS, LUT, CMP, LANES));
        # LANES: `lane_cells`' value, or -1 where LUT holds the nc terms (`TERM_LUT`)
        self.sides = []
        if isinstance(fmt, ExactFormat):
            self.sides = [
                (EXACT, 16, "k", None, None, None),
                (EXACT, 16, "v", None, None, None),
            ]
            self.group = [None, None]
            return
        if not isinstance(fmt, CodecFormat):
            raise NotImplementedError(f"no store kernel for {type(fmt).__name__}")
        if wmax is None:
            any_search = any(getattr(c, "search", False) for c in (fmt.key_codec, fmt.value_codec))
            wmax = 32 if not any_search and _tile_plan(hadamard_blocks(d), 32) is not None else 64
        modes = set()
        for side, codec in (("k", fmt.key_codec), ("v", fmt.value_codec)):
            if isinstance(codec, TurboQuantCodec):
                base = getattr(codec, "base_mode", codec.scale_mode)  # 'nc' of the search encoder 'nc+search'
                search = bool(getattr(codec, "search", False))
                if base not in SCALE_MODES:
                    raise NotImplementedError(f"no store kernel for TurboQuant scale mode {codec.scale_mode!r}")
                if search and base == "plain":
                    raise ValueError("the gain search needs a scale fitted to the indices (nc or unbiased), not plain")
                tab, ncell, halfc, cs = _cell_table(*tq_codebook(codec.bits, d))
                n = 1 << codec.bits
                lut = ""
                if LANE_LUT and n <= 32:  # the scaled centroids' bits, as the table holds them
                    lut = lane_table_ptx([int(v) for v in tab[2 * ncell + n : 2 * ncell + 2 * n]])
                cmp = compare_ptx(tq_codebook(codec.bits, d)[1]) if lut and n == 4 else ""
                lanes = 0
                if CELL_LANES and base == "nc" and not search and n > 4:
                    lanes = lane_cells(tab, ncell, n)
                table = (tab.to(device), ncell, halfc, cs, lut, cmp, lanes)
                rot = codec.rotation
                tiles = None
                if type(rot) is Rotation and rot.blocks == hadamard_blocks(d):
                    tiles = _tile_plan(rot.blocks, wmax)
                if tiles is not None:
                    self.tiles = tiles
                    m = _tile_matrices(rot.signs, tiles)
                    self.had = m.to(device=device, dtype=torch.float16)
                    mode = TQ
                else:
                    self.rot = _dense_signs(rot).to(device)
                    mode = TQ_DENSE
                self.sides.append((mode, codec.bits, f"{side}_idx", f"{side}_scale", None, table))
                modes.add((SCALE_MODES[base], search))
            elif isinstance(codec, MinMaxCodec):
                self.sides.append((MINMAX, codec.bits, f"{side}_idx", f"{side}_scale", f"{side}_zero", None))
            elif isinstance(codec, Fp8ScaledCodec):
                self.sides.append((FP8_SCALED, 8, f"{side}_q", f"{side}_scale", None, None))
            elif isinstance(codec, Fp8CastCodec):
                self.sides.append((FP8_CAST, 8, f"{side}_q", None, None, None))
            elif isinstance(codec, ExactCodec):
                self.sides.append((EXACT, 16, f"{side}_x", None, None, None))
            else:
                raise NotImplementedError(f"no store kernel for codec {type(codec).__name__}")
        if len(modes) > 1:
            raise NotImplementedError("keys and values with different TurboQuant scale modes")
        if {s[0] for s in self.sides} == {TQ, TQ_DENSE}:
            raise NotImplementedError("keys and values with different rotations")
        self.scale_mode, self.search = modes.pop() if modes else (0, False)
        self.group = [self._group(mode, bits) for mode, bits, *_ in self.sides]
        if not cell_lanes(self):
            self.sides = [(*side[:5], (*side[5][:6], 0) if side[5] else None) for side in self.sides]
        if TERM_LUT and self.scale_mode == SCALE_MODES["nc"] and not self.search:
            sides = []
            for mode, bits, *names, table in self.sides:
                if mode == TQ and bits in (3, 4) and table[4] and not table[6]:  # (the dense path: centroids)
                    terms = nc_terms(tq_codebook(bits, d)[0])
                    table = (*table[:4], lane_table_ptx(terms), table[5], -1)
                sides.append((mode, bits, *names, table))
            self.sides = sides
        two_4bit = all(m in (TQ, TQ_DENSE) and b == 4 for m, b, *_ in self.sides)
        if two_4bit and self.scale_mode == SCALE_MODES["unbiased"] and not LANE_LUT_TWO_4BIT_UB:
            self.sides = [(*side[:5], (*side[5][:4], "", "", 0)) for side in self.sides]
        if self.search:
            self.gains = torch.tensor(SEARCH_GAINS, dtype=torch.float32, device=device)

    def _group(self, mode: int, bits: int) -> int | None:
        """`_pack_tile`'s GS for one side (None: not packed; -1: half groups, `HALF_GROUPS`)."""
        if mode not in (TQ, MINMAX, TQ_DENSE):
            return None
        if HALF_GROUPS and mode == TQ and bits in (2, 4) and self.tiles is not None:
            w, _, _, rest = self.tiles
            if not rest and w == 32:  # one Hadamard block, every tile in `_half_cols` order
                return -1
        if HALF_GROUPS and mode == TQ and bits == 3 and self.tiles is not None:
            w, _, _, rest = self.tiles
            if not rest and w == 32:  # whole groups of 8 codes per thread (one-warp launch)
                return -8
        if bits in WORD_DTYPES:
            return 0
        d = self.head_dim
        if mode == TQ:
            w, _, nt, rest = self.tiles
            widths = [w] + [b for _, b in rest]
        else:
            widths = [triton.next_power_of_2(d) if mode == MINMAX else min(triton.next_power_of_2(d), 64)]
        for gs in (32, 16):
            if d % gs == 0 and all(x % gs == 0 for x in widths):
                return gs
        return 8


# The register cap of one warp of 8 tokens where one TurboQuant side packs codes across words (3 or 5 bits). H200,
# thirty-fourth session, store 16K, 1 / 8 layers, us at 96 / 88 / 80: 3bit_nc 49.98 / 50.78 / 49.22 and 45.26 /
# 46.13 / 44.84, k3v4_nc 50.40 / 50.88 / 49.54 and 45.63 / 46.15 / 45.03 (80: 25 warps per SM, 9-11 spill
# instructions; 88: 23 warps, 2-4)
GROUPED_ONE_SIDE_MAXNREG = 80


def _launch_shape(plan: StorePlan) -> tuple[int, int, int | None]:
    """(tokens per program, warps, register cap or None), from the sweeps in docs/benchmarks.md (store,
    thirteenth session: H100, 16384 tokens x 8 heads x d 128, this kernel with 8-byte cell entries).
    Hadamard-tiled TurboQuant at d <= 128 without the gain search: a side packed in groups that cross
    words (3 or 5 bits) takes one warp of 8 tokens (k3v4_nc 0.0498 ms vs 0.0505 at 16 x 2, 3bit_nc
    0.0497 vs 0.0607, tq4 0.0832 vs 0.0844 at 16 x 2 and 0.1041 at 32 x 2), capped at
    `GROUPED_ONE_SIDE_MAXNREG` registers for one TurboQuant side and 128 for two; otherwise one side at 16
    tokens x 2 warps capped at 80 (4bit_nc 0.0494 ms, 0.0496 at 8 x 1; H200, thirty-fourth session: 72 and 64
    slower), or at `SPLIT_ONE_SIDE_MAXNREG` where the sides split (`split_sides`), two sides at 16 x 2 without a
    cap (fifteenth session, L2 warm: tq3 0.0638 vs 0.0672 capped at 128 and 0.0735 at 168, 0.0899 at 32 x 2 x
    128; tq_k4v4_ub 0.0660 vs 0.0689 capped, 0.0689 at 8 x 1). Other head sizes and the gain search keep the
    earlier table: two TurboQuant sides at 64 x 4, everything else at 16 x 4 (presets without TurboQuant: 32 and
    64 no faster; the gain search, ~50 quantizations per element: tq4s 4.35 ms vs 4.88 at 64)."""
    tq = _tq_sides(plan)
    if _tuned(plan):  # (a tile plan means at least one TurboQuant side)
        if _grouped(plan):
            return (8, 1, 128) if tq == 2 else (8, 1, GROUPED_ONE_SIDE_MAXNREG)
        if tq == 2:
            return 16, 2, None
        return 16, 2, SPLIT_ONE_SIDE_MAXNREG if split_sides(plan) else 80
    if tq == 2 and not plan.search:
        return 64, 4, None
    return 16, 4, None


def _tq_sides(plan: StorePlan) -> int:
    """How many of the two sides are TurboQuant (tiled or dense)."""
    return sum(side[0] in (TQ, TQ_DENSE) for side in plan.sides)


def _tuned(plan: StorePlan) -> bool:
    """Hadamard-tiled TurboQuant at d <= 128 without the gain search: the launches tuned per layout."""
    return plan.tiles is not None and not plan.search and plan.head_dim <= 128


def _grouped(plan: StorePlan) -> bool:
    """A side packed in groups that cross words (3 or 5 bits)."""
    return any(g not in (None, 0, -1) for g in plan.group)


def split_sides(plan: StorePlan) -> bool:
    """Whether keys and values go to separate programs (`SPLIT_SIDES`): by default the tuned launches with two
    TurboQuant sides, or one whose codes do not cross words (4bit_nc); not one 3- or 5-bit side (8 x 1)."""
    if SPLIT_SIDES != 1:
        return bool(SPLIT_SIDES)
    return _tuned(plan) and (_tq_sides(plan) == 2 or not _grouped(plan))


def cell_lanes(plan: StorePlan) -> bool:
    """Whether nc sides of 3- or 4-bit codes take their cells from lane tables (`CELL_LANES`): by default where both
    sides are TurboQuant, or in the split one-side launch whose codes do not cross words (4bit_nc)."""
    if CELL_LANES != 1:
        return bool(CELL_LANES)
    if all(m in (TQ, TQ_DENSE) for m, *_ in plan.sides):
        return True
    return _tuned(plan) and _tq_sides(plan) == 1 and not _grouped(plan)


def minmax_rows(plan: StorePlan, side: int) -> int:
    """`_minmax_rows`' ROWS for one side (0: `_minmax_tile`; `MINMAX_ROWS`): min-max codes of 2 or 4 bits (8 per
    16- / 32-bit word) at a head size that is a power of two of at least 32; 2 with `MINMAX_ROWS_CONTIG`."""
    mode, bits, *_ = plan.sides[side]
    d = plan.head_dim
    words = plan.group[side] == 0 and bits in (2, 4)  # 8 codes per 16- / 32-bit word
    # 3-bit codes in words of 32 bits, thread k's 32 D / 128 columns whole groups of four 24-bit groups
    groups = plan.group[side] == 32 and bits == 3 and MINMAX_ROWS_CONTIG and d % 128 == 0
    ok = mode == MINMAX and (words or groups) and d >= 32 and d & (d - 1) == 0
    ok = ok and (MINMAX_ROWS == 2 or (MINMAX_ROWS == 1 and _tuned(plan)))
    return (2 if MINMAX_ROWS_CONTIG else 1) if ok else 0


def asm_store(plan: StorePlan, side: int) -> bool:
    """Whether a side's code words and scales are stored by inline PTX (`ASM_STORE`; GS = -2): 4-bit half groups,
    and by default only where every TurboQuant side of the plan is one (4bit_nc, tq_k4v4_*; not tq3's keys)."""

    def half_groups4(s: int) -> bool:
        return plan.group[s] == -1 and plan.sides[s][1] == 4

    if not ASM_STORE or not half_groups4(side):
        return False
    return ASM_STORE == 2 or all(half_groups4(s) for s in (0, 1) if plan.sides[s][0] in (TQ, TQ_DENSE))


def sign_mode(plan: StorePlan) -> int:
    """`_rot_tile`'s SIGNS: 1 at the load (`signs_at_load`), else 2 with `SIGN_XOR`, else 0."""
    return 1 if signs_at_load(plan) else 2 if SIGN_XOR else 0


def signs_at_load(plan: StorePlan) -> bool:
    """Whether the store applies the rotation's signs at the load (`SIGNS_AT_LOAD`): one TurboQuant side
    whose codes do not cross words, in the tuned 16 x 2 launch (the other launches ran slower with it)."""
    if SIGNS_AT_LOAD == 2:
        return plan.tiles is not None
    return bool(SIGNS_AT_LOAD) and _tuned(plan) and _tq_sides(plan) == 1 and not _grouped(plan)


def store_kv(
    pages: dict[str, torch.Tensor],
    plan: StorePlan,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    maxnreg: int | None = None,
) -> None:
    """Quantize and write k, v [T, Hkv, d] into page slots [T] (negative = skip), one launch.
    `block_tokens` / `num_warps` / `maxnreg` override the launch shape (benchmark sweeps)."""
    T, hkv, d = k.shape
    if k.stride(-1) != 1 or k.stride(-2) != d:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(-2) != d:
        v = v.contiguous()
    first = pages[plan.sides[0][2]]
    bs = first.shape[2]
    dp = triton.next_power_of_2(d)
    bt, warps, regs = _launch_shape(plan)
    if block_tokens or num_warps:  # a sweep's shape: its own register cap or none
        bt, warps, regs = block_tokens or bt, num_warps or warps, maxnreg
    regs = None if os.environ.get("TRITON_INTERPRET") == "1" else regs
    args = []
    cells = []
    for (_mode, bits, pay, sc, zr, table), gs in zip(plan.sides, plan.group):
        p = pages[pay]
        if gs is not None:
            p = p.view(WORD_DTYPES[1 if gs == -8 else bits // 2 if gs < 0 else bits if gs == 0 else gs // 8])
        args += [p, pages[sc] if sc else p, pages[zr] if zr else p, table[0] if table else p]
        cells.append(table[1:] if table else (1, 0, 1.0, "", "", 0))
    if plan.tiles is not None:
        w, g0, nt, rest = plan.tiles
        rest = rest + [(0, 16)] * (3 - len(rest))
        nsplit = 0 if os.environ.get("TRITON_INTERPRET") == "1" else 1
        had = plan.had
    else:
        w, g0, nt, rest, nsplit, had = 16, 1, 1, [(0, 16)] * 3, 1, first
    rot = plan.rot if plan.rot is not None else first
    (km, kb, *_), (vm, vb, *_) = plan.sides
    kgs, vgs = (-2 if asm_store(plan, i) else plan.group[i] or 0 for i in (0, 1))
    split = SPLIT_ORDER if split_sides(plan) else 0
    grid = (triton.cdiv(T, bt) * (2 if split == 3 else 1), hkv, 2 if split in (1, 2) else 1)
    _store_kv_kernel[grid](
        k, v, k.stride(0), v.stride(0), slot_mapping, T, *args, rot, had,
        plan.gains if plan.search else first,
        HKV=hkv, BS=bs, D=d, DP=dp, BT=bt, C=min(dp, 64),
        KMODE=km, KBITS=kb, KGS=kgs, KNCELL=cells[0][0], KHALFC=cells[0][1], KCS=cells[0][2],
        KLUT=cells[0][3], KCMP=cells[0][4] if CMP_2BIT else "", KLANES=cells[0][5],
        VMODE=vm, VBITS=vb, VGS=vgs, VNCELL=cells[1][0], VHALFC=cells[1][1], VCS=cells[1][2],
        VLUT=cells[1][3], VCMP=cells[1][4] if CMP_2BIT else "", VLANES=cells[1][5],
        SCALE_MODE=plan.scale_mode, SEARCH=plan.search,
        NGAIN=plan.gains.numel() if plan.search else 1, NSPLIT=nsplit,
        W=w, G0=g0, NT=nt, O1=rest[0][0], W1=rest[0][1], O2=rest[1][0], W2=rest[1][1],
        O3=rest[2][0], W3=rest[2][1], B0=w * g0, B1=rest[0][1], B2=rest[1][1], B3=rest[2][1],
        SIGNS=sign_mode(plan), SAT=bool(SAT_INDEX), SPLIT=split, LOAD_BY_TOKEN=bool(LOAD_BY_TOKEN),
        KROWS=minmax_rows(plan, 0), VROWS=minmax_rows(plan, 1),
        num_warps=warps,
        **({"maxnreg": regs} if regs else {}),
    )  # fmt: skip
