"""Decode and verify over packed pages with keys on the tensor-core M side and the query heads on N.

`paged_decode._decode_kernel` puts the rows (query token x head of the GQA group, padded to 16) on the
M side of every `tl.dot`: with a group of 4 in a decode step, three quarters of each [16, keys] score
tile are padding, yet the online softmax (scale, mask, max, exp2, sum, the rescale of [16, d]
accumulators) runs over all of it - about a quarter of the key loop's instructions on the H100
(eighth session: ~500 of ~2,000 per 64-key tile). Here the dots are turned around and the columns
(query token x head of the group, padded to a power of two) sit on N, whose tensor-core minimum is 8:

    s^T [keys, N]   = sum_j  c[idx_j] [keys, d / 4] @ q_j^T [d / 4, N]      (scores, keys on M)
    acc_j^T [d/4, N] += v_j^T [d / 4, keys] @ p^T [keys, N]                 (values, words on M)

so a decode step's 64-key tile runs its softmax on 64 x 8 scores instead of 16 x 64, the accumulators
hold [d, 8] instead of [16, d] (half the registers: 16 one-warp programs per SM at 32-key tiles), and
half the tensor-core instructions are issued. Verify steps (1 + k tokens) put (token, head) pairs on N
(5 x 4 -> 32), causal among the tokens; where the real columns fill little more than half of that, two
column groups (16 + 8) share each decoded slice (`col_groups`: 4bit_nc 32 x 5 x 32K 0.847 -> 0.707 ms on
the H100, eighteenth session). The decoding of the packed words is the same elementwise slice
decoders as `paged_decode` (inline-PTX shuffles / magic numbers on the GPU, fp16 gathers in the
interpreter): a register pair holds two consecutive words of one key (scores) or one word of two
consecutive keys (values), as there, except 2-bit codebook values: their byte words stay bytes, four
per register, decoded by byte permutes (`byte_values`, `paged_decode.prmt_slices_b8`). 4-bit codebook keys of
16-bit models skip the fp16 slices (`KEYS_I8`): their centroids lie on an int8 grid, so a tile decodes to int8
numbers four per byte permute and its scores are integer dots against a fixed-point query, in two halves of
d / 2 coordinates (8 w + i and 8 w + 4 + i). Split-K fills one wave of resident programs (`pick_splits`).

Served here: steps of up to MAX_QUERY_LEN tokens per request with at most MAX_COLS columns over the
`paged_decode.eligible` layouts (2- / 3- / 4- / 5-bit codebook or fp8 keys, 2- / 3- / 4-bit codebook or min-max
or fp8 values; fp8 bytes come in 4-byte words, sliced like 4-bit codes, `paged_decode.fp8_slices`).
3-bit codes come in groups of 8 (3 bytes of the bit stream, `paged_decode._groups3`), so
their dots take 8 slices of d / 8 coordinates instead of 4 of d / 4 (SK / SV).
Layouts with exact sink / window copies (tq3) come here too: the packed loop masks the pairs the
exact rule claims, and split 0 of every (request, KV head) is a program of its own that reads those
keys and values from the fresh tensors, the ring and the sink buffer (unrotated query, exact values
accumulated in the output's second part), so the packed programs carry none of its registers (an
exact pass after each split's packed loop held the kernel at 255 registers). The output contract
(split-K partials, log-sum-exp, rotated values, the exact part) is `paged_decode`'s; its launcher
calls `plan` and `launch` here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqserve.attention import paged_decode
from tqserve.attention.paged import (
    CODEBOOK,
    DENSE,
    LAST_LAUNCH,
    MINMAX,
    _exact_masks,
    _interpreting,
    _load_exact,
    _tile_rows,
    _token_scalars,
    rows32,
)
from tqserve.attention.paged_decode import (
    _asm_slice4,
    _cb_slice,
    _mm_terms,
    _spread3,
    _v_slice,
    _words,
    _x_range,
    _x_tile,
    slices,
)
from tqserve.attention.rotate import hadamard_table
from tqserve.attention.tuning import NARROW_MAX_SPLITS

ENABLED = True  # benchmarks / tests switch this path off to compare with `paged_decode`'s kernel
# 32-bit page rows and addresses (`paged.rows32`) where every page tensor is under 2 GiB; 0: 64-bit always.
# With the unsigned block-table arithmetic of `_tile_rows`, sm_90 4bit_nc decode loop 888 -> 820 (unsigned)
# -> 789 (32-bit) instructions per 32-key tile. H200, CUDA-graph replays, medians of 3 rounds, signed / unsigned
# / unsigned + 32-bit (twenty-eighth session): 4bit_nc 32 x 32K 0.466 / 0.450 / 0.426 ms, 1 x 128K 0.0738 /
# 0.0717 / 0.0703; tq3 0.453 / 0.444 / 0.439; 3bit_nc 0.852 / 0.808 / 0.778; verify 32 x 5 x 32K 4bit_nc
# 0.679 / 0.671 / 0.668, tq3 0.713 / 0.702 / 0.697.
ROWS32 = 1
# Decode steps (at most DECODE_COLS columns) by layout (key bits, value mode, value bits, head size, exact
# copies): (DEFER: the softmax denominator and min-max zero terms summed per key row and reduced once after
# the loop, not across lanes per tile; LAZY: the lazy rescale below; LANES: lazy steps keep per-lane sums,
# `LANE_SUMS`). Others do none of them. Chosen by
# measurement: H200, CUDA-graph replays, medians of 3 rounds, one call (twenty-ninth session), 32 x 32K ms,
# neither / deferred / lazy / both:
#   4bit_nc        0.4278 / 0.4173 / 0.4274 / 0.4213  (1 x 128K 0.0707 / 0.0693 / 0.0694 / 0.0699)
#   3bit_nc        0.8638 / 0.8858 / 0.8859 / 0.8432  (1 x 128K 0.128 / 0.131 / 0.130 / 0.125)
#   4bit_nc d=256  0.2562 / 0.2592 / 0.2425 / 0.2445  (16 / 2 heads)
#   tq3            0.4394 / - / 0.4362 / -            (exact copies: never deferred)
# and neither for k3v4_nc (0.4998 / 0.5142 / 0.5046 / 0.5139), tq_k4v4_nc (0.5352 / 0.5724 / 0.5371 /
# 0.5999; d = 64 and 256 alike) and 4bit_nc at d = 64 (64 x 4K: 0.0428 / 0.0438 / 0.0432 / 0.0441). Verify
# steps are the same either way. With int8 keys (`KEYS_I8`, forty-first session, H200, one call) 4bit_nc at d =
# 128 takes both: deferred / both 0.3841 / 0.3694 ms (1 x 128K 0.0666 / 0.0642). Forty-second session, H200,
# one call: lazy with per-lane sums (LANES) instead of deferred ones, 0.3693 -> 0.3635 ms (1 x 128K
# 0.0643 -> 0.0637; tq3, whose exact copies never defer, 0.3909 -> 0.3921 with lane sums, so it keeps none); with
# the whole-row split-K combine, session start -> both, two calls: 0.3736 -> 0.3654, 0.3736 (call 2) -> 0.3658.
DECODE_COLS = 8
DECODE_SUMS: dict[tuple[int, int, int, int, bool], tuple[bool, bool, bool]] = {
    (4, MINMAX, 4, 128, False): (False, True, True),
    (3, MINMAX, 3, 128, False): (True, True, False),
    (4, MINMAX, 4, 256, False): (False, True, False),
    (4, CODEBOOK, 2, 128, True): (False, True, False),
}
DEFER_SUMS = 1  # 0: never defer (A/B knob)
LAZY_DECODE = 0  # 1: every decode step rescales lazily (A/B knob)
# Lazy-rescale steps keep per-lane partial sums of the softmax denominator and min-max zero terms
# (`_lane_sums`), reduced across lanes after the loop: 0 never, 1 in verify steps and the lazy decode steps of
# the layouts DECODE_SUMS gives LANES, 2 in every lazy step.
# H200 32 x 5 x 32K verify, ms off / on: 4bit_nc 0.668 / 0.629, tq3 0.736 / 0.684, k3v4_nc 0.742 / 0.672,
# 3bit_nc 1.116 / 1.061; tq3's lazy decode steps lose 1% with them (0.4324 / 0.4364).
LANE_SUMS = 1
# A split's whole tiles in a loop without per-pair masks, its edge tiles (the partial last one, the causal
# ones; with exact copies the window and the sink edge) in loops that mask: 0 never, 1 where it was measured
# faster (min-max values at d = 128 without exact copies in every step, `TAIL_VERIFY` in verify steps), 2
# every layout. (A branch inside the one loop that skipped the masks on whole tiles, `PEEL_MASK` until the
# thirtieth session, was slower: verify 4bit_nc 0.629 -> 0.652 ms, tq3 0.684 -> 0.700; decode 4-9%.)
# Offline sm_90 instructions per 32-key tile on the common path: 4bit_nc verify 1,072 -> 1,027, tq3 1,214 ->
# 1,165 (but 27 spill instructions). H200, 32 x 32K, CUDA-graph replays, medians of 3 rounds, ms, one loop /
# verify steps only / every step (thirtieth session): verify (x 5) 4bit_nc 0.6327 / 0.6213 / 0.6197, k3v4_nc
# 0.6431 / 0.6195 / 0.6197, 3bit_nc 1.018 / 1.001 / 1.002, tq4 1.252 / 1.233 / 1.231, tq3 0.6846 / 0.7516 /
# 0.7506; decode 4bit_nc 0.4185 / - / 0.4136, 3bit_nc 0.8427 / - / 0.8268, k3v4_nc 0.4620 / - / 0.4583, tq4
# 1.024 / - / 1.022, tq3 0.4347 / - / 0.4834.
TAIL_MASK = 1
# Layouts (key bits, value mode, value bits, head size, exact copies) whose verify steps, not their decode
# steps, were faster with the split loop. H200, one loop / split, ms, 32 x 5 x 32K: tq4 1.252 / 1.233 (thirtieth
# session; 1.250 / 1.227 on the branch `tail-two-loops`, decode 1.018 / 1.018); thirty-first session: tq_k4v4_nc
# 0.7531 / 0.7311 (decode 0.5377 / 0.5567), tq_k4v4_ub 0.7528 / 0.7308 (decode 0.534 / 0.553); 9 / 3 / 64 heads,
# 64 x 5 x 4K, 4bit_nc 0.0554 / 0.0535 (decode 0.0427 / 0.0435). Slower, so left out: tq3 and tq_k4v2_nc (2-bit
# codebook values: verify 0.683 / 0.737 and 0.673 / 0.720, decode 0.434 / 0.477 and 0.462 / 0.458), tq_k4v4_nc
# at d = 64 (verify 0.0629 / 0.0636); 4bit_nc and 3bit_nc decode at 16 / 2 / 256 heads gained under 1% (0.2420 /
# 0.2401, 0.4265 / 0.4260), so they keep one loop too.
TAIL_VERIFY = {
    (5, CODEBOOK, 3, 128, True),
    (4, CODEBOOK, 4, 128, False),
    (4, MINMAX, 4, 64, False),
}
MAX_QUERY_LEN = 8  # verify steps of up to 7 drafts
MAX_COLS = 32  # (query tokens x heads of a group) per program; more stay on `paged_decode`
# Steps whose real columns fill little more than half of the padded N (verify with a GQA group of 4:
# 5 x 4 = 20 of 32) run two column groups, N / 2 and 8 wide, over the same decoded key and value
# slices: 24 columns of softmax, accumulators and tensor-core work instead of 32 (0: one group).
SPLIT_COLS = 1
# Register cap of d < 128 kernels of exact-copy layouts (0: none), decode (8 columns) / wider steps
# (tq3 at SmolLM2's 9 / 3 / 64, 64 x 4K, tenth session: decode 128 -> 0.0602 ms, 168 0.0636, none
# 0.0634; verify 64 x 5 x 4K 168 -> 0.0875, none 0.0895, 128 0.0962).
SMALL_D_EXACT_DECODE_MAXNREG = 128
SMALL_D_EXACT_MAXNREG = 168
MAXNREG = 0  # register cap of every other configuration (0: the compiler's choice); benchmarks sweep it
# Launch table (warps, key tile, pipeline stages), tuned on the H100 with CUDA-graph replays
# (`benchmarks/decode_ab.py --variants`, docs/benchmarks.md, ninth session), one warp throughout:
# - d = 128, min-max values: 32-key tiles, 3 stages (128 registers: 16 programs per SM);
# - d = 128, codebook values (shuffle tables, more registers): 64-key tiles, 3 stages (32-key
#   tiles 10% slower at 32 x 32K; 3 stages since the fifteenth session, `CB_VALUES_STAGES`);
# - d = 256: 32-key tiles, 2 stages (tq_k4v4_nc, 16 / 2 heads, 32 x 32K: 26% faster than 64);
# - d >= 128 with exact copies: 64-key tiles, 3 stages at d = 128 (`EXACT_STAGES`), 2 above;
# - d < 128: 64-key tiles, 3 stages (with exact copies registers capped, `SMALL_D_EXACT_MAXNREG`);
# - more than 16 columns (verify steps of GQA groups of 4 and more): 32-key tiles, 3 stages (32 x 5 x
#   32K, eleventh session, same call: 4bit_nc 2 stages 1.046 ms, 3 stages 1.001; tq3 1.085 either way;
#   two warps 1.386 / 1.292, two warps x 64-key tiles 1.081 / 1.106, four x 64 1.56, 64-key tiles
#   1.25 / 1.736, 16-key tiles 1.155 / 1.102. The ninth session's 3 stages (1.69) predate the lazy
#   rescale and the exact-pairs program).
# Lazy online-softmax rescaling (0: off): the [d, N] accumulators are rescaled only when a column's
# running maximum grows by more than LAZY_TAU (log2 units; p stays below 2^LAZY_TAU, fine for the fp16
# p x scale operand and the float32 sums), for steps of at least LAZY_MIN_COLS columns.
# H100, tenth session, 4bit_nc 32 x 5 x 32K: tau 8 1.081 ms, off 1.120 (3 and 8 alike); decode steps
# (8 columns) gain nothing (0.545 vs 0.529 ms at 32 x 32K), so only verify steps take it, and the decode
# steps of the layouts `DECODE_SUMS` lists.
LAZY_TAU = 8.0
LAZY_MIN_COLS = 32
# Per-token fp16 scalars (norms, scales, zeros) read through their 32-bit words, which the pipeliner
# copies ahead (`paged._token_scalars`): 1 where it pays (`pair_scalars`), 2 everywhere, 0 nowhere
# (one 2-byte load per key, waited on inside each key tile). H100, fourteenth session (docs/benchmarks.md):
# 32 x 5 x 32K verify tq3 1.078 -> 0.955 ms, tq_k4v4_ub 0.991 -> 0.889, 4bit_nc 1.008 -> 0.850; 4bit_nc
# decode (at MM4_MAXNREG) 32 x 32K 0.521 -> 0.478, 1 x 128K 0.091 -> 0.080; decode with codebook values
# (tq_k4v4_ub, 254 registers either way) 0.576 -> 0.601, so those keep the 2-byte loads.
PAIR_SCALARS = 1
# Rotate the query inside the kernel (`rotates_query`) instead of a `rotate_rows` launch before it
# (1 x 128K: 3.3 of ~80 us). QROT = 1 does it for every eligible step (A/B timing; tests check it
# against `rotate_rows`); by default decode steps with 4-bit keys at d = 128 do: over exact-copy layouts
# with the L2 prefetch of their first pages (`QROT_EXACT_DECODE`), over the others parked (`PARK_DECODE`,
# below). The query is read in
# one load and its slices cut in registers (twenty-first session; one dependent load per slice before).
# H100, twenty-first session, CUDA-graph replays, medians of 3 rounds, same call (off / on / on +
# prefetch):
# - tq3 decode 32 x 32K 0.4656 / 0.4636 / 0.4576 ms, 1 x 128K 0.0817 / 0.0797 / 0.0791;
# - turboquant_4bit_nc (128 registers) decode 0.4795 / 0.5174 / 0.5193, 1 x 128K 0.0816 / 0.0834 / 0.0843:
#   the key loop takes 3% more instructions with a rotated query (16 shuffles and permutes per tile);
# - turboquant_k3v4_nc 0.5101 / 0.5155 / 0.5112, 1 x 128K 0.0831 / 0.0803 / 0.0849;
# - verify 32 x 5 x 32K slower for all three (tq3 0.828 / 0.891 / 0.870).
# Second call, default (rotation + prefetch) / off: tq3 0.4567 / 0.4667, 1 x 128K 0.0783 / 0.0808;
# tq_k4v3_ub_s4_w128 0.9008 / 0.9028, 0.1422 / 0.1414; 3-bit keys (tq_k3v2_ub_s4_w16, 8 slices) 0.4924 /
# 0.4889, 0.0852 / 0.0863: so 4-bit keys only.
QROT = 0
QROT_EXACT_DECODE = 1
# Park the in-kernel rotated query (`_park_q4`): the rotation's slices are written to this program's own
# output row (its split-K partial, or the output itself; both written last) and read back in the layout
# the key dots load a pre-rotated query in, so the key loop is the one without the rotation (held in
# registers across the loop, the rotated slices cost 4bit_nc's 128-register loop 16 shuffles and
# permutes per 32-key tile: 887 -> 917 sm_90 instructions; parked: 890). PARK_DECODE: decode steps with
# 4-bit keys at d = 128 over layouts without exact copies rotate in the kernel this way instead of a
# `rotate_rows` launch; PARK = 1 parks wherever the kernel rotates (A/B). H100, twenty-second session,
# CUDA-graph replays, medians of 3 rounds, same call (off -> PARK_DECODE):
# - turboquant_4bit_nc 1 x 128K 0.0808 -> 0.0801 ms, 32 x 32K 0.4786 -> 0.4725;
# - with the L2 prefetch of the first pages too (`PARK_PREFETCH`): 0.0816, 0.4767 (not taken);
# - PARK = 1 on tq3's exact-copy decode (rotated in the kernel already): 0.0786 -> 0.0815 ms,
#   0.4571 -> 0.4674, although its loop is 26 instructions shorter (1,883 -> 1,857); not taken.
PARK = 0
PARK_DECODE = 1
# The in-kernel rotation's Hadamard dots on 16-bit operands (the query's own dtype; +-1 and a 16-bit query
# are exact either way, the float32 sums round alike): m16n8k16 dots instead of tf32 m16n8k8 ones, half
# the tensor-core instructions and no float32 operand registers (0: float32 operands, tf32 dots), with H
# loaded from a table (`hadamard_table`); parked rotations only (2: every in-kernel rotation). Not under the
# interpreter, whose bf16 dots are wrong (triton 3.9: ~1e10 errors), nor in float32 models. H100, twenty-fifth
# session, CUDA-graph replays, medians of 3 rounds (on / 0 / the module before this session's prologue cuts):
# H built in registers, 4bit_nc 1 x 128K 0.0796 / 0.0800 / 0.0802 ms; H from the table, 0.0803 / 0.0804 /
# 0.0804 (another card; within noise); tq3's held rotation at ROT16 = 2: 32 x 32K 0.4629 against 0.4562.
ROT16 = 1
PARK_PREFETCH = 0  # PARK_DECODE steps also prefetch their first pages (as `exact_decode_rotation`'s)
# Undo the value rotation in each program's epilogue (`unrotates_values`): the accumulators of codebook
# values are in the rotated space, and R^T = diag(s) H / sqrt(d) is applied to them before the split's
# partial (or the output) is written, as one [d / S, d / S] Hadamard dot per slice and a butterfly across
# the slices (`_unrotate4`, `_unrotate8`). The split-K combine is linear, so it then writes the step's
# output itself and `finish._finish_kernel` (the rotation back, one more launch) is not needed. Verify
# steps do it (VROT); decode steps keep the launch (VROT_DECODE): their programs are short (8-16 key
# tiles at 1 x 128K) and the epilogue's ~1,000 sm_90 instructions (tf32x3 dots, layout conversions)
# plus a loop the compiler allocates ~1% longer cost more than the launch. H100, twenty-third session,
# CUDA-graph replays, medians of 3 rounds, same call (on / off):
# - verify 32 x 5 x 32K: tq3 0.7735 / 0.8280 ms, tq_k4v4_ub 0.7834 / 0.8131, tq_k4v4_nc 0.7839 / 0.8144;
# - decode 32 x 32K: tq3 0.4674 / 0.4573, tq_k4v4_ub 0.6008 / 0.5645; 1 x 128K: tq3 0.0869 / 0.0789,
#   tq_k4v4_ub 0.1027 / 0.0993.
VROT = 1
VROT_DECODE = 0
# At d = 256 the epilogue's [64, 64] Hadamard dots cost ~9,000 sm_90 instructions per program (tq3 verify
# 12,080 -> 20,936, offline), against ~1,000 at d = 128; not timed, so larger heads keep the finish launch.
VROT_MAX_D = 128
# 2-bit codebook values loaded as byte words and decoded four per register by byte permutes
# (`paged_decode.prmt_slices_b8`: 1.5 integer instructions per code where the two-words-per-register
# decoders take 2.5 and a byte -> 16-bit unpacking), in decode / wider steps (0: the word decoders of
# `paged_decode.pair_tables`). tq3's 64-key decode tile: 2,022 -> 1,832 instructions (sm_90 SASS).
# H100, nineteenth session, CUDA-graph replays, off -> on: tq3 32 x 32K 0.489 -> 0.467 ms, 1 x 128K
# 0.0832 -> 0.0804, verify 32 x 5 x 32K 0.863 -> 0.845; tq_k4v2_ub verify 0.788 -> 0.732.
BYTE_VALUES = 1
BYTE_VALUES_VERIFY = 1
# The byte words' rows reordered (`_value_rows`): word (d / 32) r + m goes to row 8 m + r, so the rows
# r, r + 8, r + 16, r + 24 that one thread holds in the value dot's A operand are 4 adjacent bytes of a
# key: one 32-bit shared-memory load where it took 4 byte loads (tq3's 64-key decode tile: 64 LDS.U8 ->
# 16 LDS.32 + 4 LDS.128, 1,832 -> 1,828 SASS instructions, the value copies 8- -> 16-byte cp.async).
# H100, twentieth session, CUDA-graph replays, medians of 3 interleaved rounds, same call (on / off):
# tq_k4v2_ub decode 32 x 32K 0.4981 / 0.5348 ms; tq3 decode (with EXACT_MAXNREG = 168) 0.4635 /
# 0.4859; tq3 verify 32 x 5 x 32K 0.8246 / 0.8433; tq_k4v2_ub verify 0.7532 / 0.7372 (so off there).
VALUE_ROWS = 1  # decode
VALUE_ROWS_VERIFY = 0  # verify, layouts without exact copies
# verify, layouts with exact copies: off since the thirty-third session (H200, tq3 32 x 5 x 32K, three calls over
# two sessions: 0.6874 -> 0.6807, 0.6834 -> 0.6795, 0.6861 -> 0.6801 ms; tq4 1.220 / 1.221)
VALUE_ROWS_VERIFY_EXACT = 0
# L2 prefetch of each packed program's first pages before anything waits (`_prefetch_first_pages`):
# PREFETCH x stages x 32 keys' worth of pages (0: off; steps that rotate their query by the tuned rule
# take 1). Alone it only adds requests (H100, twenty-first session: 4bit_nc 1 x 128K 0.0809 -> 0.0834
# ms, tq3 0.0810 -> 0.0825); it pays where the in-kernel rotation holds the first tile back.
PREFETCH = 0
NUM_WARPS = 1
BLOCK_N = 32
NUM_STAGES = 3
CB_VALUES_BLOCK_N = 64
# d = 128 decode over codebook values: 3 stages (H100, fifteenth session, tq_k4v4_ub 2 -> 3: 32 x 32K 0.579 ->
# 0.566 ms, 1 x 128K 0.0979 -> 0.0965; capped at 168: 0.647; 32-key tiles x 128: 0.580)
CB_VALUES_STAGES = 3
# ... and a register cap of 168 (12 one-warp programs per SM instead of 8 at 254 registers; H100,
# twentieth session, same call: tq_k4v4_ub 32 x 32K 0.5955 -> 0.5699 ms, 0.5977 -> 0.5717 in a second
# set; tq_k4v2_ub 0.5005 -> 0.4981; 1 x 128K unchanged)
CB_VALUES_MAXNREG = 168
# d = 128 decode with 4-bit min-max values (no exact copies): the word loads of the scalars take 14
# registers more (142), which would cost 4 of 16 programs per SM; capped, 4bit_nc 32 x 32K 0.562 ->
# 0.527 ms in an A/B build (no spills; 0.478 with the zeros loaded where the softmax uses them, as the
# kernel does). 3-bit values spill at 128 (see MM3_MAXNREG).
MM4_MAXNREG = 128
# d = 128 decode with 3-bit min-max values (turboquant_3bit_nc): uncapped the kernel takes 241 registers, 8
# one-warp programs per SM; at 168 it keeps 12 for 7 spill instructions (H200, thirty-third session, CUDA-graph
# replays, medians of 3 rounds, two calls: 32 x 32K 0.8247 -> 0.7702 and 0.8212 -> 0.7751 ms, 1 x 128K 0.1206
# -> 0.1121 and 0.1209 -> 0.1127; 144 / 152 / 176 registers 0.8467 / 0.8221 / 0.8516. Its verify steps keep no
# cap: 0.9928 -> 1.12 at 168)
MM3_MAXNREG = 168
# 3-bit keys with 4-bit min-max values (turboquant_k3v4_nc): 2 stages (H100, fourteenth session, 3 -> 2:
# 32 x 32K 0.527 -> 0.505 ms, 1 x 128K 0.0835 -> 0.0808; 4bit_nc alike within 1%, kept at 3)
K3V4_STAGES = 2
WIDE_D_BLOCK_N = 32
WIDE_D_STAGES = 2
# d >= 128 with exact copies: 64-key tiles (tq3, 32 x 32K: 0.579 ms; 32-key tiles at 128 registers 0.575),
# 3 stages at d = 128 (H100, fifteenth session, 2 -> 3 stages: 32 x 32K 0.545 -> 0.528 ms, 1 x 128K 0.0867 ->
# 0.0840; 243 registers; capped at 168 / 200: 0.541 / 0.594; 128-key tiles 0.610; 32-key tiles x 168 0.561)
EXACT_BLOCK_N = 64
# d = 128 decode with exact copies: a register cap of 168, 12 one-warp programs per SM instead of 8 at
# 254 registers (H100, twentieth session, tq3 32 x 32K, medians of 3 rounds, value rows on: 0.4749 ->
# 0.4635 ms; 0.4645 against 0.4649 / 0.476 in another call; with the value rows off the cap costs:
# 0.4705 -> 0.4859)
EXACT_MAXNREG = 168
EXACT_STAGES = 3
EXACT_WIDE_D_STAGES = 2
SMALL_D_BLOCK_N = 64
SMALL_D_STAGES = 3
# 5-bit keys (`paged_decode.NARROW_KEYS5`): 32-key tiles at most. Their groups take two int32 per 8 codes,
# twice the registers of 4-bit keys' int16 words: sm_90, offline, tq4 decode at 64-key tiles (capped at 168
# registers) 2,336 instructions per tile and 29 spill instructions, at 32-key tiles 1,212 and none;
# tq_k5v4_nc 1,958 (2 spills) against 1,040. H200, tq4, 64-key tiles against 32: 32 x 32K decode 1.096 / 1.128 ms,
# 1 x 128K 0.166 / 0.162, verify 1.353 / 1.356 (twenty-seventh session) - within 3%, kept at 32 (no spills).
KEYS5_BLOCK_N = 32
VERIFY_NUM_WARPS = 1  # more than 16 columns (verify steps: 5 tokens x 4 heads)
VERIFY_BLOCK_N = 32
VERIFY_STAGES = 3
# Verify at d >= 128 with 2-, 4- or 5-bit keys: 5 stages. Triton 3.6 pipelines the page-table load and the
# tile loads that depend on it one stage apart each, and waits for all of them at the top of the loop: with 3
# stages the tile loads go out one tile ahead, at the end of the previous tile's work, and a warp then waits
# the whole memory latency per tile (ncu on an H200, 4bit_nc 32 x 32K decode: 16% of the stall samples at the
# loop's barrier); 5 stages put them two tiles ahead. H200, CUDA-graph replays, medians of 3 rounds,
# 32 x 5 x 32K (twenty-seventh session): tq3 0.756 -> 0.713 ms, 4bit_nc 0.695 -> 0.680, tq4 1.356 -> 1.342;
# 3-bit keys slower (3bit_nc 1.107 -> 1.136), so they keep 3. Decode steps gained nothing (the wait turns
# into shuffle and shared-memory stalls: 4bit_nc 0.468 -> 0.465, tq3 0.454 -> 0.476).
VERIFY_WIDE_STAGES = 5
# (no register cap: at 168, H100, twentieth session, medians of 3 rounds, 32 x 5 x 32K: tq3 0.8316 ->
# 0.8434 ms, tq_k4v4_ub 0.8132 -> 0.8746, tq_k4v2_ub 0.738 -> 0.899)
# Split-K fills one wave: (request, KV head) pairs x splits <= the programs the SMs keep resident
# (from the compiled kernel's registers and shared memory, `resident_per_sm`; a guess by key tile
# until the first launch). A second, partial wave costs a whole program time (H100, 32 x 32K:
# 9 splits, 2,304 programs for 2,112 resident slots, were 30% slower than 7).
WAVE_FILL = 1.0
# 1 x 128K, 8 KV heads: 264 splits fill the 2,112 slots of 16 per SM (257 after rounding to whole
# tiles, 2,056 programs; H100, eleventh session: 91.1 us against 95.5 us at the old cap of 256, which
# rounded to 228 splits, 1,824 programs)
MAX_SPLITS = NARROW_MAX_SPLITS
GUESS_PER_SM = {32: 16, 64: 8, 128: 4}
_RESIDENT: dict[tuple, int] = {}  # launch key -> resident programs per SM of its compiled kernel


# 4-bit codebook keys as int8 (KI8): the codec's 4-bit centroids lie on the grid (x + 1/2) g with int8 x
# (`kvquant.codebooks.grid_codebook`), so a key tile's sign-magnitude codes decode to x by byte permutes, four
# codes per PRMT and 9 integer instructions per 8 codes (`i8_keys_ptx`; the fp16 shuffle decoders take 20, 8 of
# them shuffles on the shared-memory pipe), and its scores are integer tensor-core dots (m16n8k32) against the
# query in 15-bit fixed point as two int8 halves: s = g scale (256 (x . q_hi) + x . q_lo + sum(q) / 2), exact in int32.
# 16-bit models only (float32 models keep the float32 centroids, `centroid_tables`: a 15-bit query is not
# float32 precision); 0: the fp16 slice decoders, for A/B timing.
KEYS_I8 = 1
Q_FIX = 32639  # the fixed-point query's largest |value|: 127 * 256 + 127, so both int8 halves stay in range


def keys_i8(layout, head_dim: int, model_f32: bool, max_query_len: int = 1) -> bool:
    """Whether a step's 4-bit codebook keys take the int8 path (`KEYS_I8`): 16-bit models, head sizes with
    at least 32 bytes of codes per key (the K of an int8 dot); decode steps, and verify steps over min-max
    values (measured: H200, 32 x 5 x 32K, fp16 slices -> int8 keys: 4bit_nc 0.608 -> 0.565 ms, but tq3 0.682
    -> 0.768 and tq_k4v4_nc 0.724 -> 0.736, whose codebook values hold more registers; with sign-magnitude codes,
    `KEYS_I8 = 2`, tq3 0.671 -> 0.726 still)."""
    four = layout.key_mode == CODEBOOK and layout.key_bits == 4 and head_dim // 2 >= 32
    step = max_query_len <= 1 or layout.val_mode == MINMAX or KEYS_I8 == 2  # 2: every step (A/B knob)
    return bool(KEYS_I8) and four and step and not model_f32


def i8_keys_ptx(x: list[int]) -> str:
    """PTX of the int8 key decoder: $2 holds 4 bytes of a key's code stream (8 sign-magnitude 4-bit codes,
    `reference.code_order`; coordinate 8 w + i in nibble i), $0 / $1 get the int8 centroid numbers x of nibbles
    0-3 / 4-7. x is indexed by code: a code (s, r) (s = bit 3, r = bits 0-2) has x = T[r] when s (the positive
    half) and ~T[r] otherwise (the grid is symmetric: x_code(r) = ~x_code(8 + r)). One PRMT lookup of the 8
    magnitudes per 4 codes, with the masked nibbles as selectors; a PRMT that turns the nibbles' bit 3 into
    byte masks (sign-replicate selectors over the word and the word << 4); one LOP3 (p ^ ~m): 9 integer
    instructions per 8 codes and a table of two words, which ptxas keeps as PRMT operands. (Sorted codes took
    two tables and 11 instructions, and ptxas rematerialized two of the four table words from uniform
    registers at each use; timed with this decoder's instructions, H200: 4bit_nc 32 x 32K 0.3684 -> 0.3546
    ms, tq3 0.3928 -> 0.3689, 4bit_nc verify 32 x 5 x 32K 0.5547 -> 0.5295.)"""
    assert len(x) == 16 and all(x[r] == -1 - x[8 + r] for r in range(8)), "a symmetric int8 grid in code order"
    t = paged_decode._byte_words([v & 0xFF for v in x[8:]])
    body = ".reg .b32 s, sh, w4, p0, p1, m0, m1, T0, T1;\n"
    body += f"mov.b32 T0, {t[0]:#x};\nmov.b32 T1, {t[1]:#x};\n"
    body += "and.b32 s, $2, 0x77777777;\nshr.u32 sh, s, 16;\nshl.b32 w4, $2, 4;\n"
    body += "prmt.b32 p0, T0, T1, s;\nprmt.b32 p1, T0, T1, sh;\n"
    # byte j of m0: bit 3 of nibble j replicated (nibble 2k: msb of byte k of w << 4; 2k + 1: of byte k of w)
    body += "prmt.b32 m0, $2, w4, 0x9d8c;\nprmt.b32 m1, $2, w4, 0xbfae;\n"
    body += "lop3.b32 $0, p0, m0, 0, 0xc3;\nlop3.b32 $1, p1, m1, 0, 0xc3;\n"  # p ^ ~m: ~T[r] where bit 3 is clear
    return "{\n" + body + "}"


def i8_key_decoder(layout) -> str:
    """`i8_keys_ptx` of the layout's 4-bit key codebook on the GPU, "" under the interpreter (gathers from
    `i8_key_table`); cached on the layout."""
    if _interpreting():
        return ""
    cache = layout.__dict__.setdefault("_asm_cache", {})
    if "i8_keys" not in cache:
        from tqserve.kvquant.reference import tq_int8_codes

        cache["i8_keys"] = i8_keys_ptx(tq_int8_codes(4, layout.head_dim)[0])
    return cache["i8_keys"]


def i8_key_table(layout, device) -> tuple[torch.Tensor, float]:
    """(the 16 int8 centroid numbers x by stored code on `device`, the grid step g) of the layout's 4-bit keys: the
    gathers of the interpreter's int8 key path and the scores' scale. Cached per device (built in warm-up, before any
    CUDA graph is captured)."""
    cache = layout.__dict__.setdefault("_asm_cache", {})
    key = ("i8_table", str(device))
    if key not in cache:
        from tqserve.kvquant.reference import tq_int8_codes

        x, g = tq_int8_codes(4, layout.head_dim)
        cache[key] = (torch.tensor(x, dtype=torch.int8, device=device), g)
    return cache[key]


def eligible(layout, max_query_len: int, group: int) -> bool:
    """Decode and verify steps (up to MAX_QUERY_LEN tokens, at most MAX_COLS columns) of
    `paged_decode`-eligible layouts, with or without exact sink / window copies."""
    return ENABLED and max_query_len <= MAX_QUERY_LEN and cols(max_query_len, group) <= MAX_COLS


def lane_sums(layout, head_dim: int, max_query_len: int) -> bool:
    """Whether lazy steps keep per-lane partial sums (`LANE_SUMS`; decode steps by `DECODE_SUMS`)."""
    return LANE_SUMS == 2 or (LANE_SUMS == 1 and (max_query_len > 1 or _decode_entry(layout, head_dim)[2]))


def tail_mask(layout, head_dim: int, max_query_len: int) -> bool:
    """Whether a split's whole tiles run in a loop without masks (`TAIL_MASK`, `TAIL_VERIFY`)."""
    exact = bool(layout.sink or layout.window)
    measured = layout.val_mode == MINMAX and head_dim == 128 and not exact
    shape = (layout.key_bits, layout.val_mode, layout.val_bits, head_dim, exact)
    measured = measured or (max_query_len > 1 and shape in TAIL_VERIFY)
    return TAIL_MASK == 2 or (TAIL_MASK == 1 and measured)


def _decode_entry(layout, head_dim: int) -> tuple[bool, bool, bool]:
    exact = bool(layout.sink or layout.window)
    return DECODE_SUMS.get((layout.key_bits, layout.val_mode, layout.val_bits, head_dim, exact), (False, False, False))


def _decode_sums(layout, head_dim: int, n_cols: int) -> tuple[bool, bool]:
    """(DEFER, LAZY) of a step with `n_cols` columns: decode steps by `DECODE_SUMS`, others neither."""
    if n_cols > DECODE_COLS:
        return False, False
    defer, lazy, _ = _decode_entry(layout, head_dim)
    return defer, lazy or bool(LAZY_DECODE)


def lazy_tau(layout, head_dim: int, n_cols: int) -> float:
    """The lazy-rescaling threshold of steps with `n_cols` columns (0.0: rescale every tile)."""
    lazy = n_cols >= LAZY_MIN_COLS or _decode_sums(layout, head_dim, n_cols)[1]
    return float(LAZY_TAU) if lazy else 0.0


def defer_sums(layout, head_dim: int, n_cols: int) -> bool:
    """Whether a step sums its softmax denominators and min-max zero terms after the key loop (`DECODE_SUMS`;
    the kernel does so only without exact copies and a second column group)."""
    return bool(DEFER_SUMS) and _decode_sums(layout, head_dim, n_cols)[0]


def cols(max_query_len: int, group: int) -> int:
    """The N side of the dots: (query tokens) x (heads of the group), padded to a power of two, at
    least 8 (the tensor cores' n8)."""
    return max(8, triton.next_power_of_2(max(1, max_query_len) * group))


def col_groups(max_query_len: int, group: int) -> tuple[int, int]:
    """(N, N2): the widths of the program's two column groups (N2 = 0: one group of `cols`). The
    second group is the tensor cores' n8 and takes the columns past N when at most 8 remain."""
    n = cols(max_query_len, group)
    real = max(1, max_query_len) * group
    if SPLIT_COLS and n >= 32 and real <= n // 2 + 8:
        return n // 2, 8
    return n, 0


def launch_config(
    head_dim: int, codebook_values: bool, n_cols: int = 8, exact: bool = False, val_bits: int = 4, key_bits: int = 4
) -> tuple[int, int, int, int]:
    """(warps, key tile, pipeline stages, register cap or 0)."""
    warps, block_n, stages, cap = _launch_config(head_dim, codebook_values, n_cols, exact, val_bits, key_bits)
    if key_bits == 5:
        block_n = min(block_n, KEYS5_BLOCK_N)
    return warps, block_n, stages, cap


def _launch_config(
    head_dim: int, codebook_values: bool, n_cols: int, exact: bool, val_bits: int, key_bits: int
) -> tuple[int, int, int, int]:
    if n_cols > 16:
        stages = VERIFY_WIDE_STAGES if head_dim >= 128 and key_bits != 3 else VERIFY_STAGES
        return VERIFY_NUM_WARPS, VERIFY_BLOCK_N, stages, MAXNREG
    if head_dim < 128:
        cap = (SMALL_D_EXACT_DECODE_MAXNREG if n_cols <= 8 else SMALL_D_EXACT_MAXNREG) if exact else MAXNREG
        return NUM_WARPS, SMALL_D_BLOCK_N, SMALL_D_STAGES, cap
    if exact:
        stages = EXACT_STAGES if head_dim == 128 else EXACT_WIDE_D_STAGES
        return NUM_WARPS, EXACT_BLOCK_N, stages, MAXNREG or (EXACT_MAXNREG if head_dim == 128 else 0)
    if head_dim > 128:
        return NUM_WARPS, WIDE_D_BLOCK_N, WIDE_D_STAGES, MAXNREG
    if codebook_values:
        return NUM_WARPS, CB_VALUES_BLOCK_N, CB_VALUES_STAGES, MAXNREG or CB_VALUES_MAXNREG
    cap = MAXNREG or (MM4_MAXNREG if val_bits == 4 and PAIR_SCALARS else MM3_MAXNREG if val_bits == 3 else 0)
    return NUM_WARPS, BLOCK_N, K3V4_STAGES if (key_bits, val_bits) == (3, 4) else NUM_STAGES, cap


def rotates_query(layout, head_dim: int, max_query_len: int = 1) -> bool:
    """Whether the kernel rotates the query itself: a power-of-two head size (R is one randomized
    Hadamard block, `kvquant.rotation`) with at least 16 coordinates per slice (the dot's minimum),
    for every step with `QROT`, else decode steps with 4-bit keys at d = 128 (`exact_decode_rotation`
    over exact-copy layouts, `park_decode` over the others); otherwise `rotate.rotate_rows` runs
    before the launch."""
    sk = paged_decode.slices(layout.key_bits)
    if not (head_dim & (head_dim - 1) == 0 and head_dim // sk >= 16 and layout.key_rotation is not None):
        return False
    tuned = exact_decode_rotation(layout, head_dim, max_query_len) or park_decode(layout, head_dim, max_query_len)
    return bool(QROT) or tuned


def _rotating_decode(layout, head_dim: int, max_query_len: int) -> bool:
    """Decode steps with 4-bit keys at d = 128: the steps whose kernel rotates the query by default."""
    return max_query_len <= 1 and head_dim == 128 and layout.key_bits == 4


def park_decode(layout, head_dim: int, max_query_len: int) -> bool:
    """Those over layouts without exact copies: the kernel rotates the query and parks it (`PARK_DECODE`)."""
    exact = bool(layout.sink or layout.window)
    return bool(PARK_DECODE) and not exact and _rotating_decode(layout, head_dim, max_query_len)


def exact_decode_rotation(layout, head_dim: int, max_query_len: int) -> bool:
    """Those over exact-copy layouts: the kernel rotates the query, holds it and prefetches its first
    pages (`QROT_EXACT_DECODE`)."""
    exact = bool(layout.sink or layout.window)
    return bool(QROT_EXACT_DECODE) and exact and _rotating_decode(layout, head_dim, max_query_len)


def _tuned_prefetch(layout, head_dim: int, max_query_len: int) -> bool:
    """Steps whose kernel rotates the query by a tuned rule prefetch their first pages."""
    return exact_decode_rotation(layout, head_dim, max_query_len) or (
        bool(PARK_PREFETCH) and park_decode(layout, head_dim, max_query_len)
    )


def unrotates_values(layout, head_dim: int, max_query_len: int) -> bool:
    """Whether the kernel takes codebook values out of the rotated space itself (`VROT` for verify steps,
    `VROT_DECODE` for decode steps): a power-of-two head size up to VROT_MAX_D (R = H diag(s) / sqrt(d),
    one Hadamard block) with at least 16 coordinates per slice."""
    on = VROT if max_query_len > 1 else VROT_DECODE
    sv = paged_decode.slices(layout.val_bits)
    pow2 = head_dim & (head_dim - 1) == 0 and head_dim <= VROT_MAX_D
    return bool(on) and layout.rotated_values and layout.val_rotation is not None and pow2 and head_dim // sv >= 16


def parts(layout, head_dim: int, max_query_len: int) -> int:
    """Parts of each output row the kernel writes: the exact values have one of their own (2) in exact-copy
    layouts whose packed values the finishing kernel rotates back; otherwise every split accumulates in the
    same space and the split-K combine merges the exact-pairs split like any other (1)."""
    exact = bool(layout.sink or layout.window)
    return 2 if exact and not unrotates_values(layout, head_dim, max_query_len) else 1


def rotation16(layout, head_dim: int, max_query_len: int, dtype: torch.dtype, dot_f32: bool) -> bool:
    """Whether an in-kernel rotation takes 16-bit dots with `hadamard_table` (`ROT16`): 16-bit queries,
    not under the interpreter (whose bf16 dots are wrong) and, unless ROT16 = 2, parked rotations only."""
    if not ROT16 or dot_f32 or dtype not in (torch.float16, torch.bfloat16):
        return False
    return ROT16 == 2 or parks_query(layout, head_dim, max_query_len)


def parks_query(layout, head_dim: int, max_query_len: int) -> bool:
    """Whether a kernel that rotates the query parks it (`_park_q4`)."""
    return bool(PARK) or park_decode(layout, head_dim, max_query_len)


def pair_scalars(layout, n_cols: int, scalars: tuple = ()) -> bool:
    """Whether the kernel reads the per-token scalars through 32-bit words (`PAIR_SCALARS`): every
    step but decode steps over codebook values without exact copies, and only when the scalar
    tensors given start on a 4-byte boundary (the engine allocates each page tensor alone; a view at
    an odd fp16 offset takes the 2-byte loads)."""
    if any(t.data_ptr() % 4 for t in scalars):
        return False
    if PAIR_SCALARS != 1:
        return bool(PAIR_SCALARS)
    return not (layout.val_mode == CODEBOOK and n_cols <= 16 and not (layout.sink or layout.window))


def byte_values(layout, max_query_len: int) -> bool:
    """Whether the kernel takes 2-bit codebook values as byte words (`BYTE_VALUES`)."""
    on = BYTE_VALUES if max_query_len <= 1 else BYTE_VALUES_VERIFY
    return bool(on) and layout.val_mode == CODEBOOK and layout.val_bits == 2


def value_rows(layout, max_query_len: int) -> bool:
    """Whether the kernel reorders the value words' rows (`VALUE_ROWS`, byte-word values only)."""
    if max_query_len <= 1:
        on = VALUE_ROWS
    else:
        on = VALUE_ROWS_VERIFY_EXACT if layout.sink or layout.window else VALUE_ROWS_VERIFY
    return bool(on) and byte_values(layout, max_query_len)


def prefetch_pages(block_size: int, tuned: bool = False) -> int:
    """Pages each packed program prefetches into L2 before its first tile (`PREFETCH` key tiles' worth,
    or one where `tuned`: the step rotates its query by a rule that prefetches, `_tuned_prefetch`); 0
    under the interpreter, which runs no PTX."""
    if not (PREFETCH or tuned) or _interpreting():
        return 0
    return triton.next_power_of_2(max(1, max(PREFETCH, 1) * max(NUM_STAGES, 2) * BLOCK_N // block_size))


def v3_bytes(layout, n_cols: int) -> bool:
    """Whether the kernel reads 3-bit min-max values as byte tiles (`paged_decode.MINMAX3_BYTES`):
    decode steps (at most 8 columns) only."""
    return bool(paged_decode.MINMAX3_BYTES) and layout.val_mode == MINMAX and layout.val_bits == 3 and n_cols <= 8


def resident_per_sm(n_regs: int, shared: int, warps: int, sm_regs: int = 65536, sm_shared: int = 233472) -> int:
    """Programs one SM holds at once: registers, shared memory (+1 KB the hardware reserves per block),
    threads (2,048) and the 32-block limit. Registers are allocated per warp in units of 256 from the
    file of one of the SM's 4 sub-partitions (a quarter each), so the SM keeps 4 x floor(16,384 / per-warp
    registers) warps: the CUDA occupancy calculator's warp granularity of 4. At 139 registers that is
    12 one-warp programs, not 65,536 // 4,608 = 14 (H100, thirteenth session, turboquant_3bit_nc 32 x
    32K: the 7 splits planned for 14 per SM ran 1.169 ms, 6 splits 0.883, 8-9 splits 1.03-1.04)."""
    regs_per_warp = -(-max(1, n_regs) * 32 // 256) * 256
    by_regs = 4 * (sm_regs // 4 // regs_per_warp) // warps
    by_smem = sm_shared // (shared + 1024)
    return max(1, min(by_regs, by_smem, 2048 // (32 * warps), 32))


def _record_occupancy(key: tuple, kernel, warps: int, device) -> None:
    from triton.runtime import driver

    props = driver.active.utils.get_device_properties(device.index if device.index is not None else 0)
    # max_num_regs: registers per block (= per SM on sm_80 / sm_90); max_shared_mem: the opt-in
    # per-block maximum, 1 KB below the SM's shared memory
    _RESIDENT[key] = resident_per_sm(
        kernel.n_regs, kernel.metadata.shared, warps, props["max_num_regs"], props["max_shared_mem"] + 1024
    )


def pick_splits(pairs: int, max_seq_len: int, block_n: int, per_sm: int, sms: int, exact: bool = False) -> int:
    """Split-K count of the packed keys that fills one wave of resident programs (at least 4 key tiles
    per split); with `exact`, one part less than MAX_SPLITS, so that the exact-pairs program's part
    keeps the combine within the split counts `warm_split_combine` compiled."""
    slots = int(per_sm * sms * WAVE_FILL)
    tiles = triton.cdiv(max(1, max_seq_len), block_n)
    return max(1, min(slots // max(1, pairs), tiles // 4, MAX_SPLITS - int(exact)))


def plan(
    layout,
    head_dim: int,
    group: int,
    max_query_len: int,
    pairs: int,
    max_seq_len: int,
    sms: int,
    device,
    scalars: tuple = (),
) -> tuple[int, int, int, int, tuple]:
    """(warps, key tile, stages, splits, launch key) of a step over `pairs` (request, KV head); the key
    names everything that changes the compiled kernel's registers or shared memory, the register cap
    (`launch` passes it on) last."""
    n_cols = cols(max_query_len, group)
    exact = bool(layout.sink or layout.window)
    warps, block_n, stages, maxnreg = launch_config(
        head_dim, layout.val_mode == CODEBOOK, n_cols, exact, layout.val_bits, layout.key_bits
    )
    key = (str(device), head_dim, n_cols, layout.key_bits, layout.val_mode, layout.val_bits, exact)
    key += (lazy_tau(layout, head_dim, n_cols), defer_sums(layout, head_dim, n_cols))
    key += (v3_bytes(layout, n_cols), pair_scalars(layout, n_cols, scalars))
    key += (rotates_query(layout, head_dim, max_query_len), paged_decode.pair_tables(True, max_query_len))
    key += (byte_values(layout, max_query_len), value_rows(layout, max_query_len))
    key += (PREFETCH, _tuned_prefetch(layout, head_dim, max_query_len), parks_query(layout, head_dim, max_query_len))
    key += (unrotates_values(layout, head_dim, max_query_len), ROT16)
    key += col_groups(max_query_len, group)
    key += (lane_sums(layout, head_dim, max_query_len), bool(paged_decode.KEY_PLANES_T))
    key += (
        tail_mask(layout, head_dim, max_query_len),
        paged_decode.LOOKUP,
        paged_decode.PRMT3,
        KEYS_I8,
    )
    key += (warps, block_n, stages, maxnreg)
    per_sm = _RESIDENT.get(key, GUESS_PER_SM.get(block_n, 8))
    return warps, block_n, stages, pick_splits(pairs, max_seq_len, block_n, per_sm, sms, exact), key


@triton.jit
def _q_cols(q_ptr, tok, hq, h_ok, j: tl.constexpr, qk_scale, S: tl.constexpr, D: tl.constexpr, OUT_T: tl.constexpr):
    """Slice j of the group's queries, transposed: [d / S, N] (coordinates S g + j of each head)."""
    g = tl.arange(0, D // S)
    x = tl.load(q_ptr + tok + hq[None, :] * D + g[:, None] * S + j, mask=h_ok[None, :], other=0.0)
    return (x.to(tl.float32) * qk_scale).to(OUT_T)


@triton.jit
def _sylvester(n: tl.constexpr, dtype: tl.constexpr = tl.float32):
    """Sylvester's [n, n] Hadamard matrix, H[i, j] = (-1) ** popcount(i & j), in `dtype` (n <= 256): the
    parity, folded into bit 0, becomes the sign bit of 1.0 (no integer -> float conversion, no multiply)."""
    i = tl.arange(0, n)
    x = i[:, None] & i[None, :]
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return ((x << 31) | 0x3F800000).to(tl.float32, bitcast=True).to(dtype)


@triton.jit
def _h_operand(h_ptr, n: tl.constexpr, dtype: tl.constexpr, TABLE: tl.constexpr):
    """H_n for a rotation dot: loaded from `hadamard_table` (TABLE; a vectorized load instead of the parity
    arithmetic, whose 16-bit elements the compiler stores to shared memory one by one to lay them out
    as the dot's operand) or built by `_sylvester`."""
    if TABLE:
        i = tl.arange(0, n)
        h = tl.load(h_ptr + i[:, None] * n + i[None, :])
    else:
        h = _sylvester(n, dtype)
    return h


@triton.jit
def _q_signed(q_ptr, r_ptr, tok, hq, h_ok, D: tl.constexpr, ROT16: tl.constexpr):
    """s * x for the unrotated query columns, [D, N], in one load (the slices are cut from it in registers):
    the sign of each coordinate is that of R's first row (R = H diag(s) / sqrt(D)). In the query's own
    dtype with ROT16 (16-bit queries: the rotation's dots then take 16-bit operands, exact for +-1 and a
    16-bit query, float32 sums), else float32; either way the sign bit is applied by an XOR."""
    d = tl.arange(0, D)
    x = tl.load(q_ptr + tok + hq[None, :] * D + d[:, None], mask=h_ok[None, :], other=0.0)
    sign = (tl.load(r_ptr + d).to(tl.int32, bitcast=True) >> 31) << 31  # 0 or 0x80000000
    if ROT16 and q_ptr.dtype.element_ty.primitive_bitwidth == 16:
        out = (x.to(tl.int16, bitcast=True) ^ (sign >> 16).to(tl.int16)[:, None]).to(x.dtype, bitcast=True)
    else:
        out = (x.to(tl.float32).to(tl.int32, bitcast=True) ^ sign[:, None]).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _bfly(a, b):
    return a + b, a - b


@triton.jit
def _h4(y0, y1, y2, y3):
    """H_4 across four slices (slice j = 2 a + b): the b butterfly, then the a one."""
    y0, y1 = _bfly(y0, y1)
    y2, y3 = _bfly(y2, y3)
    y0, y2 = _bfly(y0, y2)
    y1, y3 = _bfly(y1, y3)
    return y0, y1, y2, y3


@triton.jit
def _h8(y0, y1, y2, y3, y4, y5, y6, y7):
    """H_8 across eight slices (slice j = 4 a + 2 b + c): H_4 on each half, then the a butterfly."""
    y0, y1, y2, y3 = _h4(y0, y1, y2, y3)
    y4, y5, y6, y7 = _h4(y4, y5, y6, y7)
    y0, y4 = _bfly(y0, y4)
    y1, y5 = _bfly(y1, y5)
    y2, y6 = _bfly(y2, y6)
    y3, y7 = _bfly(y3, y7)
    return y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _hdot4(h, x0, x1, x2, x3, PREC: tl.constexpr):
    """H x for four slices."""
    y0 = tl.dot(h, x0, input_precision=PREC)
    y1 = tl.dot(h, x1, input_precision=PREC)
    y2 = tl.dot(h, x2, input_precision=PREC)
    y3 = tl.dot(h, x3, input_precision=PREC)
    return y0, y1, y2, y3


@triton.jit
def _rot_q4(
    q_ptr, r_ptr, h_ptr, tok, hq, h_ok, scale, D: tl.constexpr, OUT_T: tl.constexpr, PREC: tl.constexpr,
    ROT16: tl.constexpr,
):  # fmt: skip
    """The 4 slices of R q for 4 coordinates per word (`_q_cols` of the rotated query, scaled): with
    coordinate i = 4 g + j, H_D = H_{D/4} (over g) x H_4 (over j), so each slice takes one dot with
    H_{D/4} and the 4 are mixed by a 2-stage butterfly. The dots' products are exact (+-1 times a 16-bit
    query, as 16-bit operands with ROT16 or in tf32): only their float32 sums round. `scale` includes
    1 / sqrt(D)."""
    x = _q_signed(q_ptr, r_ptr, tok, hq, h_ok, D, ROT16)
    N: tl.constexpr = x.shape[1]
    x = tl.permute(tl.reshape(x, (D // 4, 2, 2, N)), (0, 3, 1, 2))  # [g, column, a, b]: i = 4 g + 2 a + b
    xb0, xb1 = tl.split(x)
    x0, x2 = tl.split(xb0)
    x1, x3 = tl.split(xb1)
    y0, y1, y2, y3 = _hdot4(_h_operand(h_ptr, D // 4, x.dtype, ROT16), x0, x1, x2, x3, PREC)
    y0, y1, y2, y3 = _h4(y0, y1, y2, y3)
    return (y0 * scale).to(OUT_T), (y1 * scale).to(OUT_T), (y2 * scale).to(OUT_T), (y3 * scale).to(OUT_T)


@triton.jit
def _park_q4(obase, h_ok, q0, q1, q2, q3, D: tl.constexpr):
    """The rotated slices written to this program's output rows obase ([1, N] pointers; the split's
    partial or the output itself, which the kernel writes last) in their own dtype, bit for bit, and
    read back: the barrier keeps the compiler from forwarding them, so the loop takes the slices in
    the layout of `_q_cols`' loads. Same values, coordinate 4 g + j of each column."""
    base = obase.to(tl.pointer_type(q0.dtype))
    g4 = 4 * tl.arange(0, D // 4)[:, None]
    m = h_ok[None, :]
    tl.store(base + g4, q0, mask=m)
    tl.store(base + g4 + 1, q1, mask=m)
    tl.store(base + g4 + 2, q2, mask=m)
    tl.store(base + g4 + 3, q3, mask=m)
    tl.debug_barrier()
    r0 = tl.load(base + g4, mask=m, other=0.0)
    r1 = tl.load(base + g4 + 1, mask=m, other=0.0)
    r2 = tl.load(base + g4 + 2, mask=m, other=0.0)
    r3 = tl.load(base + g4 + 3, mask=m, other=0.0)
    return r0, r1, r2, r3


@triton.jit
def _rot_q8(
    q_ptr, r_ptr, h_ptr, tok, hq, h_ok, scale, D: tl.constexpr, OUT_T: tl.constexpr, PREC: tl.constexpr,
    ROT16: tl.constexpr,
):  # fmt: skip
    """`_rot_q4` for 8 coordinates per group (3-bit codes): H_D = H_{D/8} x H_8, a 3-stage butterfly."""
    x = _q_signed(q_ptr, r_ptr, tok, hq, h_ok, D, ROT16)
    N: tl.constexpr = x.shape[1]
    x = tl.permute(tl.reshape(x, (D // 8, 2, 2, 2, N)), (0, 4, 1, 2, 3))  # i = 8 g + 4 a + 2 b + c
    xc0, xc1 = tl.split(x)
    xb00, xb01 = tl.split(xc0)  # c = 0; b = 0 / 1
    xb10, xb11 = tl.split(xc1)  # c = 1
    x0, x4 = tl.split(xb00)  # (a, b, c) = (0 / 1, 0, 0)
    x2, x6 = tl.split(xb01)
    x1, x5 = tl.split(xb10)
    x3, x7 = tl.split(xb11)
    h = _h_operand(h_ptr, D // 8, x.dtype, ROT16)
    y0, y1, y2, y3 = _hdot4(h, x0, x1, x2, x3, PREC)
    y4, y5, y6, y7 = _hdot4(h, x4, x5, x6, x7, PREC)
    y0, y1, y2, y3, y4, y5, y6, y7 = _h8(y0, y1, y2, y3, y4, y5, y6, y7)
    return (
        (y0 * scale).to(OUT_T), (y1 * scale).to(OUT_T), (y2 * scale).to(OUT_T), (y3 * scale).to(OUT_T),
        (y4 * scale).to(OUT_T), (y5 * scale).to(OUT_T), (y6 * scale).to(OUT_T), (y7 * scale).to(OUT_T),
    )  # fmt: skip


@triton.jit
def _unrotated(y, vr_ptr, g, j: tl.constexpr, S: tl.constexpr):
    """Slice j of H_d y times s / sqrt(d), read from R's first row (R[0, i] = s_i / sqrt(d))."""
    return y * tl.load(vr_ptr + S * g + j)[:, None]


@triton.jit
def _unrotate4(a0, a1, a2, a3, vr_ptr, D: tl.constexpr, VPERM: tl.constexpr, PREC: tl.constexpr):
    """R^T on four accumulator slices (slice j: coordinates 4 g + j, rows in `_word_rows` order), float32:
    R^T y = s * (H_D y) / sqrt(D) with H_D = H_{D/4} (over g) x H_4 (over j), so each slice takes one dot
    with H_{D/4} and a 2-stage butterfly mixes the four (as `_rot_q4`, transposed). The rows' order is a
    permutation of g's bits (`_word_rows`), which leaves H_{D/4} as it is: popcount(g & g') is that of
    the permuted bits."""
    y0, y1, y2, y3 = _hdot4(_sylvester(D // 4), a0, a1, a2, a3, PREC)
    y0, y1, y2, y3 = _h4(y0, y1, y2, y3)
    g = _word_rows(D // 4, VPERM)
    return (
        _unrotated(y0, vr_ptr, g, 0, 4), _unrotated(y1, vr_ptr, g, 1, 4),
        _unrotated(y2, vr_ptr, g, 2, 4), _unrotated(y3, vr_ptr, g, 3, 4),
    )  # fmt: skip


@triton.jit
def _unrotate8(a0, a1, a2, a3, a4, a5, a6, a7, vr_ptr, D: tl.constexpr, VPERM: tl.constexpr, PREC: tl.constexpr):
    """`_unrotate4` for 8 coordinates per group (3-bit codes): H_D = H_{D/8} x H_8, a 3-stage butterfly."""
    h = _sylvester(D // 8)
    y0, y1, y2, y3 = _hdot4(h, a0, a1, a2, a3, PREC)
    y4, y5, y6, y7 = _hdot4(h, a4, a5, a6, a7, PREC)
    y0, y1, y2, y3, y4, y5, y6, y7 = _h8(y0, y1, y2, y3, y4, y5, y6, y7)
    g = _word_rows(D // 8, VPERM)
    return (
        _unrotated(y0, vr_ptr, g, 0, 8), _unrotated(y1, vr_ptr, g, 1, 8),
        _unrotated(y2, vr_ptr, g, 2, 8), _unrotated(y3, vr_ptr, g, 3, 8),
        _unrotated(y4, vr_ptr, g, 4, 8), _unrotated(y5, vr_ptr, g, 5, 8),
        _unrotated(y6, vr_ptr, g, 6, 8), _unrotated(y7, vr_ptr, g, 7, 8),
    )  # fmt: skip


@triton.jit
def _prefetch_lines(ptr, rows0, ok, ROW_BYTES: tl.constexpr, BS: tl.constexpr):
    """Prefetch into L2 the 128-byte lines of the BS consecutive page rows from each rows0 (ok: which
    blocks to fetch; the others name the tensor's first line, which is always valid)."""
    LINES: tl.constexpr = max(1, BS * ROW_BYTES // 128)
    # a power of two of lines (3-bit rows: 6 per page); the lines past LINES name the first line
    LP: tl.constexpr = 1 if LINES <= 1 else 2 if LINES <= 2 else 4 if LINES <= 4 else 8 if LINES <= 8 else 16
    line = tl.arange(0, LP)
    base = ptr.to(tl.pointer_type(tl.int8))
    off = rows0[:, None] * ROW_BYTES + line[None, :] * 128
    addr = base + tl.where(ok[:, None] & (line < LINES)[None, :], off, 0)
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_first_pages(
    bt_row, bt_len, lo, seq_len, split_n, kvh, kp_ptr, vp_ptr, ks_ptr, vs_ptr, vz_ptr,
    HKV: tl.constexpr, BS: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, P: tl.constexpr, ZEROS: tl.constexpr,
):  # fmt: skip
    """Start the first P pages of this program's keys on their way to L2 (`PREFETCH`). A program's
    first tile otherwise waits on four dependent trips to memory: the step's offsets and length, the
    query, the block-table entries, then the pages. Here the entries are read beside the offsets (the
    row's width bounds them, not the length) and the pages requested at once, so the pipeline's own
    loads of them later find them in L2. Keys, values, their per-token scalars and (ZEROS) min-max zeros."""
    j = lo // BS + tl.arange(0, P)
    page = tl.load(bt_row + j, mask=(j < bt_len) & (lo >= 0), other=0).to(tl.int64)
    ok = (lo >= 0) & (j * BS < tl.minimum(seq_len, lo + split_n))
    rows0 = page * (HKV * BS) + kvh * BS
    _prefetch_lines(kp_ptr, rows0, ok, KB, BS)
    _prefetch_lines(vp_ptr, rows0, ok, VB, BS)
    _prefetch_lines(ks_ptr, rows0, ok, 2, BS)
    _prefetch_lines(vs_ptr, rows0, ok, 2, BS)
    if ZEROS:
        _prefetch_lines(vz_ptr, rows0, ok, 2, BS)


@triton.jit
def _word_rows(K: tl.constexpr, VPERM: tl.constexpr):
    """The word of each accumulator row: the row itself, or with VPERM (`_value_rows`) word
    (K / 8) (row % 8) + row // 8."""
    r = tl.arange(0, K)
    if VPERM:
        return (K // 8) * (r % 8) + r // 8
    return r


@triton.jit
def _value_rows(vw, VPERM: tl.constexpr):
    """Value words [K, keys] with the rows reordered (VPERM) so that the rows r, r + 8, r + 16, ... one
    thread holds in the dot's A operand are adjacent bytes of a key (one shared-memory load)."""
    if VPERM:
        K: tl.constexpr = vw.shape[0]
        BN: tl.constexpr = vw.shape[1]
        return tl.reshape(tl.permute(tl.reshape(vw, (8, K // 8, BN)), (1, 0, 2)), (K, BN))
    return vw


@triton.jit
def _store_cols(obase, acc, inv_l, h_ok, j: tl.constexpr, S: tl.constexpr, D: tl.constexpr, VPERM: tl.constexpr):
    """Accumulator slice j times the columns' 1 / l (one reciprocal per column, not a division per element)."""
    g = _word_rows(D // S, VPERM)
    tl.store(obase + g[:, None] * S + j, (acc * inv_l[None, :]).to(obase.dtype.element_ty), mask=h_ok[None, :])


@triton.jit
def _acc_cols(
    acc, pv, vw, j: tl.constexpr, vcb_ptr, VAL_MODE: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr,
    PK_T: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """acc_j^T [d / S, N] plus the value slice j [d / S, keys] times p^T [keys, N]."""
    return tl.dot(_v_slice(vw, j, vcb_ptr, VAL_MODE, BITS, ASM, PK_T), pv, acc, input_precision=PREC)


@triton.jit
def _value_slice(
    vw, j: tl.constexpr, vcb_ptr, VAL_MODE: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, PK_T: tl.constexpr,
    VB8: tl.constexpr, P3: tl.constexpr = False,
):  # fmt: skip
    """Value slice j [d / S, keys]: byte words four per register (`byte_values`, on the GPU) or `_v_slice`."""
    if VB8 and ASM != "":
        return _asm_slice4(vw, ASM).to(PK_T)
    return _v_slice(vw, j, vcb_ptr, VAL_MODE, BITS, ASM, PK_T, P3)


@triton.jit
def _scalars(ptr, tokp, nmask, PAIRS: tl.constexpr):
    """Per-token fp16 scalars of a key tile as float32: through their 32-bit words (`_token_scalars`,
    copied ahead by the pipeliner) or one 2-byte load each."""
    if PAIRS:
        return _token_scalars(ptr, tokp, nmask)
    return tl.load(ptr + tokp, mask=nmask, other=0.0).to(tl.float32)


@triton.jit
def _scale4(a0, a1, a2, a3, alpha):
    """Four [d / S, N] accumulators times alpha per column (the online-softmax rescale)."""
    return a0 * alpha[None, :], a1 * alpha[None, :], a2 * alpha[None, :], a3 * alpha[None, :]


@triton.jit
def _exact_program(
    obase, lse_row, qx_ptr, kn_ptr, vn_ptr, rk_ptr, rv_ptr, sk_ptr, sv_ptr, seqslot_ptr, sinkslot_ptr,
    req, kvh, hq, h_ok, tok_c, qpos, q_start, ctx, seq_len, stride_qxt, stride_knt, stride_vnt, qk_scale,
    HKV: tl.constexpr, D: tl.constexpr, N: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_X: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, NPART: tl.constexpr,
):  # fmt: skip
    """Split 0 of a (request, KV head) of an exact-copy layout: the exact sink / window pairs, read from
    the fresh tensors, the ring and the sink buffer with the unrotated query, accumulated in the
    output's second part (zeros in the first; NPART = 1: the only part), with their log-sum-exp for the
    split-K combine."""
    d = tl.arange(0, D)
    dot_t = kn_ptr.dtype.element_ty if not DOT_F32 else tl.float32
    qx = tl.load(qx_ptr + tok_c[None, :] * stride_qxt + hq[None, :] * D + d[:, None], mask=h_ok[None, :], other=0.0)
    qx = (qx.to(tl.float32) * qk_scale).to(dot_t)  # [d, N]
    seq_slot = tl.load(seqslot_ptr + req).to(tl.int64)
    sink_slot = tl.load(sinkslot_ptr + req).to(tl.int64)
    n_sink, sink_hi, win_lo, x_tiles = _x_range(0, seq_len, ctx, SINK, WINDOW, BLOCK_X)
    m_i = tl.full([N], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([N], dtype=tl.float32)
    accx = tl.zeros([D, N], dtype=tl.float32)
    for xt in tl.range(0, x_tiles, num_stages=1):  # a few tiles: not worth pipeline registers
        n, nmask = _x_tile(xt, 0, seq_len, n_sink, sink_hi, win_lo, BLOCK_X)
        need, ex = _exact_masks(n, qpos, ctx, SINK, WINDOW)  # ex: [columns, keys]
        kx = _load_exact(
            kn_ptr, rk_ptr, sk_ptr, n, nmask & need, d, d < D, ctx, q_start, stride_knt,
            seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
        )  # fmt: skip
        s = tl.dot(kx.to(dot_t), qx, input_precision=PREC)  # [BLOCK_X, N]
        s = tl.where(tl.trans(ex) & nmask[:, None] & (n[:, None] <= qpos[None, :]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        vx = _load_exact(
            vn_ptr, rv_ptr, sv_ptr, n, nmask & need, d, d < D, ctx, q_start, stride_vnt,
            seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
        )  # fmt: skip
        accx = tl.dot(tl.trans(vx.to(dot_t)), p.to(dot_t), accx * alpha[None, :], input_precision=PREC)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if NPART == 2:
        tl.store(obase + d[:, None], tl.zeros_like(accx).to(obase.dtype.element_ty), mask=h_ok[None, :])
    res = accx * (1.0 / l_safe)[None, :]
    tl.store(obase + (NPART - 1) * D + d[:, None], res.to(obase.dtype.element_ty), mask=h_ok[None, :])
    tl.store(lse_row, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=h_ok)


@triton.jit
def _columns(c, G: tl.constexpr, BLOCK_Q: tl.constexpr, qlen, kvh, q_start, seq_len):
    """Columns c of a program: (query token t, head h of the group), t-major. Returns (real column,
    query head, token row, query position)."""
    t = c // G
    h_ok = (t < qlen) & (c < BLOCK_Q * G)
    return h_ok, kvh * G + c % G, (q_start + t).to(tl.int64), seq_len - qlen + t


@triton.jit
def _lane_sums(x, BLOCK_N: tl.constexpr, N: tl.constexpr):
    """x [BLOCK_N, N] summed over the key rows that a tensor-core accumulator keeps in one thread (rows
    8 apart; key = 8 * register + lane / 4): [8, N] partial sums, no cross-lane traffic."""
    return tl.sum(tl.reshape(x, (BLOCK_N // 8, 8, N)), 0)


@triton.jit
def _mask_scores(
    s, n, nmask, qpos, ksc, HAS_EXACT: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr, BLOCK_Q: tl.constexpr
):
    """Scores [keys, columns] times the keys' norms; -inf for keys past the split, in verify steps keys
    after a column's query token, and pairs the exact rule claims (a pair is packed iff n >= SINK and
    qpos - n >= WINDOW). Padded columns have zero queries, so their scores stay finite."""
    if HAS_EXACT:
        keep = nmask[:, None] & (n[:, None] >= SINK) & (n[:, None] <= (qpos - WINDOW)[None, :])
    elif BLOCK_Q > 1:
        keep = nmask[:, None] & (n[:, None] <= qpos[None, :])
    else:
        keep = nmask[:, None]
    return tl.where(keep, s * ksc[:, None], float("-inf"))


@triton.jit
def _finish_group(obase, lse_row, m_i, l_i, h_ok, D: tl.constexpr, NPART: tl.constexpr, SPLIT: tl.constexpr):
    """A column group's end: zeros in the exact part (NPART = 2; split 0 holds the exact pairs), its
    log-sum-exp for the split-K combine; returns the reciprocal of its accumulators' divisor."""
    if NPART == 2:
        d = tl.arange(0, D)
        tl.store(obase + D + d[:, None], tl.zeros([D, h_ok.shape[0]], dtype=obase.dtype.element_ty), mask=h_ok[None, :])
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if SPLIT:
        tl.store(lse_row, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=h_ok)
    return 1.0 / l_safe


@triton.jit
def _i8_keys(kp_ptr, tokp, nmask, kx_ptr, D: tl.constexpr, ASM: tl.constexpr):
    """A key tile's int8 centroid numbers as two [keys, D / 2] halves (`KEYS_I8`): element 4 w + i of the first
    is coordinate 8 w + i, of the second 8 w + 4 + i (i < 4). On the GPU from the tile's code bytes, four per
    register (`i8_keys_ptx`); under the interpreter gathered from the table at kx_ptr."""
    NB: tl.constexpr = D // 2  # code bytes per key: coordinates 2 b (low nibble) and 2 b + 1
    bp = kp_ptr.to(tl.pointer_type(tl.uint8)) + tokp[:, None] * NB
    if ASM != "":
        w = tl.load(bp + tl.arange(0, NB)[None, :], mask=nmask[:, None], other=0)
        k0, k1 = tl.inline_asm_elementwise(ASM, "=r,=r,r", [w], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        r = tl.arange(0, NB)
        c0 = 8 * (r // 4) + r % 4
        b0 = tl.load(bp + (c0 // 2)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        b1 = tl.load(bp + (c0 // 2 + 2)[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        sh = (4 * (c0 % 2))[None, :]
        k0 = tl.load(kx_ptr + ((b0 >> sh) & 15))
        k1 = tl.load(kx_ptr + ((b1 >> sh) & 15))
    return k0, k1


@triton.jit
def _i8_scores(k0, k1, qa_hi, qa_lo, qb_hi, qb_lo, alpha, beta):
    """Float32 scores [keys, N] of int8 keys against the fixed-point query's halves (exact int32 dots)."""
    hi = tl.dot(k0, qa_hi, out_dtype=tl.int32)
    lo = tl.dot(k0, qa_lo, out_dtype=tl.int32)
    hi = tl.dot(k1, qb_hi, hi, out_dtype=tl.int32)
    lo = tl.dot(k1, qb_lo, lo, out_dtype=tl.int32)
    return (hi * 256 + lo).to(tl.float32) * alpha[None, :] + beta[None, :]


@triton.jit
def _fix_scale(amax, g):
    """(1 / scale, scale * g) of a fixed-point query whose columns' largest |value| is amax (0 for zero columns)."""
    live = amax > 0.0
    inv = tl.where(live, 32639.0 / tl.where(live, amax, 1.0), 0.0)  # Q_FIX
    return inv, tl.where(live, amax / 32639.0, 0.0) * g


@triton.jit
def _fix(y, inv):
    return tl.floor(y * inv[None, :] + 0.5)


@triton.jit
def _q_i8_unpark(base, h_ok, D: tl.constexpr):
    """The parked fixed-point query (int16 at base + coordinate, [1, N] pointers) read back as the int8 dots'
    operands (qa_hi, qa_lo, qb_hi, qb_lo) [D / 2, N]: qa row 4 w + i is coordinate 8 w + i, qb's 8 w + 4 + i;
    q = 256 hi + lo with lo in [-128, 127]."""
    r = tl.arange(0, D // 2)
    ca = (8 * (r // 4) + r % 4)[:, None]
    m = h_ok[None, :]
    va = tl.load(base + ca, mask=m, other=0).to(tl.int32)
    vb = tl.load(base + ca + 4, mask=m, other=0).to(tl.int32)
    ha = (va + 128) >> 8
    hb = (vb + 128) >> 8
    return ha.to(tl.int8), (va - ha * 256).to(tl.int8), hb.to(tl.int8), (vb - hb * 256).to(tl.int8)


@triton.jit
def _q_i8_rotated(
    q_ptr, r_ptr, h_ptr, obase, tok, hq, h_ok, scale, g, D: tl.constexpr, PREC: tl.constexpr, ROT16: tl.constexpr
):  # fmt: skip
    """The int8 key path's query, rotated here (`_rot_q4` in float32): fixed point per column, parked in this
    program's output rows (written last, as `_park_q4`) and read back in the dots' layout. Returns the four
    operands, the columns' score scale alpha and offset beta (the grid's half step: sum(q) / 2 alpha)."""
    y0, y1, y2, y3 = _rot_q4(q_ptr, r_ptr, h_ptr, tok, hq, h_ok, scale, D, tl.float32, PREC, ROT16)
    a01 = tl.maximum(tl.max(tl.abs(y0), 0), tl.max(tl.abs(y1), 0))
    amax = tl.maximum(a01, tl.maximum(tl.max(tl.abs(y2), 0), tl.max(tl.abs(y3), 0)))
    inv, alpha = _fix_scale(amax, g)
    y0, y1, y2, y3 = _fix(y0, inv), _fix(y1, inv), _fix(y2, inv), _fix(y3, inv)
    qsum = tl.sum(y0, 0) + tl.sum(y1, 0) + tl.sum(y2, 0) + tl.sum(y3, 0)
    base = obase.to(tl.pointer_type(tl.int16))
    g4 = 4 * tl.arange(0, D // 4)[:, None]
    m = h_ok[None, :]
    tl.store(base + g4, y0.to(tl.int16), mask=m)
    tl.store(base + g4 + 1, y1.to(tl.int16), mask=m)
    tl.store(base + g4 + 2, y2.to(tl.int16), mask=m)
    tl.store(base + g4 + 3, y3.to(tl.int16), mask=m)
    tl.debug_barrier()
    qa_hi, qa_lo, qb_hi, qb_lo = _q_i8_unpark(base, h_ok, D)
    return qa_hi, qa_lo, qb_hi, qb_lo, alpha, 0.5 * qsum * alpha


@triton.jit
def _q_i8_loaded(q_ptr, obase, tok, hq, h_ok, scale, g, D: tl.constexpr):
    """`_q_i8_rotated` for a query rotated before the launch (`rotate.rotate_rows`)."""
    d = tl.arange(0, D)
    y = tl.load(q_ptr + tok + hq[None, :] * D + d[:, None], mask=h_ok[None, :], other=0.0).to(tl.float32) * scale
    inv, alpha = _fix_scale(tl.max(tl.abs(y), 0), g)
    y = _fix(y, inv)
    base = obase.to(tl.pointer_type(tl.int16))
    tl.store(base + d[:, None], y.to(tl.int16), mask=h_ok[None, :])
    tl.debug_barrier()
    qa_hi, qa_lo, qb_hi, qb_lo = _q_i8_unpark(base, h_ok, D)
    return qa_hi, qa_lo, qb_hi, qb_lo, alpha, 0.5 * tl.sum(y, 0) * alpha


@triton.jit(do_not_specialize=["stride_ls"])
def _narrow_decode_kernel(
    q_ptr, kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, kcb_ptr, vcb_ptr, qsl_ptr, seqlen_ptr, bt_ptr, out_ptr, lse_ptr,
    qx_ptr, kn_ptr, vn_ptr, rk_ptr, rv_ptr, sk_ptr, sv_ptr, seqslot_ptr, sinkslot_ptr, r_ptr, vr_ptr, h_ptr, kx_ptr,
    stride_qt, stride_bt, stride_os, stride_ot, stride_ls, stride_lt, stride_qxt, stride_knt, stride_vnt,
    split_n, qk_scale, kgrid,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, N: tl.constexpr, N2: tl.constexpr, NX: tl.constexpr,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_MODE: tl.constexpr, VAL_BITS: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr,
    KASM0: tl.constexpr, KASM1: tl.constexpr, KASM2: tl.constexpr, KASM3: tl.constexpr,
    VASM0: tl.constexpr, VASM1: tl.constexpr, VASM2: tl.constexpr, VASM3: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, BLOCK_X: tl.constexpr, LAZY_TAU: tl.constexpr,
    V3_BYTES: tl.constexpr, PAIR_SCALARS: tl.constexpr, QROT: tl.constexpr, RSQRT_D: tl.constexpr,
    VB8: tl.constexpr, VPERM: tl.constexpr, PREFETCH: tl.constexpr, PARKQ: tl.constexpr,
    VROT: tl.constexpr, RPREC: tl.constexpr, ROT16: tl.constexpr, ROWS32: tl.constexpr,
    DEFER_SUMS: tl.constexpr, LANE_SUMS: tl.constexpr, KPT: tl.constexpr,
    TAIL_MASK: tl.constexpr, KSCALED: tl.constexpr, VSCALED: tl.constexpr, KSPREAD: tl.constexpr,
    VSPREAD: tl.constexpr, KI8: tl.constexpr, KIASM: tl.constexpr,
):  # fmt: skip
    HAS_EXACT: tl.constexpr = (SINK > 0) or (WINDOW > 0)
    # the exact values' own part of the output (`parts`): not with VROT, where every split accumulates in
    # the values' own space and the exact-pairs split is a split like the others
    NPART: tl.constexpr = 2 if HAS_EXACT and not VROT else 1
    KRAW: tl.constexpr = KASM0 != ""
    # 3-bit min-max values as byte tiles (`v3_bytes`), 2-bit codebook values as byte words (`byte_values`)
    VRAW: tl.constexpr = 3 if V3_BYTES else 2 if VB8 else (VASM0 != "")
    pid_rh = tl.program_id(0)
    pid_s = tl.program_id(1)
    req = pid_rh // HKV
    kvh = pid_rh % HKV
    q_start = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - q_start
    packed_s = pid_s - 1 if HAS_EXACT else pid_s  # exact-copy layouts: split 0 reads the exact pairs
    lo = packed_s * split_n
    if PREFETCH > 0:
        seq_len = tl.load(seqlen_ptr + req)  # beside the offsets: one round trip for both
        _prefetch_first_pages(
            bt_ptr + req * stride_bt, stride_bt, lo, seq_len, split_n, kvh, kp_ptr, vp_ptr, ks_ptr, vs_ptr, vz_ptr,
            HKV, BS, D * KEY_BITS // 8, D * VAL_BITS // 8, PREFETCH, VAL_MODE == 2,
        )  # fmt: skip
    if qlen == 0:  # a request without query tokens (graph padding)
        return
    if PREFETCH == 0:
        seq_len = tl.load(seqlen_ptr + req)
    hi = tl.minimum(seq_len, lo + split_n)  # the last query token (position seq_len - 1) sees every key

    # columns: (query token t, head h of the group), t-major; padded columns have zero queries. With
    # N2 > 0 the columns N .. N + N2 - 1 are a second group with state of its own (`col_groups`).
    h_ok, hq, tok_c, qpos = _columns(tl.arange(0, N), G, BLOCK_Q, qlen, kvh, q_start, seq_len)
    tok = tok_c[None, :] * stride_qt
    obase = out_ptr + pid_s * stride_os + tok_c[None, :] * stride_ot + hq[None, :] * (NPART * D)
    if HAS_EXACT:
        if pid_s == 0:  # the exact pairs: a program of their own, apart from the packed loop's registers
            h_okx, hqx, tokx, qposx = _columns(tl.arange(0, NX), G, BLOCK_Q, qlen, kvh, q_start, seq_len)
            _exact_program(
                out_ptr + pid_s * stride_os + tokx[None, :] * stride_ot + hqx[None, :] * (NPART * D),
                lse_ptr + pid_s * stride_ls + tokx * stride_lt + hqx, qx_ptr, kn_ptr, vn_ptr, rk_ptr, rv_ptr,
                sk_ptr, sv_ptr, seqslot_ptr, sinkslot_ptr, req, kvh, hqx, h_okx, tokx, qposx, q_start, seq_len - qlen,
                seq_len, stride_qxt, stride_knt, stride_vnt, qk_scale, HKV, D, NX, SINK, WINDOW, BLOCK_X, DOT_F32, PREC,
                NPART,
            )  # fmt: skip
            return
    pk_t = tl.float32 if DOT_F32 else tl.float16  # the interpreter and float32 models compute in float32
    # SK / SV: coordinates per packed word of keys / values (4; 8 for 3-bit codes): q slice j holds
    # the query coordinates SK g + j, accumulator j the output coordinates SV g + j
    KV: tl.constexpr = D // SV
    if KI8 and QROT:  # int8 keys (`KEYS_I8`): the query in fixed point, parked and read back as int8 halves
        qa_hi, qa_lo, qb_hi, qb_lo, q_alpha, q_beta = _q_i8_rotated(
            q_ptr, r_ptr, h_ptr, obase, tok, hq, h_ok, qk_scale * RSQRT_D, kgrid, D, PREC, ROT16
        )
    elif KI8:
        qa_hi, qa_lo, qb_hi, qb_lo, q_alpha, q_beta = _q_i8_loaded(q_ptr, obase, tok, hq, h_ok, qk_scale, kgrid, D)
    elif QROT and SK == 8:  # q_ptr: the unrotated query, rotated here (`rotates_query`)
        q0, q1, q2, q3, q4, q5, q6, q7 = _rot_q8(
            q_ptr, r_ptr, h_ptr, tok, hq, h_ok, qk_scale * RSQRT_D, D, pk_t, PREC, ROT16
        )
    elif QROT:
        q0, q1, q2, q3 = _rot_q4(q_ptr, r_ptr, h_ptr, tok, hq, h_ok, qk_scale * RSQRT_D, D, pk_t, PREC, ROT16)
        if PARKQ and pk_t.primitive_bitwidth <= out_ptr.dtype.element_ty.primitive_bitwidth:
            q0, q1, q2, q3 = _park_q4(obase, h_ok, q0, q1, q2, q3, D)
    else:
        q0 = _q_cols(q_ptr, tok, hq, h_ok, 0, qk_scale, SK, D, pk_t)
        q1 = _q_cols(q_ptr, tok, hq, h_ok, 1, qk_scale, SK, D, pk_t)
        q2 = _q_cols(q_ptr, tok, hq, h_ok, 2, qk_scale, SK, D, pk_t)
        q3 = _q_cols(q_ptr, tok, hq, h_ok, 3, qk_scale, SK, D, pk_t)
        if SK == 8:
            q4 = _q_cols(q_ptr, tok, hq, h_ok, 4, qk_scale, SK, D, pk_t)
            q5 = _q_cols(q_ptr, tok, hq, h_ok, 5, qk_scale, SK, D, pk_t)
            q6 = _q_cols(q_ptr, tok, hq, h_ok, 6, qk_scale, SK, D, pk_t)
            q7 = _q_cols(q_ptr, tok, hq, h_ok, 7, qk_scale, SK, D, pk_t)

    m_i = tl.full([N], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([N], dtype=tl.float32)
    a0 = tl.zeros([KV, N], dtype=tl.float32)
    a1 = tl.zeros([KV, N], dtype=tl.float32)
    a2 = tl.zeros([KV, N], dtype=tl.float32)
    a3 = tl.zeros([KV, N], dtype=tl.float32)
    if SV == 8:
        a4 = tl.zeros([KV, N], dtype=tl.float32)
        a5 = tl.zeros([KV, N], dtype=tl.float32)
        a6 = tl.zeros([KV, N], dtype=tl.float32)
        a7 = tl.zeros([KV, N], dtype=tl.float32)
    vsum = tl.zeros([N], dtype=tl.float32)  # min-max: sum of p (zero - 2^b scale), see _mm_terms
    # DEFER_SUMS: the softmax denominator and the min-max zero terms accumulate per key row and are summed
    # over the keys once after the loop (no cross-lane reduction per tile)
    DEFER: tl.constexpr = DEFER_SUMS and N2 == 0 and not HAS_EXACT  # (tq3, with exact copies: spills at 168)
    if DEFER:
        l_acc = tl.zeros([BLOCK_N, N], dtype=tl.float32)
        v_acc = tl.zeros([BLOCK_N, N], dtype=tl.float32)
    # LANE_SUMS (lazy steps): per-lane partial sums [8, N], reduced across lanes once after the loop
    LANES: tl.constexpr = LANE_SUMS and LAZY_TAU > 0 and not DEFER
    if LANES:
        l_ln = tl.zeros([8, N], dtype=tl.float32)
        v_ln = tl.zeros([8, N], dtype=tl.float32)
    if N2 > 0:  # the second column group: its queries (r), softmax state and accumulators (b)
        h_ok2, hq2, tok_c2, qpos2 = _columns(N + tl.arange(0, N2), G, BLOCK_Q, qlen, kvh, q_start, seq_len)
        tok2 = tok_c2[None, :] * stride_qt
        obase2 = out_ptr + pid_s * stride_os + tok_c2[None, :] * stride_ot + hq2[None, :] * (NPART * D)
        if KI8 and QROT:
            ra_hi, ra_lo, rb_hi, rb_lo, r_alpha, r_beta = _q_i8_rotated(
                q_ptr, r_ptr, h_ptr, obase2, tok2, hq2, h_ok2, qk_scale * RSQRT_D, kgrid, D, PREC, ROT16
            )
        elif KI8:
            ra_hi, ra_lo, rb_hi, rb_lo, r_alpha, r_beta = _q_i8_loaded(
                q_ptr, obase2, tok2, hq2, h_ok2, qk_scale, kgrid, D
            )
        elif QROT and SK == 8:
            r0, r1, r2, r3, r4, r5, r6, r7 = _rot_q8(
                q_ptr, r_ptr, h_ptr, tok2, hq2, h_ok2, qk_scale * RSQRT_D, D, pk_t, PREC, ROT16
            )  # fmt: skip
        elif QROT:
            r0, r1, r2, r3 = _rot_q4(q_ptr, r_ptr, h_ptr, tok2, hq2, h_ok2, qk_scale * RSQRT_D, D, pk_t, PREC, ROT16)
        else:
            r0 = _q_cols(q_ptr, tok2, hq2, h_ok2, 0, qk_scale, SK, D, pk_t)
            r1 = _q_cols(q_ptr, tok2, hq2, h_ok2, 1, qk_scale, SK, D, pk_t)
            r2 = _q_cols(q_ptr, tok2, hq2, h_ok2, 2, qk_scale, SK, D, pk_t)
            r3 = _q_cols(q_ptr, tok2, hq2, h_ok2, 3, qk_scale, SK, D, pk_t)
            if SK == 8:
                r4 = _q_cols(q_ptr, tok2, hq2, h_ok2, 4, qk_scale, SK, D, pk_t)
                r5 = _q_cols(q_ptr, tok2, hq2, h_ok2, 5, qk_scale, SK, D, pk_t)
                r6 = _q_cols(q_ptr, tok2, hq2, h_ok2, 6, qk_scale, SK, D, pk_t)
                r7 = _q_cols(q_ptr, tok2, hq2, h_ok2, 7, qk_scale, SK, D, pk_t)
        m_i2 = tl.full([N2], -1.0e30, dtype=tl.float32)
        l_i2 = tl.zeros([N2], dtype=tl.float32)
        b0 = tl.zeros([KV, N2], dtype=tl.float32)
        b1 = tl.zeros([KV, N2], dtype=tl.float32)
        b2 = tl.zeros([KV, N2], dtype=tl.float32)
        b3 = tl.zeros([KV, N2], dtype=tl.float32)
        if SV == 8:
            b4 = tl.zeros([KV, N2], dtype=tl.float32)
            b5 = tl.zeros([KV, N2], dtype=tl.float32)
            b6 = tl.zeros([KV, N2], dtype=tl.float32)
            b7 = tl.zeros([KV, N2], dtype=tl.float32)
        vsum2 = tl.zeros([N2], dtype=tl.float32)
        if LANES:
            l_ln2 = tl.zeros([8, N2], dtype=tl.float32)
            v_ln2 = tl.zeros([8, N2], dtype=tl.float32)
    bt_row = bt_ptr + req * stride_bt
    # TAIL_MASK: a split's whole tiles (inside the split, in verify steps before every column's
    # query token, with exact copies past the sinks and before the window) run in a loop without per-pair
    # masks; the tiles before them (exact copies: the sink edge, in the split holding position 0) and after
    # them (the partial last one, the causal and window ones) in unpipelined loops that mask. Phases: 0 the
    # head [lo, w_lo) (exact copies only), 1 the whole tiles [w_lo, w_hi), 2 the tail [w_hi, hi).
    if TAIL_MASK:
        w_lo = lo
        w_end = tl.minimum(hi, seq_len - qlen + 1)  # whole tiles end at or before this key
        if HAS_EXACT:
            w_lo = tl.maximum(lo, tl.minimum(hi, lo + tl.cdiv(SINK - lo, BLOCK_N) * BLOCK_N))
            w_end = tl.minimum(hi, seq_len - qlen - WINDOW + 1)
        w_hi = tl.maximum(w_lo, w_lo + tl.maximum(w_end - w_lo, 0) // BLOCK_N * BLOCK_N)
    for ph in tl.static_range(0 if TAIL_MASK and HAS_EXACT else 1, 3 if TAIL_MASK else 2):
        if not TAIL_MASK:
            t_lo = lo
            t_hi = hi
        elif ph == 0:
            t_lo = lo
            t_hi = w_lo
        elif ph == 1:
            t_lo = w_lo
            t_hi = w_hi
        else:
            t_lo = w_hi
            t_hi = hi
        for n0 in tl.range(t_lo, t_hi, BLOCK_N, num_stages=None if ph == 1 else 1):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            tokp = _tile_rows(bt_row, n, nmask, kvh, HKV, BS, ROWS32)
            if not KI8:
                kw = _words(kp_ptr, tokp, nmask, KEY_BITS, SK, D, False, KRAW, KPT)  # [keys, words]
                kw = _spread3(kw, KSPREAD)  # (3-bit codebook groups decoded by byte permutes: one code per nibble)
            vw = _value_rows(_words(vp_ptr, tokp, nmask, VAL_BITS, SV, D, True, VRAW), VPERM)  # [words, keys]
            vw = _spread3(vw, VSPREAD)
            if KSCALED:  # (fp8 cast keys have no scale)
                ksc = _scalars(ks_ptr, tokp, nmask, PAIR_SCALARS)
            else:
                ksc = tl.full([BLOCK_N], 1.0, tl.float32)
            if VSCALED:
                vsc = _scalars(vs_ptr, tokp, nmask, PAIR_SCALARS)
            else:
                vsc = tl.full([BLOCK_N], 1.0, tl.float32)
            # each decoded key slice serves both column groups (the 3-bit decoder is one string: KASM0)
            if KI8:
                k0, k1 = _i8_keys(kp_ptr, tokp, nmask, kx_ptr, D, KIASM)
                s = _i8_scores(k0, k1, qa_hi, qa_lo, qb_hi, qb_lo, q_alpha, q_beta)
                if N2 > 0:
                    s2 = _i8_scores(k0, k1, ra_hi, ra_lo, rb_hi, rb_lo, r_alpha, r_beta)
            else:
                k = _cb_slice(kw, 0, kcb_ptr, KEY_BITS, KASM0, pk_t, KSPREAD != "")
                s = tl.dot(k, q0, input_precision=PREC)
                if N2 > 0:
                    s2 = tl.dot(k, r0, input_precision=PREC)
                k = _cb_slice(kw, 1, kcb_ptr, KEY_BITS, KASM1, pk_t, KSPREAD != "")
                s = tl.dot(k, q1, s, input_precision=PREC)
                if N2 > 0:
                    s2 = tl.dot(k, r1, s2, input_precision=PREC)
                k = _cb_slice(kw, 2, kcb_ptr, KEY_BITS, KASM2, pk_t, KSPREAD != "")
                s = tl.dot(k, q2, s, input_precision=PREC)
                if N2 > 0:
                    s2 = tl.dot(k, r2, s2, input_precision=PREC)
                k = _cb_slice(kw, 3, kcb_ptr, KEY_BITS, KASM3, pk_t, KSPREAD != "")
                s = tl.dot(k, q3, s, input_precision=PREC)
                if N2 > 0:
                    s2 = tl.dot(k, r3, s2, input_precision=PREC)
                if SK == 8:
                    k = _cb_slice(kw, 4, kcb_ptr, KEY_BITS, KASM0, pk_t, KSPREAD != "")
                    s = tl.dot(k, q4, s, input_precision=PREC)
                    if N2 > 0:
                        s2 = tl.dot(k, r4, s2, input_precision=PREC)
                    k = _cb_slice(kw, 5, kcb_ptr, KEY_BITS, KASM1, pk_t, KSPREAD != "")
                    s = tl.dot(k, q5, s, input_precision=PREC)
                    if N2 > 0:
                        s2 = tl.dot(k, r5, s2, input_precision=PREC)
                    k = _cb_slice(kw, 6, kcb_ptr, KEY_BITS, KASM2, pk_t, KSPREAD != "")
                    s = tl.dot(k, q6, s, input_precision=PREC)
                    if N2 > 0:
                        s2 = tl.dot(k, r6, s2, input_precision=PREC)
                    k = _cb_slice(kw, 7, kcb_ptr, KEY_BITS, KASM3, pk_t, KSPREAD != "")
                    s = tl.dot(k, q7, s, input_precision=PREC)
                    if N2 > 0:
                        s2 = tl.dot(k, r7, s2, input_precision=PREC)
            if TAIL_MASK and ph == 1:  # a whole tile
                s = s * ksc[:, None]
            else:
                s = _mask_scores(s, n, nmask, qpos, ksc, HAS_EXACT, SINK, WINDOW, BLOCK_Q)
            if LAZY_TAU > 0:
                # rescale only when some column's maximum grew by more than LAZY_TAU (log2 units): p then
                # stays below 2^LAZY_TAU, and most tiles skip the [d, N] accumulator multiplies
                m_tile = tl.max(s, 0)
                if tl.max(m_tile - m_i, 0) > LAZY_TAU:
                    m_new = tl.maximum(m_i, m_tile)
                    alpha = tl.exp2(m_i - m_new)
                    if DEFER:
                        l_acc = l_acc * alpha[None, :]
                        v_acc = v_acc * alpha[None, :]
                    elif LANES:
                        l_ln = l_ln * alpha[None, :]
                        v_ln = v_ln * alpha[None, :]
                    else:
                        l_i = l_i * alpha
                        vsum = vsum * alpha
                    a0, a1, a2, a3 = _scale4(a0, a1, a2, a3, alpha)
                    if SV == 8:
                        a4, a5, a6, a7 = _scale4(a4, a5, a6, a7, alpha)
                    m_i = m_new
                p = tl.exp2(s - m_i[None, :])
                if DEFER:
                    l_acc = l_acc + p
                elif LANES:
                    l_ln = l_ln + _lane_sums(p, BLOCK_N, N)
                else:
                    l_i = l_i + tl.sum(p, 0)
                if VAL_MODE == 2:
                    vsc, vze = _mm_terms(vsc, _scalars(vz_ptr, tokp, nmask, PAIR_SCALARS), VAL_BITS)
                    if DEFER:
                        v_acc = v_acc + p * vze[:, None]
                    elif LANES:
                        v_ln = v_ln + _lane_sums(p * vze[:, None], BLOCK_N, N)
                    else:
                        vsum = vsum + tl.sum(p * vze[:, None], 0)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 0))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[None, :])
                m_i = m_new
                if DEFER:
                    l_acc = l_acc * alpha[None, :] + p
                else:
                    l_i = l_i * alpha + tl.sum(p, 0)
                if VAL_MODE == 2:
                    vsc, vze = _mm_terms(vsc, _scalars(vz_ptr, tokp, nmask, PAIR_SCALARS), VAL_BITS)
                    if DEFER:
                        v_acc = v_acc * alpha[None, :] + p * vze[:, None]
                    else:
                        vsum = vsum * alpha + tl.sum(p * vze[:, None], 0)
                a0, a1, a2, a3 = _scale4(a0, a1, a2, a3, alpha)
                if SV == 8:
                    a4, a5, a6, a7 = _scale4(a4, a5, a6, a7, alpha)
            pv = (p * vsc[:, None]).to(pk_t)
            if N2 > 0:
                if TAIL_MASK and ph == 1:  # a whole tile
                    s2 = s2 * ksc[:, None]
                else:
                    s2 = _mask_scores(s2, n, nmask, qpos2, ksc, HAS_EXACT, SINK, WINDOW, BLOCK_Q)
                m_tile2 = tl.max(s2, 0)
                m_new2 = tl.maximum(m_i2, m_tile2)
                if LAZY_TAU > 0:  # (vze: the first group's min-max terms of this tile)
                    grow2 = tl.max(m_tile2 - m_i2, 0) > LAZY_TAU
                    m_new2 = tl.where(grow2, m_new2, m_i2)
                alpha2 = tl.exp2(m_i2 - m_new2)  # 1 where a lazy group keeps its maximum
                p2 = tl.exp2(s2 - m_new2[None, :])
                if LANES:
                    l_ln2 = l_ln2 * alpha2[None, :] + _lane_sums(p2, BLOCK_N, N2)
                else:
                    l_i2 = l_i2 * alpha2 + tl.sum(p2, 0)
                if VAL_MODE == 2:
                    if LANES:
                        v_ln2 = v_ln2 * alpha2[None, :] + _lane_sums(p2 * vze[:, None], BLOCK_N, N2)
                    else:
                        vsum2 = vsum2 * alpha2 + tl.sum(p2 * vze[:, None], 0)
                m_i2 = m_new2
                if LAZY_TAU > 0:
                    if grow2:
                        b0, b1, b2, b3 = _scale4(b0, b1, b2, b3, alpha2)
                        if SV == 8:
                            b4, b5, b6, b7 = _scale4(b4, b5, b6, b7, alpha2)
                else:
                    b0, b1, b2, b3 = _scale4(b0, b1, b2, b3, alpha2)
                    if SV == 8:
                        b4, b5, b6, b7 = _scale4(b4, b5, b6, b7, alpha2)
                pv2 = (p2 * vsc[:, None]).to(pk_t)
            # each decoded value slice serves both column groups
            v = _value_slice(vw, 0, vcb_ptr, VAL_MODE, VAL_BITS, VASM0, pk_t, VB8, VSPREAD != "")
            a0 = tl.dot(v, pv, a0, input_precision=PREC)
            if N2 > 0:
                b0 = tl.dot(v, pv2, b0, input_precision=PREC)
            v = _value_slice(vw, 1, vcb_ptr, VAL_MODE, VAL_BITS, VASM1, pk_t, VB8, VSPREAD != "")
            a1 = tl.dot(v, pv, a1, input_precision=PREC)
            if N2 > 0:
                b1 = tl.dot(v, pv2, b1, input_precision=PREC)
            v = _value_slice(vw, 2, vcb_ptr, VAL_MODE, VAL_BITS, VASM2, pk_t, VB8, VSPREAD != "")
            a2 = tl.dot(v, pv, a2, input_precision=PREC)
            if N2 > 0:
                b2 = tl.dot(v, pv2, b2, input_precision=PREC)
            v = _value_slice(vw, 3, vcb_ptr, VAL_MODE, VAL_BITS, VASM3, pk_t, VB8, VSPREAD != "")
            a3 = tl.dot(v, pv, a3, input_precision=PREC)
            if N2 > 0:
                b3 = tl.dot(v, pv2, b3, input_precision=PREC)
            if SV == 8:
                v = _value_slice(vw, 4, vcb_ptr, VAL_MODE, VAL_BITS, VASM0, pk_t, VB8, VSPREAD != "")
                a4 = tl.dot(v, pv, a4, input_precision=PREC)
                if N2 > 0:
                    b4 = tl.dot(v, pv2, b4, input_precision=PREC)
                v = _value_slice(vw, 5, vcb_ptr, VAL_MODE, VAL_BITS, VASM1, pk_t, VB8, VSPREAD != "")
                a5 = tl.dot(v, pv, a5, input_precision=PREC)
                if N2 > 0:
                    b5 = tl.dot(v, pv2, b5, input_precision=PREC)
                v = _value_slice(vw, 6, vcb_ptr, VAL_MODE, VAL_BITS, VASM2, pk_t, VB8, VSPREAD != "")
                a6 = tl.dot(v, pv, a6, input_precision=PREC)
                if N2 > 0:
                    b6 = tl.dot(v, pv2, b6, input_precision=PREC)
                v = _value_slice(vw, 7, vcb_ptr, VAL_MODE, VAL_BITS, VASM3, pk_t, VB8, VSPREAD != "")
                a7 = tl.dot(v, pv, a7, input_precision=PREC)
                if N2 > 0:
                    b7 = tl.dot(v, pv2, b7, input_precision=PREC)

    if VROT:  # codebook values: out of the rotated space before the split's partial is written
        if SV == 8:
            a0, a1, a2, a3, a4, a5, a6, a7 = _unrotate8(a0, a1, a2, a3, a4, a5, a6, a7, vr_ptr, D, VPERM, RPREC)
        else:
            a0, a1, a2, a3 = _unrotate4(a0, a1, a2, a3, vr_ptr, D, VPERM, RPREC)
    if DEFER:
        l_i = tl.sum(l_acc, 0)
        vsum = tl.sum(v_acc, 0)
    if LANES:
        l_i = tl.sum(l_ln, 0)
        vsum = tl.sum(v_ln, 0)
    vs = vsum[None, :]
    inv_l = _finish_group(obase, lse_ptr + pid_s * stride_ls + tok_c * stride_lt + hq, m_i, l_i, h_ok, D, NPART, SPLIT)
    _store_cols(obase, a0 + vs, inv_l, h_ok, 0, SV, D, VPERM)
    _store_cols(obase, a1 + vs, inv_l, h_ok, 1, SV, D, VPERM)
    _store_cols(obase, a2 + vs, inv_l, h_ok, 2, SV, D, VPERM)
    _store_cols(obase, a3 + vs, inv_l, h_ok, 3, SV, D, VPERM)
    if SV == 8:
        _store_cols(obase, a4 + vs, inv_l, h_ok, 4, SV, D, VPERM)
        _store_cols(obase, a5 + vs, inv_l, h_ok, 5, SV, D, VPERM)
        _store_cols(obase, a6 + vs, inv_l, h_ok, 6, SV, D, VPERM)
        _store_cols(obase, a7 + vs, inv_l, h_ok, 7, SV, D, VPERM)
    if N2 > 0:
        if VROT:
            if SV == 8:
                b0, b1, b2, b3, b4, b5, b6, b7 = _unrotate8(b0, b1, b2, b3, b4, b5, b6, b7, vr_ptr, D, VPERM, RPREC)
            else:
                b0, b1, b2, b3 = _unrotate4(b0, b1, b2, b3, vr_ptr, D, VPERM, RPREC)
        if LANES:
            l_i2 = tl.sum(l_ln2, 0)
            vsum2 = tl.sum(v_ln2, 0)
        vs2 = vsum2[None, :]
        inv_l2 = _finish_group(
            obase2, lse_ptr + pid_s * stride_ls + tok_c2 * stride_lt + hq2, m_i2, l_i2, h_ok2, D, NPART, SPLIT
        )  # fmt: skip
        _store_cols(obase2, b0 + vs2, inv_l2, h_ok2, 0, SV, D, VPERM)
        _store_cols(obase2, b1 + vs2, inv_l2, h_ok2, 1, SV, D, VPERM)
        _store_cols(obase2, b2 + vs2, inv_l2, h_ok2, 2, SV, D, VPERM)
        _store_cols(obase2, b3 + vs2, inv_l2, h_ok2, 3, SV, D, VPERM)
        if SV == 8:
            _store_cols(obase2, b4 + vs2, inv_l2, h_ok2, 4, SV, D, VPERM)
            _store_cols(obase2, b5 + vs2, inv_l2, h_ok2, 5, SV, D, VPERM)
            _store_cols(obase2, b6 + vs2, inv_l2, h_ok2, 6, SV, D, VPERM)
            _store_cols(obase2, b7 + vs2, inv_l2, h_ok2, 7, SV, D, VPERM)


def launch(
    q,
    kp,
    ks,
    vp,
    vs,
    vz,
    kcb,
    vcb,
    meta,
    part,
    lse,
    stride_os: int,
    splits: int,
    split_n: int,
    qk_scale: float,
    layout,
    kasm,
    vasm,
    dot_f32: bool,
    prec: str,
    warps: int,
    block_n: int,
    stages: int,
    key: tuple,
    exact: tuple,
    rot=None,
    vrot=None,
) -> None:
    """Launch over (request x KV head, split) with `paged_decode.decode_attention`'s prepared buffers;
    the first launch of a configuration records its occupancy for `plan`. `exact`: (unrotated q, this
    step's k / v, ring k / v, sink k / v) for layouts with exact copies (the launcher's placeholders
    otherwise). `splits` counts the exact-pairs program (split 0) of exact-copy layouts. `rot`: the key
    rotation R when q is the unrotated query and the kernel rotates it (`rotates_query`). `vrot`: the value
    rotation when the kernel writes its accumulators out of the rotated space (`unrotates_values`)."""
    T, hq, d = q.shape
    hkv = kp.shape[1]
    qx, k_new, v_new, rk, rv, sk, sv = exact
    npart = parts(layout, d, meta.max_query_len)
    grid = (meta.num_reqs * hkv, splits)
    n_cols = cols(meta.max_query_len, hq // hkv)
    n_first, n_second = col_groups(meta.max_query_len, hq // hkv)
    pairs = pair_scalars(layout, n_cols, (ks, vs, vz))
    ki8 = keys_i8(layout, d, qx.dtype == torch.float32, meta.max_query_len)
    kx, kgrid = i8_key_table(layout, q.device) if ki8 else (None, 1.0)
    htab = None
    if rot is not None and rotation16(layout, d, meta.max_query_len, q.dtype, dot_f32):
        htab = hadamard_table(d // slices(layout.key_bits), q.dtype, q.device)
    kernel = _narrow_decode_kernel[grid](
        q, kp, ks, vp, vs, vz, kcb, vcb, meta.query_start_loc, meta.seq_lens, meta.block_tables, part, lse,
        qx, k_new, v_new, rk, rv, sk, sv, meta.seq_slots, meta.sink_slots, rot if rot is not None else qx,
        vrot if vrot is not None else qx, htab if htab is not None else qx, kx if kx is not None else qx,
        q.stride(0), meta.block_tables.stride(0), stride_os, hq * npart * d, lse.stride(0) if splits > 1 else 0, hq,
        qx.stride(0), k_new.stride(0), v_new.stride(0), split_n, qk_scale, kgrid,
        HKV=hkv, G=hq // hkv, BLOCK_Q=meta.max_query_len, N=n_first, N2=n_second, NX=n_cols, D=d,
        BS=kp.shape[2], BLOCK_N=block_n,
        KEY_BITS=layout.key_bits, VAL_MODE=layout.val_mode, VAL_BITS=layout.val_bits,
        SK=slices(layout.key_bits), SV=slices(layout.val_bits),
        KASM0=kasm[0], KASM1=kasm[1], KASM2=kasm[2], KASM3=kasm[3],
        VASM0=vasm[0], VASM1=vasm[1], VASM2=vasm[2], VASM3=vasm[3],
        SPLIT=splits > 1, DOT_F32=dot_f32, PREC=prec, SINK=layout.sink, WINDOW=layout.window, BLOCK_X=16,
        LAZY_TAU=lazy_tau(layout, d, n_cols), V3_BYTES=v3_bytes(layout, n_cols), PAIR_SCALARS=pairs,
        QROT=rot is not None, RSQRT_D=d**-0.5, VB8=byte_values(layout, meta.max_query_len),
        VPERM=value_rows(layout, meta.max_query_len),
        PREFETCH=prefetch_pages(kp.shape[2], rot is not None and _tuned_prefetch(layout, d, meta.max_query_len)),
        PARKQ=rot is not None and parks_query(layout, d, meta.max_query_len),
        VROT=vrot is not None, RPREC="ieee" if dot_f32 else "tf32x3",
        ROT16=htab is not None, ROWS32=bool(ROWS32) and rows32(kp, ks, vp, vs, vz),
        DEFER_SUMS=defer_sums(layout, d, n_cols),
        LANE_SUMS=lane_sums(layout, d, meta.max_query_len), KPT=bool(paged_decode.KEY_PLANES_T),
        TAIL_MASK=tail_mask(layout, d, meta.max_query_len),
        KSCALED=layout.key_mode != DENSE or layout.key_scaled, VSCALED=layout.val_mode != DENSE or layout.val_scaled,
        KSPREAD=paged_decode.spread3_asm(layout, "k", kasm), VSPREAD=paged_decode.spread3_asm(layout, "v", vasm),
        KI8=ki8, KIASM=i8_key_decoder(layout) if ki8 else "",
        num_warps=warps, num_stages=stages, **({"maxnreg": key[-1]} if key[-1] else {}),
    )  # fmt: skip
    LAST_LAUNCH["kernel"] = kernel
    if key not in _RESIDENT and not _interpreting() and hasattr(kernel, "n_regs"):
        _record_occupancy(key, kernel, warps, q.device)
