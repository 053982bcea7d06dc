"""Sliced decode kernel for packed pages: codebook keys, codebook or min-max values, 2- / 4-bit codes.

The general kernel (`attention/paged.py`) expands each packed key / value tile to [keys, d] with a
join tree and converts it to the tensor-core operand layout through shared memory. Here nothing is
expanded: the packed words of a tile, each holding the indices of S = 4 coordinates (an int16 word of
4-bit codes, an int8 word of 2-bit codes), form a [d / 4, keys] tile, and slice j (coordinates
4g + j) is decoded *elementwise* from those words. So the words go to shared memory packed (b bits
per coordinate, not 16), are read back in the operand layout, and are decoded in registers right
where `tl.dot` wants them:

    scores = sum_j  q[:, j::4] @ c[idx_j]          (4 dots with K = d / 4)
    acc_j += p @ v_j                               (4 accumulators [rows, d / 4])

Lookups are fp16 gathers from the codebook (portable, and what the interpreter and float32 models
run, the latter from the float32 codebook); on the GPU each slice of a pair of words is decoded by one
inline-PTX block that Triton keeps in the operand layout (a pure elementwise op): codebook codes by
warp shuffles (`shfl_slices`, lane l holds centroid l mod 2^b), min-max codes by the fp16 magic
number (`minmax_slices`: the code in the top mantissa bits of 2^b is 2^b + idx). `LOOKUP = "prmt"` keeps the older PRMT
byte-lookup decoder for 4-bit codebooks, for A/B timing. 2-bit codebook values of verify programs
(`BYTE_VALUES_ROWS`) are loaded transposed and decoded four byte words per register (`shfl_slices_b8`).

Everything else follows `paged.py`: rows are (query token, head of the GQA group) padded to 16 (or
32 for verify steps), the exact sink + window rule reads the fresh k / v, the ring and the sink
buffer (`_load_exact`) in a pass after the packed loop; exact values accumulate in a second output
part; split-K partials are combined and rotated values rotated back once by `finish.finish_parts`.
Launch configurations (warps, key tile, split-K target, pipeline stages) come from `launch_config`.

`decode_attention` hands steps the narrow kernel serves (`paged_decode_narrow.eligible`: decode and
verify steps of up to 32 (query token x head) columns) to `paged_decode_narrow`, which reuses the
slice decoders here with the dots turned around; this module's kernel keeps the rest (GQA groups past
the narrow kernel's columns) and serves everything with `paged_decode_narrow.ENABLED = False`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from tqserve.attention.finish import finish_parts
from tqserve.attention.paged import (
    CODEBOOK,
    DENSE,
    LAST_LAUNCH,
    LOG2E,
    MINMAX,
    _exact_masks,
    _interpreting,
    _load_exact,
    _num_sms,
    _row_major,
    _tile_rows,
    centroid_tables,
    rows32,
)
from tqserve.attention.rotate import rotate_rows
from tqserve.attention.tuning import MAX_SPLITS, group_pad

if TYPE_CHECKING:
    import torch

ENABLED = True  # benchmarks / tests switch the sliced path off to compare with the general kernel
MIN_HEAD_DIM = 64  # smallest head size dispatched here
# GPU decoders of 2- / 4-bit slices: "shfl" (codebook lookups by warp shuffles, min-max by fp16 magic
# numbers), "prmt" (4-bit codebook lookups by byte permutes), "gather" (fp16 loads, as in the interpreter).
LOOKUP = "shfl"
# The shuffle decoders' pairs (c[a], c[b]) joined by an f16x2 add of (c[a], 0) and (0, c[b]), shuffled from
# two lane tables (one more register), on the FMA pipe, instead of a PRMT on the integer ALU pipe: 1 in decode
# steps over layouts with 4-bit codebook keys and values (`join_add`), 2 everywhere, 0 never. Verify steps
# were slower with it (32 x 5 x 32K, PRMT / add: tq_k4v4_nc 0.7252 / 0.7445, tq_k4v4_ub 0.7212 / 0.7402; same
# call: decode 0.5377 / 0.5274 and 0.5346 / 0.5252, 1 x 128K 0.0890 / 0.0884 and 0.0892 / 0.0881).
# H200, thirty-second session, CUDA-graph replays, medians of 3 rounds, ms, PRMT / add: tq_k4v4_nc 32 x 32K
# 0.5365 / 0.5260, 1 x 128K 0.0889 / 0.0874; tq3 (2-bit values, keys only) 0.4325 / 0.4316, 0.0751 / 0.0754,
# verify 0.6869 / 0.6835; turboquant_4bit_nc (min-max values, 128 registers: 4 spill loads in the loop) 0.4179
# / 0.4240, 0.0686 / 0.0691. (Not kept, same calls: the decoders' right shifts as `mul.hi.u32` by 2^(32 - s),
# IMAD.HI on the FMA pipe instead of SHF on the ALU pipe, which ncu had found busiest (ALU 53.8%, FMA
# 11.8%): slower at every step, 4bit_nc 32 x 32K 0.4133 -> 0.4264 / 0.4418 / 0.4616 with the keys' high
# words / all key shifts / the min-max values' too, tq_k4v4_nc 0.5365 -> 0.5642 / 0.5849 / 0.5881.)
JOIN_ADD = 1
# (Not kept: the pairs joined by an exact f16x2 fma, (c[b], c[b]) * (0, 1) + (c[a], 0) from one lane table of
# (c, 0), one HFMA2 with a `.H0_H0` operand instead of the PRMT, in the 3-, 4- and 5-bit shuffle decoders. H200,
# thirty-third session, CUDA-graph replays, medians of 3 rounds, ms, PRMT / fma: 4bit_nc 32 x 32K 0.4127 /
# 0.4223 (spills at 128 registers), 32 x 5 x 32K 0.6172 / 0.6165, 1 x 128K 0.0682 / 0.0699; tq3 0.4335 / 0.4337,
# 0.6829 / 0.6849; 3bit_nc 0.8247 / 0.8215, 0.9928 / 0.9872; tq4 1.017 / 1.013, 1.222 / 1.220.)
# (Mixed, one or two of a 4-bit codebook side's four slices by byte permutes and the rest by shuffles, to
# move lookups off the shuffle pipe: slower everywhere. H200, thirty-first session, ms, shuffles / 1 / 2
# slices by permutes: 4bit_nc 32 x 32K 0.414 / 0.471 / 0.512, 32 x 5 x 32K 0.622 / 0.635 / 0.672, 1 x 128K
# 0.0683 / 0.0741 / 0.0800; tq_k4v4_nc 32 x 32K 0.534 / 0.615 / 0.743. Offline, one slice by permutes adds
# 143 instructions to the 780 of a 4bit_nc decode tile and removes 32 of its 132 shuffles.)
# (Also slower: 4-bit keys as two half registers, (c, 0) and (0, c'), shuffled from tables already in their
# halves, a dot each over the same query: no PRMT to join them, 775 -> 733 instructions per tile offline, but
# twice the dependent score HMMAs per accumulator. H200, thirty-first session, ms, joined / halves: 4bit_nc
# 32 x 32K 0.412 / 0.429, 1 x 128K 0.0684 / 0.0709, verify 0.618 / 0.667; tq3 0.431 / 0.439; tq_k4v4_nc
# 0.530 / 0.550. The branch `key-halves` keeps it, with the halves in two accumulators: not timed.)
# Launch configurations, tuned on the H100 (CUDA-graph replays, benchmarks/decode_ab.py --variants;
# docs/benchmarks.md, "Launch table"):
# - decode at d = 128 (16-row programs) without exact copies: one warp over 64-key tiles, split-K
#   for ~12 programs / SM, 3 pipeline stages (eighth session: 4bit_nc 32 x 32K 0.810 -> 0.732 ms,
#   1 x 128K 0.136 -> 0.122; tq_k4v4_ub 0.743 -> 0.732 / 0.140 -> 0.129; 8 or 16 programs / SM
#   were 23% / 8% slower at 32 x 32K, 128-key tiles with one warp 35-76% slower);
# - decode at d = 128 of exact-copy layouts (tq3: the exact pass's [16, d] query and accumulator),
#   and every decode at d = 256 (one warp would hold [16, 256] accumulators): 4 warps over 128-key
#   tiles, split-K for ~4 programs / SM, 2 pipeline stages when the requests alone give every SM a
#   program (32 x 32K: -10%), else 1 (d = 256), or at d = 128 one warp over 32-key tiles for ~16
#   programs / SM (tq3, one request over 128K: 0.198 -> 0.155 ms);
# - decode at d < 128: one warp over 32-key tiles, ~16 programs / SM, 2 stages (-15% at SmolLM2's
#   64 x 4K, d = 64);
# - verify rows (32 per program): one warp over 32-key tiles, ~6 (d < 128) or ~20 programs / SM
#   (d >= 128; eighth session, 32 x 5 x 32K: 4bit_nc 1.115 -> 1.055 ms with 3 stages, tq_k4v4_ub
#   1.079 -> 1.031; 24 programs / SM 5% slower than 12), 2 stages at d < 128, 3 at d >= 128, 1 for
#   exact-copy layouts at d >= 128 (tq3: +17% with 2, register-bound).
#   One warp means no cross-warp softmax reductions (no barriers in the key loop) and no operand
#   decoded twice: with 32 rows, 4 warps tile the dots 2 x 2 and decode every word twice.
PACKED_BLOCK_N = 64  # decode at d = 128 without exact copies
PACKED_NUM_WARPS = 1
PACKED_SPLIT_TARGET = 12
PACKED_STAGES = 3
BLOCK_N = 128  # decode at d = 128 with exact copies, and at d >= 256
NUM_WARPS = 4
SPLIT_TARGET = 4  # programs per SM the split-K count aims at
NUM_STAGES = 2
FEW_PROGRAMS_STAGES = 1  # ... at d >= 256 with fewer (request, KV head) programs than SMs
FEW_BLOCK_N = 32  # d = 128 with exact copies and fewer (request, KV head) programs than SMs
FEW_NUM_WARPS = 1
FEW_SPLIT_TARGET = 16
FEW_STAGES = 1
SMALL_BLOCK_N = 32
SMALL_NUM_WARPS = 1
SMALL_SPLIT_TARGET = 16
SMALL_STAGES = 2
VERIFY_SPLIT_TARGET = 20
VERIFY_SMALL_D_SPLIT_TARGET = 6
VERIFY_STAGES = 2  # d < 128
VERIFY_WIDE_STAGES = 3  # d >= 128 without exact copies
VERIFY_EXACT_WIDE_STAGES = 1
# The exact sink / window pass of programs with at least EXACT_PHASED_ROWS rows runs in two phases
# (softmax statistics before the packed loop, exact values after it in EXACT_CHUNKS column chunks):
# a one-warp 32-row program cannot hold the packed accumulators, the exact query and a [rows, d]
# exact accumulator together (tq3 verify spilled). 64 (> MAX_ROWS) turns it off.
EXACT_PHASED_ROWS = 32
EXACT_CHUNKS = 2
# Packed-loop mask of layouts with exact copies as one causal compare against qpos - WINDOW (and a
# per-key n >= SINK) instead of the causal mask and the exact rule's complement (0: the old masks).
FOLD_EXACT_MASK = 1
# 2-bit codebook values in programs of at least BYTE_VALUES_ROWS rows at d >= BYTE_VALUES_MIN_D: the
# int8 words are loaded [words, keys] and transposed in registers (keys contiguous in shared memory:
# 4-byte instead of 1-byte shared loads) and, on the GPU, decoded four bytes per register by
# `shfl_slices_b8` (no byte -> 16-bit unpacking). 64 (> MAX_ROWS) turns it off.
BYTE_VALUES_ROWS = 32
BYTE_VALUES_MIN_D = 128
# Register cap per thread for the decode kernel (0: the compiler's choice, 255 for one-warp programs);
# benchmarks sweep it. H200, eighth session: 200 was 3-17% slower, 168 17-32% (spills in the key loop).
MAXNREG = 0
ROWS32 = 1  # page rows in 32 bits where `paged.rows32` allows (A/B knob)
# 2-bit codebooks decode through the pair table (`shfl_pair_slices`: one shuffle per two codes);
# 0: one shuffle per code (`shfl_slices`); 2: no shuffle, one byte permute per two codes
# (`prmt_pair_slices`); for A/B timing.
PAIR_TABLES = 1
# Decode steps of the narrow kernel take the byte-permute decoders for 2-bit codebooks whatever
# PAIR_TABLES says (`pair_tables`): the shuffles' results are what tq3's decode loop waits on most (ncu,
# fifteenth session: 23% of stall samples are short-scoreboard waits, mostly in the PRMT / SHF that
# consume shuffle results). H100, CUDA-graph replays, shuffle pairs -> byte permutes: tq3 32 x 32K 0.513 /
# 0.517 -> 0.492 / 0.495 ms, 1 x 128K 0.0852 -> 0.0838; tq_k4v2_ub 0.572 -> 0.541, 0.0970 -> 0.0923.
# Verify steps keep the shuffles (tq3 32 x 5 x 32K 0.943 -> 0.953, tq_k4v2_ub 0.944 -> 0.965).
PRMT2_DECODE = 1
# 3-bit min-max values through `minmax_slices3` (1) or `_mm_slice`'s Triton ops (0), for A/B timing
MINMAX3_ASM = 0
# 3-bit min-max values of narrow decode steps (at most 8 columns) loaded as three byte tiles
# (`_groups3_bytes`) instead of 4-byte words (`_groups3`); 0: words everywhere, for A/B timing. Bytes
# joined by zero-extends, constant shifts and ors let Triton move the dot-operand conversion up to
# the loads (3 conversions per key tile instead of one per slice: 8); the words' join / permute stops
# that. Verify steps keep the words (twelfth session: 1.330 -> 1.563 ms with bytes). H100, thirteenth
# session, turboquant_3bit_nc decode 32 x 32K, same splits: 0.849 vs 0.883 ms (6), 0.856 vs 0.889
# (12); as planned (bytes: 167 registers, 12 programs per SM, 6 splits; words: 139, 14, 7 splits)
# 0.856 vs 1.180 - most of that is the split count: 7 splits cost the words 1.169 ms, 6 only 0.883.
MINMAX3_BYTES = 1
# Decode and verify steps over fp8 (e4m3) keys and / or values in the narrow kernel (`fp8_side`: words of four
# bytes, four slices as for 4-bit codes, each pair of bytes converted by one `cvt.rn.f16x2.e4m3x2`, `fp8_slices`;
# fp16 dots, the scale per key on the scores and on p) instead of the general kernel (`attention/paged.py`, rows
# on M, byte loads and fp16 -> bf16 conversions: 933 sm_90 instructions per tile); 0: the general kernel, for A/B
# timing. H200, thirty-eighth session, CUDA-graph replays, medians of 3 rounds, ms, general -> narrow: fp8 32 x
# 32K 1.447 -> 0.509 (0.65x -> 1.84x SDPA, at the copy rate), 1 x 128K 0.196 -> 0.083, 32 x 5 x 32K 1.974 ->
# 0.569; turboquant_k8v4 1.384 -> 0.406, 0.180 -> 0.070, 1.698 -> 0.531 (64-key tiles or 4 stages: no better).
FP8_NARROW = 1
S = 4  # coordinates per packed word: an int8 word of 2-bit codes, an int16 word of 4-bit codes
S3 = 8  # 3-bit codes: a 24-bit group of 8 (3 bytes of the bit stream), narrow kernel only
# 5-bit keys (tq4's) in the narrow kernel: groups of 8 codes as two 20-bit halves cut from 32-bit words
# (`_groups5`), 8 slices per dot as 3-bit codes take, codes by a 32-lane shuffle table (`shfl_slices5`).
# H200, CUDA-graph replays, tq4 (twenty-seventh session): 32 x 32K decode 1.128 ms against the general kernel's
# 3.389 (3.0x), 1 x 128K 0.162 / 0.429, verify 32 x 5 x 32K 1.356 / 3.789. sm_90: 1,212 instructions per
# 32-key tile, no spills (tq3: 944). 0 sends 5-bit keys to the general kernel.
NARROW_KEYS5 = 1
# 3- and 5-bit key words gathered [units, keys] (lanes over 4 units x 8 keys: each scalar copy touches 8 token
# records, not 32) and transposed in registers (`_words`' KT) by the narrow kernel. The instruction count stays
# (tq4 1,197 -> 1,204 per tile offline) but the gathers touch a quarter of the L1 wavefronts. H200, 32 x 32K
# decode, ms off / on: tq4 1.117 / 1.016, tq_k5v4_nc 0.750 / 0.661, k3v4_nc 0.496 / 0.461, 3bit_nc 0.839 /
# 0.838 (verify 1.060 / 1.020); 0 is the A/B baseline (docs/benchmarks.md, thirtieth session).
KEY_PLANES_T = 1


def slices(bits: int) -> int:
    """Coordinates per packed word (the slice count of the narrow kernel's dots) for b-bit codes: 8 for the
    groups of 3- and 5-bit codes."""
    return S3 if bits in (3, 5) else S


MAX_QUERY_LEN = 8  # query tokens per request served here (verify steps of up to 7 drafts)
MAX_ROWS = 32  # rows per program (one-warp programs hold [rows, d] accumulators in registers)


def program_rows(max_query_len: int, group: int) -> int:
    """Rows of one program: (query tokens of a block) x (the GQA group padded), at least 16."""
    gp = group_pad(group)
    return max(16, triton.next_power_of_2(max(1, max_query_len)) * gp)


def fp8_side(layout, side: str) -> bool:
    """Whether a layout's keys ("k") or values ("v") are fp8 (dense 8-bit pages, with or without a scale)."""
    mode, bits = (layout.key_mode, layout.key_bits) if side == "k" else (layout.val_mode, layout.val_bits)
    return mode == DENSE and bits == 8


def fp8_table(device, dtype) -> torch.Tensor:
    """The 256 e4m3 values by byte, in `dtype` (every e4m3 value is exact in fp16 and float32): the
    interpreter's and float32 models' gathers of fp8 slices (`_cb_slice`). Cached per device and dtype."""
    import torch

    key = (str(device), dtype)
    if key not in _FP8_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_TABLES[key] = codes.view(torch.float8_e4m3fn).to(dtype).to(device).contiguous()
    return _FP8_TABLES[key]


_FP8_TABLES: dict = {}


def fp8_slices() -> tuple[str, str, str, str]:
    """PTX of slice j = 0..3 for fp8 (e4m3) sides in 4-byte words, two words per call ($1, $2: words g and g + 1 of
    a key, or word g of keys n and n + 1): byte j of each word into one 16-bit pair (a byte permute), then
    one `cvt.rn.f16x2.e4m3x2` (exact: every e4m3 value is an fp16 value). 1 instruction per value."""
    out = []
    for j in range(4):
        body = ".reg .b32 t;\n.reg .b16 h, u;\n"
        body += f"prmt.b32 t, $1, $2, {(4 + j) << 4 | j:#x};\nmov.b32 {{h, u}}, t;\n"
        body += "cvt.rn.f16x2.e4m3x2 $0, h;\n"
        out.append("{\n" + body + "}")
    return tuple(out)


def eligible(layout, max_query_len: int, head_dim: int, group: int = 1) -> bool:
    """Decode and verify steps (up to MAX_QUERY_LEN query tokens per request, programs of at most
    MAX_ROWS rows) over codebook keys and codebook / min-max values whose codes come in 4-coordinate
    words (2- and 4-bit), power-of-two head sizes with at least 16 words per token (the K of a
    tensor-core dot).

    Chosen by measurement (H100, CUDA-graph replays, docs/benchmarks.md): with the shuffle decoders
    faster than the general kernel for 4-bit keys with 4- / 2-bit values at 32 x 32K (1.6-2.2x),
    1 x 128K (1.4-1.9x), verify 32 x 5 x 32K (1.5-1.8x) and SmolLM2's d = 64 (64 x 4K: 1.4x for
    4-bit keys, 1.7x for tq3). 3-bit codes (8-coordinate groups) only where the narrow kernel takes
    the step (it has their slice decoders), with at least 16 groups per token; 5-bit keys likewise with
    `NARROW_KEYS5`, fp8 sides (4-byte words) with `FP8_NARROW` (else the general kernel).
    """
    if not ENABLED or max_query_len > MAX_QUERY_LEN or program_rows(max_query_len, group) > MAX_ROWS:
        return False
    fp8 = fp8_side(layout, "k") or fp8_side(layout, "v")
    if fp8 and not FP8_NARROW:
        return False
    if not (layout.key_mode == CODEBOOK or fp8_side(layout, "k")):
        return False
    if not (layout.val_mode in (CODEBOOK, MINMAX) or fp8_side(layout, "v")):
        return False
    bits = (layout.key_bits, layout.val_bits)
    if head_dim & (head_dim - 1) or layout.val_bits not in (2, 3, 4, 8) or layout.key_bits not in (2, 3, 4, 5, 8):
        return False
    if layout.key_bits == 5 and not NARROW_KEYS5:
        return False
    if 3 in bits or 5 in bits or fp8:
        from tqserve.attention import paged_decode_narrow as narrow

        per_word = S3 if 3 in bits or 5 in bits else S  # coordinates per word (group) of the narrow kernel's slices
        if head_dim // per_word < 16 or not narrow.eligible(layout, max_query_len, group):
            return False
    return head_dim // S >= 16 and head_dim >= MIN_HEAD_DIM


# ---- inline-PTX slice decoders (GPU only) --------------------------------------------------------


def prmt_tables(codebook16) -> tuple[int, int, int, int] | None:
    """(lo bytes of m0..m3, of m4..m7, hi bytes of m0..m3, of m4..m7) for the magnitudes m = c[8:16] of a
    16-entry fp16 table in sign-magnitude code order (`reference.code_order`: c[r] == -c[8 + r] bit for
    bit); None for any other table. Takes the host table (`tq_code_table` on the CPU, the values the device
    copy was made from)."""
    import torch

    assert codebook16.device.type == "cpu", "build the PRMT tables from the host codebook"
    c = codebook16.to(torch.float16)
    if c.numel() != 16 or not torch.equal(c[:8], -c[8:]):
        return None
    m = [int(v) & 0xFFFF for v in c[8:].view(torch.int16).numpy()]
    word = lambda xs: xs[0] | xs[1] << 8 | xs[2] << 16 | xs[3] << 24  # noqa: E731
    return (
        word([v & 0xFF for v in m[:4]]),
        word([v & 0xFF for v in m[4:]]),
        word([v >> 8 for v in m[:4]]),
        word([v >> 8 for v in m[4:]]),
    )


def prmt_slices(tables: tuple[int, int, int, int]) -> tuple[str, str, str, str]:
    """PTX of slice j = 0..3: two int16 words (4 indices each) in one register -> fp16x2 (c[idx_j of
    word 0], c[idx_j of word 1]). Sign-magnitude code: bit 3 clear is negative, bits 0-2 the magnitude's
    index. The common part is identical in the four blocks (ptxas shares it)."""
    tl0, tl1, th0, th1 = tables
    common = (
        ".reg .b32 x, n, t, m, s, lo, hi, r, T0, T1, T2, T3;\n"
        "mov.b32 x, $1;\n"
        f"mov.b32 T0, {tl0:#x};\nmov.b32 T1, {tl1:#x};\nmov.b32 T2, {th0:#x};\nmov.b32 T3, {th1:#x};\n"
        "not.b32 t, x;\nand.b32 n, t, 0x88888888;\n"  # n: bit 3 of each negative code
        "and.b32 m, x, 0x77777777;\n"  # magnitudes
    )
    out = []
    for j in range(4):
        body = common + (f"shr.u32 s, m, {4 * j};\n" if j else "mov.b32 s, m;\n")
        # selector nibbles: magnitude of word 0 (bits 4j..) and of word 1 (bits 16 + 4j..)
        body += f"shr.u32 t, m, {4 * j + 12};\nand.b32 s, s, 0x7;\nand.b32 t, t, 0x70;\nor.b32 s, s, t;\n"
        body += "prmt.b32 lo, T0, T1, s;\nprmt.b32 hi, T2, T3, s;\nprmt.b32 r, lo, hi, 0x5140;\n"
        body += f"shl.b32 t, n, {12 - 4 * j};\n" if j < 3 else "mov.b32 t, n;\n"  # signs to bits 15 / 31
        body += "and.b32 t, t, 0x80008000;\nor.b32 $0, r, t;\n"
        out.append("{\n" + body + "}")
    return tuple(out)


def _byte_words(vals: list[int]) -> list[int]:
    """Little-endian 32-bit words of bytes, 4 per word (padded with zeros)."""
    vals = vals + [0] * (-len(vals) % 4)
    return [vals[i] | vals[i + 1] << 8 | vals[i + 2] << 16 | vals[i + 3] << 24 for i in range(0, len(vals), 4)]


def join_add(layout, max_query_len: int) -> bool:
    """Whether a step's shuffle decoders join their pairs by an f16x2 add (`JOIN_ADD`)."""
    four_bit = layout.key_bits == 4 and layout.val_mode == CODEBOOK and layout.val_bits == 4  # as measured
    return JOIN_ADD == 2 or bool(JOIN_ADD) and max_query_len <= 1 and four_bit


def _join_ptx(join: bool) -> tuple[str, str, str]:
    """(declarations, setup after the lane table `tb`, the pair's join into $0) of `shfl_slices`: a permute
    (ra.lo, rb.lo), or with `join` the exact f16x2 add of (c[a], 0) and (0, c[b]), rb shuffled from a second
    table `th` (`JOIN_ADD`)."""
    if join:
        return ".reg .b32 th;\n", "and.b32 tb, tb, 0xffff;\nshl.b32 th, tb, 16;\n", "add.rn.f16x2 $0, ra, rb;\n"
    return "", "", "prmt.b32 $0, ra, rb, 0x5410;\n"


def shfl_slices(codebook16, bits: int, join: bool = False) -> tuple[str, str, str, str]:
    """PTX of slice j = 0..3 (same contract as `prmt_slices`, 2- or 4-bit codes in 16-bit words) by
    warp-shuffle lookups: lane l holds the fp16 centroid c[l mod 2^b] in a register, and
    `shfl.sync.idx` with the code as source lane returns c[code] - one shuffle per value, no selector
    assembly. The shuffle reads only bits 4:0 of the source lane and the table repeats every 2^b
    lanes, so a shifted word needs no mask. Shuffles run on their own pipe (32 per clock per SM),
    beside the integer ALUs that the PRMT decoder saturates at ~6 instructions per value.

    The table register depends on the lane only: it is built from immediates (PRMT lookups in the
    codebook's lo / hi bytes) by the same instructions in every block, which ptxas hoists out of the
    key loop and shares. Any codebook of 2^b fp16 entries (no symmetry needed)."""
    import torch

    assert codebook16.device.type == "cpu" and bits in (2, 4) and codebook16.numel() == 1 << bits
    raw = [int(v) & 0xFFFF for v in codebook16.to(torch.float16).view(torch.int16).numpy()]
    lo = _byte_words([v & 0xFF for v in raw])
    hi = _byte_words([v >> 8 for v in raw])
    regs = [f"L{i}" for i in range(len(lo))] + [f"H{i}" for i in range(len(hi))]
    common = ".reg .pred p;\n.reg .b32 l, m, a, b, c, d, lo, hi, tb, xa, xb, ra, rb, " + ", ".join(regs) + ";\n"
    common += "".join(f"mov.b32 L{i}, {w:#x};\n" for i, w in enumerate(lo))
    common += "".join(f"mov.b32 H{i}, {w:#x};\n" for i, w in enumerate(hi))
    common += "mov.u32 l, %laneid;\n"
    if bits == 4:  # entries 0-7 from (L0, L1), 8-15 from (L2, L3); lane bit 3 picks the half
        common += "and.b32 m, l, 7;\nprmt.b32 a, L0, L1, m;\nprmt.b32 b, L2, L3, m;\n"
        common += "prmt.b32 c, H0, H1, m;\nprmt.b32 d, H2, H3, m;\n"
        common += "and.b32 m, l, 8;\nsetp.ne.u32 p, m, 0;\nselp.b32 lo, b, a, p;\nselp.b32 hi, d, c, p;\n"
    else:  # four entries: one word of lo bytes, one of hi bytes
        common += "and.b32 m, l, 3;\nprmt.b32 lo, L0, L0, m;\nprmt.b32 hi, H0, H0, m;\n"
    common += "prmt.b32 tb, lo, hi, 0x0040;\n"  # fp16 c[l mod 2^b] in the low half
    decl, setup, tail = _join_ptx(join)
    common = decl + common + setup
    out = []
    for j in range(4):
        body = common + (f"shr.u32 xa, $1, {bits * j};\n" if j else "mov.b32 xa, $1;\n")
        body += f"shr.u32 xb, $1, {16 + bits * j};\n"
        body += "shfl.sync.idx.b32 ra, tb, xa, 0x1f, 0xffffffff;\n"
        body += f"shfl.sync.idx.b32 rb, {'th' if join else 'tb'}, xb, 0x1f, 0xffffffff;\n"
        body += tail
        out.append("{\n" + body + "}")
    return tuple(out)


def shfl_slices_b8(codebook16) -> tuple[str, str, str, str]:
    """PTX of slice j = 0..3 for 2-bit codebook codes in 8-bit words, four words per register (pack=4,
    `_asm_slice4`): $2 holds four words (bytes), $0 / $1 get fp16x2 (c[idx_j of words 0, 1]),
    (c[idx_j of words 2, 3]). Same shuffle table as `shfl_slices` (lane l holds c[l mod 4]); the words
    stay bytes, so no byte -> 16-bit unpacking before the decoder."""
    import torch

    assert codebook16.device.type == "cpu" and codebook16.numel() == 4
    raw = [int(v) & 0xFFFF for v in codebook16.to(torch.float16).view(torch.int16).numpy()]
    lo = _byte_words([v & 0xFF for v in raw])[0]
    hi = _byte_words([v >> 8 for v in raw])[0]
    common = ".reg .b32 l, m, lo, hi, tb, x0, x1, x2, x3, r0, r1, r2, r3, L0, H0;\n"
    common += f"mov.b32 L0, {lo:#x};\nmov.b32 H0, {hi:#x};\nmov.u32 l, %laneid;\n"
    common += "and.b32 m, l, 3;\nprmt.b32 lo, L0, L0, m;\nprmt.b32 hi, H0, H0, m;\nprmt.b32 tb, lo, hi, 0x0040;\n"
    out = []
    for j in range(4):
        body = common + (f"shr.u32 x0, $2, {2 * j};\n" if j else "mov.b32 x0, $2;\n")
        body += "".join(f"shr.u32 x{b}, $2, {8 * b + 2 * j};\n" for b in (1, 2, 3))
        body += "".join(f"shfl.sync.idx.b32 r{b}, tb, x{b}, 0x1f, 0xffffffff;\n" for b in range(4))
        body += "prmt.b32 $0, r0, r1, 0x5410;\nprmt.b32 $1, r2, r3, 0x5410;\n"
        out.append("{\n" + body + "}")
    return tuple(out)


def _pair_table(codebook16) -> str:
    """PTX building the pair table of a 2-bit codebook: lane l holds fp16x2 (c[l & 3], c[(l >> 2) & 3])
    (period 16, so bit 4 of a source lane is free), from immediates by PRMT - lane-only, so ptxas
    hoists it out of the key loop like `shfl_slices`' table."""
    import torch

    assert codebook16.device.type == "cpu" and codebook16.numel() == 4
    raw = [int(v) & 0xFFFF for v in codebook16.to(torch.float16).view(torch.int16).numpy()]
    lo = _byte_words([v & 0xFF for v in raw])[0]
    hi = _byte_words([v >> 8 for v in raw])[0]
    # PRMT selector nibbles (a, 4 + a, b, 4 + b): lo / hi byte of c[a], then of c[b]
    return (
        f"mov.b32 L0, {lo:#x};\nmov.b32 H0, {hi:#x};\nmov.u32 l, %laneid;\n"
        "and.b32 a, l, 3;\nshr.u32 b, l, 2;\nand.b32 b, b, 3;\nshl.b32 t, b, 8;\nor.b32 t, t, a;\n"
        "mul.lo.u32 t, t, 0x11;\nadd.u32 t, t, 0x4040;\nprmt.b32 tb, L0, H0, t;\n"
    )


def _pair_select(dst: str, src: str, lo_shift: int, hi_shift: int) -> str:
    """PTX: dst = source lane of the pair table for two 2-bit codes of `src`, the first at bit
    lo_shift (-> bits 1:0), the second at bit hi_shift (-> bits 3:2); bit 4 is left as it comes."""
    a = f"shr.u32 xa, {src}, {lo_shift};\n" if lo_shift else f"mov.b32 xa, {src};\n"
    return a + f"shr.u32 xb, {src}, {hi_shift - 2};\nlop3.b32 {dst}, xa, xb, 3, 0xe4;\n"  # (xa & 3) | (xb & ~3)


def shfl_pair_slices(codebook16) -> tuple[str, str, str, str]:
    """PTX of slice j = 0..3 for 2-bit codebook codes (same contract as `shfl_slices`: two 16-bit
    words per register -> fp16x2 (c[idx_j of word 0], c[idx_j of word 1])) with ONE shuffle per pair:
    the table holds every (c[a], c[b]) pair (16 of them), the source lane is a | b << 2. Half the
    shuffles of `shfl_slices` (4 instructions per pair instead of 5, one of them a shuffle instead of
    two); shuffles are a large share of codebook-value loops (tq3's 64-key tile: 524 of 1,945
    instructions before, 396 of 1,810 after; H100, 32 x 32K, same call: 0.629 -> 0.581 ms)."""
    common = ".reg .b32 l, a, b, t, tb, xa, xb, s, L0, H0;\n" + _pair_table(codebook16)
    out = []
    for j in range(4):
        body = common + _pair_select("s", "$1", 2 * j, 16 + 2 * j)
        body += "shfl.sync.idx.b32 $0, tb, s, 0x1f, 0xffffffff;\n"
        out.append("{\n" + body + "}")
    return tuple(out)


def _prmt_decoders(codebook16, temps: str, src: str, mask: str, bias: str, tail: str) -> tuple[str, str, str, str]:
    """The byte-permute decoders' common frame, slice j = 0..3: the 4 centroids as 8 bytes in T0 / T1,
    the codes of slice j shifted down from `src`, masked, and made selector bytes by one multiply-add
    (c * 0x22 + 0x10: the nibbles 2c, 2c + 1 of centroid c's two bytes); `tail` does the permutes."""
    import torch

    assert codebook16.device.type == "cpu" and codebook16.numel() == 4
    raw = [int(v) & 0xFFFF for v in codebook16.to(torch.float16).view(torch.int16).numpy()]
    t0, t1 = raw[0] | raw[1] << 16, raw[2] | raw[3] << 16
    out = []
    for j in range(4):
        body = f".reg .b32 {temps}, T0, T1;\nmov.b32 T0, {t0:#x};\nmov.b32 T1, {t1:#x};\n"
        body += f"shr.u32 x, {src}, {2 * j};\n" if j else f"mov.b32 x, {src};\n"
        body += f"and.b32 x, x, {mask};\nmad.lo.u32 u, x, 0x22, {bias};\n" + tail
        out.append("{\n" + body + "}")
    return tuple(out)


def prmt_pair_slices(codebook16) -> tuple[str, str, str, str]:
    """`shfl_pair_slices`' contract (2-bit codes at bits 2j and 16 + 2j of $1 -> fp16x2 (c[a], c[b]))
    without a shuffle: the 4 centroids are 8 bytes in two registers, and one PRMT picks both halves'
    bytes with the selector nibbles (2a, 2a + 1, 2b, 2b + 1), built by one multiply-add of the masked
    codes (a * 0x22 + 0x10 in byte 0, b * 0x22 + 0x10 in byte 2) and a PRMT that joins those bytes.
    Five integer instructions per pair (four for j = 0) instead of three and a shuffle: the shuffles
    leave the MIO pipe, which the key lookups and shared-memory loads share (`PAIR_TABLES` = 2)."""
    tail = "prmt.b32 s, u, 0, 0x0020;\nprmt.b32 $0, T0, T1, s;\n"
    return _prmt_decoders(codebook16, "x, u, s", "$1", "0x30003", "0x100010", tail)


def prmt_slices_b8(codebook16) -> tuple[str, str, str, str]:
    """`shfl_slices_b8`'s contract (four byte words in $2 -> $0 = (c[idx_j of words 0, 1]), $1 = (of
    words 2, 3)) by byte permutes, no shuffle: the 4 centroids are 8 bytes in two registers; one
    multiply-add turns the four masked codes c into the selector bytes (2c + 1) << 4 | 2c at once
    (c * 0x22 + 0x10, no carry between bytes), whose low half picks words 0 and 1 and, shifted down,
    words 2 and 3. Six integer instructions per four codes (five for j = 0) where `prmt_pair_slices`
    takes ten and a byte -> 16-bit unpacking before it."""
    tail = "prmt.b32 $0, T0, T1, u;\nshr.u32 v, u, 16;\nprmt.b32 $1, T0, T1, v;\n"
    return _prmt_decoders(codebook16, "x, u, v", "$2", "0x03030303", "0x10101010", tail)


def shfl_pair_slices_b8(codebook16) -> tuple[str, str, str, str]:
    """`shfl_slices_b8`'s contract (four byte words in $2 -> $0 = (c[idx_j of words 0, 1]), $1 = (of
    words 2, 3)) with the pair table of `shfl_pair_slices`: two shuffles per four codes instead of four."""
    common = ".reg .b32 l, a, b, t, tb, xa, xb, s0, s1, L0, H0;\n" + _pair_table(codebook16)
    out = []
    for j in range(4):
        body = common + _pair_select("s0", "$2", 2 * j, 8 + 2 * j) + _pair_select("s1", "$2", 16 + 2 * j, 24 + 2 * j)
        body += "shfl.sync.idx.b32 $0, tb, s0, 0x1f, 0xffffffff;\nshfl.sync.idx.b32 $1, tb, s1, 0x1f, 0xffffffff;\n"
        out.append("{\n" + body + "}")
    return tuple(out)


def _byte_tables8(codebook16) -> str:
    """PTX declaring L0, L1 (the low bytes of c[0..3], c[4..7]) and H0, H1 (their high bytes) for an 8-entry fp16
    codebook: byte-permute tables, `prmt.b32 x, L0, L1, k` picks the low byte of c[k & 7]."""
    import torch

    assert codebook16.device.type == "cpu" and codebook16.numel() == 8
    raw = [int(v) & 0xFFFF for v in codebook16.to(torch.float16).view(torch.int16).numpy()]
    lo = _byte_words([v & 0xFF for v in raw])
    hi = _byte_words([v >> 8 for v in raw])
    out = ".reg .b32 L0, L1, H0, H1;\n"
    return out + f"mov.b32 L0, {lo[0]:#x};\nmov.b32 L1, {lo[1]:#x};\nmov.b32 H0, {hi[0]:#x};\nmov.b32 H1, {hi[1]:#x};\n"


def shfl_slices3(codebook16) -> tuple[str, str, str, str]:
    """PTX for 3-bit codebook codes: two int32 words ($1, $2) whose low 3 bits are the codes (the
    kernel shifts slice j's code down first) -> fp16x2 (c[code of $1], c[code of $2]), one shuffle per
    code from a table with lane l holding c[l & 7] (period 8, so bits 4:3 of the source lane are
    free). The same string serves every slice (all four entries are it)."""
    body = ".reg .b32 l, m, a, c, tb, ra, rb;\n" + _byte_tables8(codebook16)
    body += "mov.u32 l, %laneid;\nand.b32 m, l, 7;\nprmt.b32 a, L0, L1, m;\nprmt.b32 c, H0, H1, m;\n"
    body += "prmt.b32 tb, a, c, 0x0040;\n"  # fp16 c[l & 7] in the low half
    body += "shfl.sync.idx.b32 ra, tb, $1, 0x1f, 0xffffffff;\nshfl.sync.idx.b32 rb, tb, $2, 0x1f, 0xffffffff;\n"
    body += "prmt.b32 $0, ra, rb, 0x5410;\n"  # (ra.lo, rb.lo)
    asm = "{\n" + body + "}"
    return (asm, asm, asm, asm)


# 3-bit codebook sides (8 centroids) by byte permutes instead of warp shuffles (`prmt_slices3`): each loaded group of
# 8 codes is first spread to one code per nibble (7 integer instructions), then two slices of a register pair take a
# byte permute for the selectors, two table permutes (low and high bytes of the fp16 centroids) and one permute each
# for their f16x2: 2.1 integer instructions per code and no shuffle, against 2.4 and one shuffle. 0: shuffles.
# The shuffles were what tq4's decode waited on (ncu, H200, thirty-eighth session: 256 shuffles per 32-key tile, issue
# slots 33% busy, 58% of the stall samples short-scoreboard or MIO waits, shuffles first). H200, same session,
# CUDA-graph replays, medians of 3 rounds, ms, shuffles -> permutes (32 x 32K / 1 x 128K / 32 x 5 x 32K):
#   tq4 (3-bit values)             1.014 / 0.147 / 1.220 -> 0.859 / 0.128 / 1.099  (0.95x -> 1.12x SDPA)
#   tq4s                           1.015 / 0.147 / 1.224 -> 0.861 / 0.128 / 1.102
#   turboquant_3bit_nc (keys)      0.769 / 0.112 / 0.993 -> 0.681 / 0.101 / 0.855
#   turboquant_k3v4_nc (keys)      0.457 / 0.073 / 0.618 -> 0.409 / 0.068 / 0.580
PRMT3 = 1


def prmt_slices3(codebook16) -> tuple[tuple[str, str, str, str], str]:
    """((PTX of even slices, of odd slices, even, odd), PTX of the spread) for 3-bit codebook codes. The spread
    (`_spread3`, one int32 group in, one out) moves code k of the group's 24 bits to bits 4k..4k+2 (bits 4k+3
    clear: a byte permute's selector nibble). A slice decoder takes two spread groups ($1, $2: groups g, g + 1 of
    a key, or group g of keys n, n + 1) and a selector ($3) naming byte j // 2 of each, which holds codes j
    and j + 1 (j even): s = those two bytes, then the low and the high bytes of c[code] for the four nibbles of s
    by one permute each from the codebook's byte tables, then (c[code j of $1], c[code j of $2]) as f16x2 (even
    j) or the same for code j + 1 (odd j). Any 8-entry fp16 codebook; bit-identical to the table gathers."""
    common = ".reg .b32 s, l, h;\n" + _byte_tables8(codebook16)
    common += "prmt.b32 s, $1, $2, $3;\nprmt.b32 l, L0, L1, s;\nprmt.b32 h, H0, H1, s;\n"
    even = "{\n" + common + "prmt.b32 $0, l, h, 0x6240;\n}"
    odd = "{\n" + common + "prmt.b32 $0, l, h, 0x7351;\n}"
    spread = "{\n.reg .b32 t, x;\n"
    spread += "shl.b32 t, $1, 4;\nlop3.b32 x, $1, t, 0xfff, 0xe4;\n"  # codes 4-7 to bits 16..27
    spread += "shl.b32 t, x, 2;\nlop3.b32 x, x, t, 0x3f003f, 0xe4;\n"  # codes 2, 3, 6, 7 up a byte
    spread += "shl.b32 t, x, 1;\nlop3.b32 x, x, t, 0x7070707, 0xe4;\n"  # odd codes to the high nibbles
    spread += "and.b32 $0, x, 0x77777777;\n}"  # (a & c) | (b & ~c) is lut 0xe4
    return (even, odd, even, odd), spread


def shfl_slices5(codebook16) -> tuple[str, str, str, str]:
    """PTX for 5-bit codebook codes, `shfl_slices3`'s calling convention (two int32 words whose low 5 bits
    are the codes) -> fp16x2, one shuffle per code from a table with lane l holding c[l]: 32 entries, one
    per lane, so the shuffle's source lane is the code itself. The table depends on the lane only (byte
    permutes of immediates, two selects): ptxas hoists it out of the key loop."""
    import torch

    assert codebook16.device.type == "cpu" and codebook16.numel() == 32
    raw = [int(v) & 0xFFFF for v in codebook16.to(torch.float16).view(torch.int16).numpy()]
    lo = _byte_words([v & 0xFF for v in raw])  # 8 words: entries 4w .. 4w + 3
    hi = _byte_words([v >> 8 for v in raw])
    regs = ", ".join([f"L{i}" for i in range(8)] + [f"H{i}" for i in range(8)])
    body = f".reg .pred p, q;\n.reg .b32 l, m, a0, a1, a2, a3, b0, b1, b2, b3, x, y, tb, ra, rb, {regs};\n"
    body += "".join(f"mov.b32 L{i}, {w:#x};\n" for i, w in enumerate(lo))
    body += "".join(f"mov.b32 H{i}, {w:#x};\n" for i, w in enumerate(hi))
    # lane bits 2:0 pick a byte of the word pair (L2k, L2k+1); bits 4:3 pick the pair k
    body += "mov.u32 l, %laneid;\nand.b32 m, l, 7;\n"
    body += "".join(
        f"prmt.b32 a{k}, L{2 * k}, L{2 * k + 1}, m;\nprmt.b32 b{k}, H{2 * k}, H{2 * k + 1}, m;\n" for k in range(4)
    )
    body += "and.b32 m, l, 8;\nsetp.ne.u32 p, m, 0;\nand.b32 m, l, 16;\nsetp.ne.u32 q, m, 0;\n"
    body += "selp.b32 a0, a1, a0, p;\nselp.b32 a2, a3, a2, p;\nselp.b32 x, a2, a0, q;\n"
    body += "selp.b32 b0, b1, b0, p;\nselp.b32 b2, b3, b2, p;\nselp.b32 y, b2, b0, q;\n"
    body += "prmt.b32 tb, x, y, 0x0040;\n"  # fp16 c[l] in the low half
    body += "shfl.sync.idx.b32 ra, tb, $1, 0x1f, 0xffffffff;\nshfl.sync.idx.b32 rb, tb, $2, 0x1f, 0xffffffff;\n"
    body += "prmt.b32 $0, ra, rb, 0x5410;\n"  # (ra.lo, rb.lo)
    asm = "{\n" + body + "}"
    return (asm, asm, asm, asm)


def minmax_slices3() -> tuple[str, str, str, str]:
    """PTX for 3-bit min-max codes, `shfl_slices3`'s calling convention (two int32 words, the code in
    the low 3 bits of each) -> fp16x2 (u, u) with u = 2^3 + code (the code in the top 3 mantissa bits
    of 8.0, as `_mm_slice`): two shifts and two LOP3s per pair, one string for every slice."""
    body = ".reg .b32 a, b;\nshl.b32 a, $1, 7;\nshl.b32 b, $2, 23;\n"
    body += "lop3.b32 a, a, 0x380, 0x48004800, 0xea;\n"  # (a & 0x380) | both halves' exponent of 8
    body += "lop3.b32 $0, b, 0x3800000, a, 0xea;\n"  # | (b & 0x3800000): the high half's code
    asm = "{\n" + body + "}"
    return (asm, asm, asm, asm)


def minmax_slices(bits: int) -> tuple[str, str, str, str]:
    """PTX of slice j = 0..3 for 2- / 4-bit min-max codes in 16-bit words: two words in one register
    -> fp16x2 (u of word 0, of word 1), u = 2^b + idx_j: one shift moves the codes to the top b
    mantissa bits, one LOP3 keeps them and sets the exponent of 2^b ((15 + b) << 10 | idx << (10 - b)).
    2 instructions per 2 values, bit-identical to `_mm_slice`. (The earlier decoder made 1024 + idx
    and subtracted 1024 + h with an f16x2 subtraction: 3 instructions.) The offset the kernels take
    out again (`_mm_terms`) is 2^b codes, so the fp32 accumulators lose nothing to it, and p x scale
    stays the fp16 operand it was."""
    assert bits in (2, 4)
    mask = ((1 << bits) - 1) << (10 - bits)
    one = (15 + bits) << 10
    out = []
    for j in range(4):
        shift = 10 - bits - bits * j
        body = ".reg .b32 t;\n"
        if shift:
            body += f"shl.b32 t, $1, {shift};\n" if shift > 0 else f"shr.u32 t, $1, {-shift};\n"
        else:
            body += "mov.b32 t, $1;\n"
        body += f"lop3.b32 $0, t, {mask | mask << 16:#x}, {one | one << 16:#x}, 0xea;\n"  # (t & mask) | 2^b
        out.append("{\n" + body + "}")
    return tuple(out)


@triton.jit
def _asm_slice(w, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,r", [w], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _asm_pairs(w, ASM: tl.constexpr):
    """Two int32 words per call ($1, $2), one fp16x2 register out (`shfl_slices3`)."""
    return tl.inline_asm_elementwise(ASM, "=r,r,r", [w], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _spread3(w, ASM: tl.constexpr):
    """3-bit groups to one code per nibble (`prmt_slices3`' spread); unchanged without ASM."""
    if ASM != "":
        w = tl.inline_asm_elementwise(ASM, "=r,r", [w], dtype=tl.int32, is_pure=True, pack=1)
    return w


@triton.jit
def _asm_slice4(w, ASM: tl.constexpr):
    """Four byte words per register in, two fp16x2 registers out (`shfl_slices_b8`)."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [w], dtype=tl.float16, is_pure=True, pack=4)


# ---- words and slices ------------------------------------------------------------------------


@triton.jit
def _words(
    ptr,
    tokp,
    nmask,
    BITS: tl.constexpr,
    S: tl.constexpr,
    D: tl.constexpr,
    TRANS: tl.constexpr,
    RAW: tl.constexpr,
    KT: tl.constexpr = False,
):
    """Packed words of S indices each (an int8 word of 2-bit codes, an int16 word of 4-bit codes):
    [D // S, BN] (TRANS) or [BN, D // S] int32; RAW keeps the loaded int16 words (the PRMT path packs
    two of them per register). 3-bit codes come as 8-code groups (`_groups3`), or with RAW == 3 from
    byte tiles ([D // 8, BN] only: `_groups3_bytes`, the narrow kernel's min-max values); 5-bit codes as
    8-code groups in two int32 halves ([BN, D // 8, 2] only: `_groups5`, the narrow kernel's keys)."""
    K: tl.constexpr = D // S
    WB: tl.constexpr = S * BITS // 8  # bytes per word
    NB: tl.constexpr = D * BITS // 8  # bytes per token
    k = tl.arange(0, K)
    if TRANS:
        row = tokp[None, :]
        kk = k[:, None]
        m = nmask[None, :]
    else:
        row = tokp[:, None]
        kk = k[None, :]
        m = nmask[:, None]
    if BITS == 5:  # 5-bit codes: 40-bit groups of 8 (S = 8) as [BN, K, 2] halves, [BN, ..] only (keys)
        tl.static_assert(not TRANS)
        w = _groups5(ptr, row, nmask, K, NB, KT)
    elif WB == 3 and RAW == 3:  # 3-bit codes (S = 8) as bytes, [K, BN] only (min-max values)
        w = _groups3_bytes(ptr, row, nmask, K, NB)
    elif WB == 3 and not TRANS and KT:  # 3-bit keys loaded [K, BN] (lanes over groups), used [BN, K]
        w = tl.trans(_groups3(ptr, tokp[None, :], nmask, K, NB, True))
    elif WB == 3:  # 3-bit codes (S = 8)
        w = _groups3(ptr, row, nmask, K, NB, TRANS)
    elif WB == 4:  # fp8 (S = 4): four bytes per int32 word
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + row * (NB // 4) + kk, mask=m, other=0)
    elif WB == 1:
        w = tl.load(ptr + row * NB + kk, mask=m, other=0)  # uint8 pages: widening zero-extends
        # RAW: 16-bit words, the byte in the low half (the asm decoders take two per register);
        # RAW == 2: the bytes themselves (`shfl_slices_b8` takes four per register)
        if RAW != 2:
            w = w.to(tl.int16) if RAW else w.to(tl.int32)
    else:
        w = tl.load(ptr.to(tl.pointer_type(tl.int16)) + row * (NB // 2) + kk, mask=m, other=0)
        if not RAW:
            w = w.to(tl.int32) & 0xFFFF
    return w


@triton.jit
def _groups3(ptr, row, nmask, K: tl.constexpr, NB: tl.constexpr, TRANS: tl.constexpr):
    """3-bit codes: the token's K groups of 8 codes (24 stream bits each, little-endian) as int32,
    [K, BN] (TRANS) or [BN, K], from 4-byte words (so the pipeliner copies them asynchronously).
    Bits above a group's 24 are left as they come: every decoder masks the code (or, the shuffles,
    ignores bits 4:3 of the source lane)."""
    wp = ptr.to(tl.pointer_type(tl.int32))
    U: tl.constexpr = K // 4
    u = tl.arange(0, U)
    # words 3u, 3u + 1, 3u + 2 hold groups 4u .. 4u + 3
    if TRANS:
        base = wp + row * (NB // 4) + 3 * u[:, None]
        m = nmask[None, :]
    else:
        base = wp + row * (NB // 4) + 3 * u[None, :]
        m = nmask[:, None]
    a = tl.load(base, mask=m, other=0)
    b = tl.load(base + 1, mask=m, other=0)
    c = tl.load(base + 2, mask=m, other=0)
    g0 = a
    g1 = ((a >> 24) & 0xFF) | (b << 8)
    g2 = ((b >> 16) & 0xFFFF) | (c << 16)
    g3 = (c >> 8) & 0xFFFFFF
    w = tl.join(tl.join(g0, g2), tl.join(g1, g3))  # [.., U, 2, 2]: group 4u + 2a + b at [.., u, a, b]
    if TRANS:
        w = tl.reshape(tl.permute(w, (0, 2, 3, 1)), (K, w.shape[1]))
    else:
        w = tl.reshape(w, (w.shape[0], K))
    return w


@triton.jit
def _u32_rows(x, KT: tl.constexpr):
    """Loaded words as uint32 [keys, ..] (KT: loaded [.., keys], transposed here)."""
    if KT:
        x = tl.trans(x)
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def _groups5(ptr, row, nmask, K: tl.constexpr, NB: tl.constexpr, KT: tl.constexpr = False):
    """5-bit codes: the token's K groups of 8 codes (40 stream bits each, little-endian) as int32 halves
    [BN, K, 2]: [.., 0] holds codes 0-3 of the group in its low 20 bits, [.., 1] codes 4-7. Words 5u .. 5u + 4
    hold groups 4u .. 4u + 3; two levels of joins, as `_groups3`'s. Bits above a half's 20 are left as they
    come (every decoder takes 5 bits of a shifted half)."""
    wp = ptr.to(tl.pointer_type(tl.int32))
    U: tl.constexpr = K // 4
    # logical shifts of the int32 words (the top bits of a right shift must be zeros, not signs)
    if KT:  # loaded [U, BN] (lanes over units and keys), used [BN, U]
        base = wp + tl.trans(row) * (NB // 4) + 5 * tl.arange(0, U)[:, None]
        m = nmask[None, :]
    else:
        base = wp + row * (NB // 4) + 5 * tl.arange(0, U)[None, :]
        m = nmask[:, None]
    a = _u32_rows(tl.load(base, mask=m, other=0), KT)
    b = _u32_rows(tl.load(base + 1, mask=m, other=0), KT)
    c = _u32_rows(tl.load(base + 2, mask=m, other=0), KT)
    d = _u32_rows(tl.load(base + 3, mask=m, other=0), KT)
    e = _u32_rows(tl.load(base + 4, mask=m, other=0), KT)
    # the 20-bit halves h0 .. h7 of the unit's 4 groups (stream bits 20 k ..)
    h0 = a
    h1 = (a >> 20) | (b << 12)
    h2 = b >> 8
    h3 = (b >> 28) | (c << 4)
    h4 = (c >> 16) | (d << 16)
    h5 = d >> 4
    h6 = (d >> 24) | (e << 8)
    h7 = e >> 12
    lo = tl.join(tl.join(h0, h4), tl.join(h2, h6))  # [BN, U, 2, 2]: group 4u + 2i + j at [.., u, i, j]
    hi = tl.join(tl.join(h1, h5), tl.join(h3, h7))
    lo = tl.reshape(lo, (lo.shape[0], K)).to(tl.int32, bitcast=True)
    hi = tl.reshape(hi, (hi.shape[0], K)).to(tl.int32, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _groups3_bytes(ptr, row, nmask, K: tl.constexpr, NB: tl.constexpr):
    """`_groups3`'s [K, BN] groups from their three bytes each: zero-extends, constant shifts and ors
    only, so the slices' conversion to the dot operand layout can happen on the byte tiles."""
    bp = ptr.to(tl.pointer_type(tl.uint8)) + row * NB + 3 * tl.arange(0, K)[:, None]
    m = nmask[None, :]
    b0 = tl.load(bp, mask=m, other=0).to(tl.int32)
    b1 = tl.load(bp + 1, mask=m, other=0).to(tl.int32)
    b2 = tl.load(bp + 2, mask=m, other=0).to(tl.int32)
    return b0 | (b1 << 8) | (b2 << 16)


@triton.jit
def _cb_slice(
    w, j: tl.constexpr, cb_ptr, BITS: tl.constexpr, ASM: tl.constexpr, OUT_T: tl.constexpr, P3: tl.constexpr = False
):  # fmt: skip
    """Codebook values of slice j (fp16 centroids) from the words (P3: 3-bit groups spread to nibbles, decoded by
    byte permutes, `prmt_slices3`)."""
    if BITS == 5:  # the half of the group that holds code j
        lo, hi = tl.split(w)
        w = hi if j >= 4 else lo
        j = j % 4
    if P3:  # the selector of byte j // 2 of both groups
        sel = tl.full(w.shape, (j // 2) | ((4 + j // 2) << 4), tl.int32)
        c = tl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [w, sel], dtype=tl.float16, is_pure=True, pack=2)
    elif ASM != "" and (BITS == 3 or BITS == 5):
        c = _asm_pairs(w >> (BITS * j), ASM)  # the shuffle reads the code from the low bits
    elif ASM != "" and BITS == 8:
        c = _asm_pairs(w, ASM)  # fp8: byte j of two words (`fp8_slices`)
    elif ASM != "":
        c = _asm_slice(w, ASM)
    else:
        c = tl.load(cb_ptr + ((w >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.int32))
    return c.to(OUT_T)


@triton.jit
def _mm_slice(w, j: tl.constexpr, BITS: tl.constexpr, OUT_T: tl.constexpr):
    """Min-max codes of slice j as u = 2^b + idx (exact in fp16: the code in the top b mantissa bits of
    2^b); value = zero + scale idx = scale u + (zero - 2^b scale), see `_mm_terms`."""
    i = (((w >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.int32) << (10 - BITS)) | ((15 + BITS) << 10)
    return i.to(tl.int16).to(tl.float16, bitcast=True).to(OUT_T)


@triton.jit
def _mm_terms(vsc, vze, VAL_BITS: tl.constexpr):
    """(weight of the decoded values, constant term) per key of min-max values: they decode to
    u = 2^b + idx (`_mm_slice`), so value = zero + scale idx = scale u + (zero - 2^b scale)."""
    return vsc, vze - vsc * (1 << VAL_BITS)


@triton.jit
def _v_slice(
    w, j: tl.constexpr, cb_ptr, VAL_MODE: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, OUT_T: tl.constexpr,
    P3: tl.constexpr = False,
):  # fmt: skip
    if VAL_MODE != 2:  # codebook indices, or fp8 bytes (dense 8-bit values)
        return _cb_slice(w, j, cb_ptr, BITS, ASM, OUT_T, P3)
    elif ASM != "" and BITS == 3:
        return _asm_pairs(w >> (BITS * j), ASM).to(OUT_T)  # `minmax_slices3`
    elif ASM != "":
        return _asm_slice(w, ASM).to(OUT_T)  # min-max magic-number decoder (same calling convention)
    else:
        return _mm_slice(w, j, BITS, OUT_T)


@triton.jit
def _q_slice(
    q_ptr, tok, hq, row_ok, j: tl.constexpr, qk_scale, stride_qt, S: tl.constexpr, D: tl.constexpr, OUT_T: tl.constexpr
):
    g = tl.arange(0, D // S)
    x = tl.load(
        q_ptr + tok[:, None] * stride_qt + hq[:, None] * D + g[None, :] * S + j, mask=row_ok[:, None], other=0.0
    )
    return (x.to(tl.float32) * qk_scale).to(OUT_T)


@triton.jit
def _acc_update(
    acc,
    alpha,
    pp,
    vw,
    j: tl.constexpr,
    vcb_ptr,
    VAL_MODE: tl.constexpr,
    BITS: tl.constexpr,
    ASM: tl.constexpr,
    PK_T: tl.constexpr,
    PREC: tl.constexpr,
):
    acc = acc * alpha[:, None]
    return tl.dot(pp, _v_slice(vw, j, vcb_ptr, VAL_MODE, BITS, ASM, PK_T), acc, input_precision=PREC)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax over masked scores s [rows, keys] (log2 domain): (p, alpha, m, l)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_slice(obase, acc, l_safe, row_ok, j: tl.constexpr, S: tl.constexpr, D: tl.constexpr):
    g = tl.arange(0, D // S)
    tl.store(obase + g[None, :] * S + j, (acc / l_safe[:, None]).to(obase.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _x_range(lo, hi, q_min, SINK: tl.constexpr, WINDOW: tl.constexpr, BLOCK_X: tl.constexpr):
    """Exact keys of the split [lo, hi): sinks [lo, sink_hi) and the window [win_lo, hi), in tiles of
    BLOCK_X keys: (n_sink, sink_hi, win_lo, tiles)."""
    sink_hi = tl.minimum(hi, SINK)
    win_lo = hi
    if WINDOW > 0:
        win_lo = tl.maximum(tl.maximum(lo, SINK), q_min - WINDOW + 1)
    n_sink = tl.maximum(sink_hi - lo, 0)
    tiles = tl.cdiv(n_sink, BLOCK_X) + tl.cdiv(tl.maximum(hi - win_lo, 0), BLOCK_X)
    return n_sink, sink_hi, win_lo, tiles


@triton.jit
def _x_reload(qsl_ptr, seqlen_ptr, req, qb0, pid_s, split_n, BLOCK_Q: tl.constexpr):
    """(q_start, ctx, lo, hi, q_min) of the program from fresh loads: the phased exact pass recomputes
    them after the packed loop rather than have the compiler keep them live through it."""
    q_start = tl.load(qsl_ptr + req)
    seq_len = tl.load(seqlen_ptr + req)
    ctx = seq_len - (tl.load(qsl_ptr + req + 1) - q_start)
    lo = pid_s * split_n
    hi = tl.minimum(tl.minimum(seq_len, ctx + qb0 + BLOCK_Q), lo + split_n)
    return q_start, ctx, lo, hi, ctx + qb0


@triton.jit
def _x_tile(t, lo, hi, n_sink, sink_hi, win_lo, BLOCK_X: tl.constexpr):
    """Key positions and mask of exact tile t (sink tiles first, then window tiles)."""
    sink_tile = t * BLOCK_X < n_sink
    start = tl.where(sink_tile, lo + t * BLOCK_X, win_lo + t * BLOCK_X - tl.cdiv(n_sink, BLOCK_X) * BLOCK_X)
    stop = tl.where(sink_tile, sink_hi, hi)
    n = start + tl.arange(0, BLOCK_X)
    return n, n < stop


@triton.jit
def _x_scores(
    qx, k_ptr, rk_ptr, sk_ptr, n, nmask, qpos, q_min, row_ok, d, ctx, q_start, stride_knt,
    seq_slot, sink_slot, kvh, HKV: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr, WINDOW: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Masked scores [rows, BLOCK_X] of the exact pairs of a tile (-inf elsewhere) and the key mask."""
    need, ex = _exact_masks(n, qpos, q_min, SINK, WINDOW)
    kx = _load_exact(
        k_ptr, rk_ptr, sk_ptr, n, nmask & need, d, d < D, ctx, q_start, stride_knt,
        seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
    )  # fmt: skip
    s = tl.dot(qx, tl.trans(kx.to(qx.dtype)), input_precision=PREC)
    valid = ex & row_ok[:, None] & nmask[None, :] & (n[None, :] <= qpos[:, None])
    return tl.where(valid, s, float("-inf")), need


@triton.jit(do_not_specialize=["stride_ls"])  # = tokens x heads: one binary for every step size
def _decode_kernel(
    q_ptr, qx_ptr, kn_ptr, vn_ptr, kp_ptr, ks_ptr, vp_ptr, vs_ptr, vz_ptr, kcb_ptr, vcb_ptr,
    rk_ptr, rv_ptr, sk_ptr, sv_ptr, qsl_ptr, seqlen_ptr, bt_ptr, seqslot_ptr, sinkslot_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qxt, stride_knt, stride_vnt, stride_bt, stride_os, stride_ot, stride_ls, stride_lt,
    split_n, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_MODE: tl.constexpr, VAL_BITS: tl.constexpr, SW: tl.constexpr,
    KASM0: tl.constexpr, KASM1: tl.constexpr, KASM2: tl.constexpr, KASM3: tl.constexpr,
    VASM0: tl.constexpr, VASM1: tl.constexpr, VASM2: tl.constexpr, VASM3: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, NPART: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr, BLOCK_X: tl.constexpr, X_PHASED: tl.constexpr,
    XH: tl.constexpr, FOLD_MASK: tl.constexpr, VAL_TRANS: tl.constexpr, VB8: tl.constexpr, ROWS32: tl.constexpr,
):  # fmt: skip
    BM: tl.constexpr = BLOCK_Q * GP
    HAS_EXACT: tl.constexpr = (SINK > 0) or (WINDOW > 0)
    KRAW: tl.constexpr = KASM0 != ""
    VRAW: tl.constexpr = 2 if VB8 else (VASM0 != "")
    pid_rh = tl.program_id(1)
    pid_s = tl.program_id(2)
    req = pid_rh // HKV
    kvh = pid_rh % HKV
    q_start = tl.load(qsl_ptr + req)
    qlen = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seqlen_ptr + req)
    qb0 = tl.program_id(0) * BLOCK_Q
    if qb0 >= qlen:
        return
    ctx = seq_len - qlen

    rows = tl.arange(0, BM)
    qi = rows // GP
    hh = rows % GP
    row_ok = (qb0 + qi < qlen) & (hh < G)
    tok = (q_start + qb0 + qi).to(tl.int64)
    qpos = ctx + qb0 + qi
    hq = kvh * G + hh
    if DOT_F32:  # the interpreter (and float32 models) compute in float32
        dot_t = tl.float32
        pk_t = tl.float32
    else:
        dot_t = kn_ptr.dtype.element_ty
        pk_t = tl.float16

    KV: tl.constexpr = D // SW
    q0 = _q_slice(q_ptr, tok, hq, row_ok, 0, qk_scale, stride_qt, SW, D, pk_t)
    q1 = _q_slice(q_ptr, tok, hq, row_ok, 1, qk_scale, stride_qt, SW, D, pk_t)
    q2 = _q_slice(q_ptr, tok, hq, row_ok, 2, qk_scale, stride_qt, SW, D, pk_t)
    q3 = _q_slice(q_ptr, tok, hq, row_ok, 3, qk_scale, stride_qt, SW, D, pk_t)
    kv_end = tl.minimum(seq_len, ctx + qb0 + BLOCK_Q)
    q_min = ctx + qb0
    lo = pid_s * split_n
    hi = tl.minimum(kv_end, lo + split_n)

    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    a0 = tl.zeros([BM, KV], dtype=tl.float32)
    a1 = tl.zeros([BM, KV], dtype=tl.float32)
    a2 = tl.zeros([BM, KV], dtype=tl.float32)
    a3 = tl.zeros([BM, KV], dtype=tl.float32)
    vsum = tl.zeros([BM], dtype=tl.float32)  # min-max: sum of p (zero - 2^b scale), see _mm_terms
    bt_row = bt_ptr + req * stride_bt
    if NPART == 2 and X_PHASED:
        # ---- exact pass, phase 1 (programs of many rows, `EXACT_PHASED_ROWS`): the softmax statistics of
        # the exact pairs first, so that after the packed loop (m_i, l_i) are final, the packed
        # accumulators are stored before phase 2 and never live beside the exact query / accumulator.
        d = tl.arange(0, D)
        qx = tl.load(qx_ptr + tok[:, None] * stride_qxt + hq[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        qx = (qx.to(tl.float32) * qk_scale).to(dot_t)
        seq_slot = tl.load(seqslot_ptr + req).to(tl.int64)
        sink_slot = tl.load(sinkslot_ptr + req).to(tl.int64)
        n_sink, sink_hi, win_lo, x_tiles = _x_range(lo, hi, q_min, SINK, WINDOW, BLOCK_X)
        for t in range(0, x_tiles):
            n, nmask = _x_tile(t, lo, hi, n_sink, sink_hi, win_lo, BLOCK_X)
            s, need = _x_scores(
                qx, kn_ptr, rk_ptr, sk_ptr, n, nmask, qpos, q_min, row_ok, d, ctx, q_start, stride_knt,
                seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW, PREC,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
    # ---- packed keys / values. (row, key) pairs the exact rule claims are masked out here and done
    # by the exact pass below, so the exact query, buffers and accumulator are not live (registers)
    # during this loop.
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        tokp = _tile_rows(bt_row, n, nmask, kvh, HKV, BS, ROWS32)
        kw = _words(kp_ptr, tokp, nmask, KEY_BITS, SW, D, True, KRAW)
        ksc = tl.load(ks_ptr + tokp, mask=nmask, other=0.0)
        if VAL_TRANS:  # [words, keys] loaded, then viewed [keys, words]: keys contiguous in shared memory
            vw = tl.trans(_words(vp_ptr, tokp, nmask, VAL_BITS, SW, D, True, VRAW))
        else:
            vw = _words(vp_ptr, tokp, nmask, VAL_BITS, SW, D, False, VRAW)
        vsc = tl.load(vs_ptr + tokp, mask=nmask, other=0.0)
        ksc = ksc.to(tl.float32)
        vsc = vsc.to(tl.float32)
        # scores against the packed keys: one K = d / S dot per slice
        s = tl.dot(q0, _cb_slice(kw, 0, kcb_ptr, KEY_BITS, KASM0, pk_t), input_precision=PREC)
        s = tl.dot(q1, _cb_slice(kw, 1, kcb_ptr, KEY_BITS, KASM1, pk_t), s, input_precision=PREC)
        s = tl.dot(q2, _cb_slice(kw, 2, kcb_ptr, KEY_BITS, KASM2, pk_t), s, input_precision=PREC)
        s = tl.dot(q3, _cb_slice(kw, 3, kcb_ptr, KEY_BITS, KASM3, pk_t), s, input_precision=PREC)
        s = s * ksc[None, :]
        if HAS_EXACT and FOLD_MASK:
            # the exact rule's complement folded into the causal bound: a pair is packed iff
            # n >= SINK and qpos - n >= WINDOW, so one compare per pair as without exact copies
            keep = nmask & (n >= SINK)
            valid = row_ok[:, None] & keep[None, :] & (n[None, :] <= (qpos - WINDOW)[:, None])
        else:
            valid = row_ok[:, None] & nmask[None, :] & (n[None, :] <= qpos[:, None])
            if HAS_EXACT:
                valid = valid & ~_exact_masks(n, qpos, q_min, SINK, WINDOW)[1]
        p, alpha, m_i, l_i = _softmax_step(tl.where(valid, s, float("-inf")), m_i, l_i)
        if VAL_MODE == 2:
            vsc, vze = _mm_terms(vsc, tl.load(vz_ptr + tokp, mask=nmask, other=0.0).to(tl.float32), VAL_BITS)
            vsum = vsum * alpha + tl.sum(p * vze[None, :], 1)
        pv = (p * vsc[None, :]).to(pk_t)
        if VB8:
            a0 = tl.dot(pv, _asm_slice4(vw, VASM0), a0 * alpha[:, None], input_precision=PREC)
            a1 = tl.dot(pv, _asm_slice4(vw, VASM1), a1 * alpha[:, None], input_precision=PREC)
            a2 = tl.dot(pv, _asm_slice4(vw, VASM2), a2 * alpha[:, None], input_precision=PREC)
            a3 = tl.dot(pv, _asm_slice4(vw, VASM3), a3 * alpha[:, None], input_precision=PREC)
        else:
            a0 = _acc_update(a0, alpha, pv, vw, 0, vcb_ptr, VAL_MODE, VAL_BITS, VASM0, pk_t, PREC)
            a1 = _acc_update(a1, alpha, pv, vw, 1, vcb_ptr, VAL_MODE, VAL_BITS, VASM1, pk_t, PREC)
            a2 = _acc_update(a2, alpha, pv, vw, 2, vcb_ptr, VAL_MODE, VAL_BITS, VASM2, pk_t, PREC)
            a3 = _acc_update(a3, alpha, pv, vw, 3, vcb_ptr, VAL_MODE, VAL_BITS, VASM3, pk_t, PREC)

    if NPART == 2 and not X_PHASED:
        # ---- the exact pass: sinks [0, S) and the window of the block's first query, in tiles of
        # BLOCK_X keys; the same online softmax (m_i, l_i) continues, the packed accumulators are
        # rescaled with it, and exact values accumulate unrotated in a second output part.
        d = tl.arange(0, D)
        qx = tl.load(qx_ptr + tok[:, None] * stride_qxt + hq[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        qx = (qx.to(tl.float32) * qk_scale).to(dot_t)
        seq_slot = tl.load(seqslot_ptr + req).to(tl.int64)
        sink_slot = tl.load(sinkslot_ptr + req).to(tl.int64)
        n_sink, sink_hi, win_lo, x_tiles = _x_range(lo, hi, q_min, SINK, WINDOW, BLOCK_X)
        accx = tl.zeros([BM, D], dtype=tl.float32)
        for t in range(0, x_tiles):
            n, nmask = _x_tile(t, lo, hi, n_sink, sink_hi, win_lo, BLOCK_X)
            need, ex = _exact_masks(n, qpos, q_min, SINK, WINDOW)
            kx = _load_exact(
                kn_ptr, rk_ptr, sk_ptr, n, nmask & need, d, d < D, ctx, q_start, stride_knt,
                seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
            )  # fmt: skip
            s = tl.dot(qx, tl.trans(kx.to(dot_t)), input_precision=PREC)
            valid = ex & row_ok[:, None] & nmask[None, :] & (n[None, :] <= qpos[:, None])
            p, alpha, m_i, l_i = _softmax_step(tl.where(valid, s, float("-inf")), m_i, l_i)
            vsum = vsum * alpha
            a0 = a0 * alpha[:, None]
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
            vx = _load_exact(
                vn_ptr, rv_ptr, sv_ptr, n, nmask & need, d, d < D, ctx, q_start, stride_vnt,
                seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
            )  # fmt: skip
            accx = tl.dot(p.to(dot_t), vx.to(dot_t), accx * alpha[:, None], input_precision=PREC)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    vs = vsum[:, None]
    tok_o = tok
    if X_PHASED:  # the program's scalars and row addresses again, from fresh loads (see _x_reload)
        q_start, ctx, lo, hi, q_min = _x_reload(qsl_ptr, seqlen_ptr, req, qb0, pid_s, split_n, BLOCK_Q)
        tok_o = (q_start + qb0 + qi).to(tl.int64)
    obase = out_ptr + pid_s * stride_os + tok_o[:, None] * stride_ot + hq[:, None] * (NPART * D)
    _store_slice(obase, a0 + vs, l_safe, row_ok, 0, SW, D)
    _store_slice(obase, a1 + vs, l_safe, row_ok, 1, SW, D)
    _store_slice(obase, a2 + vs, l_safe, row_ok, 2, SW, D)
    _store_slice(obase, a3 + vs, l_safe, row_ok, 3, SW, D)
    if SPLIT and X_PHASED:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + pid_s * stride_ls + tok_o * stride_lt + hq, lse, mask=row_ok)
    if NPART == 2 and not X_PHASED:
        d2 = tl.arange(0, D)
        tl.store(obase + D + d2[None, :], (accx / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if NPART == 2 and X_PHASED:
        # ---- exact pass, phase 2: (m_i, l_i) are final, so p = exp2(s - m) needs no rescaling; the
        # scores are recomputed (bit for bit as in phase 1) for each of XH column chunks of the exact
        # values, each accumulated [rows, D / XH] and stored as it completes.
        XD: tl.constexpr = D // XH
        # the exact query again (from tok_o: phase 1's [rows, d] pointer tensor is not kept live
        # through the packed loop either), the slots reloaded
        qx = tl.load(
            qx_ptr + tok_o[:, None] * stride_qxt + hq[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0
        )
        qx = (qx.to(tl.float32) * qk_scale).to(dot_t)
        seq_slot = tl.load(seqslot_ptr + req).to(tl.int64)
        sink_slot = tl.load(sinkslot_ptr + req).to(tl.int64)
        qpos = ctx + qb0 + qi
        n_sink, sink_hi, win_lo, x_tiles = _x_range(lo, hi, q_min, SINK, WINDOW, BLOCK_X)
        for h in tl.static_range(XH):
            dh = h * XD + tl.arange(0, XD)
            accx = tl.zeros([BM, XD], dtype=tl.float32)
            for t in range(0, x_tiles):
                n, nmask = _x_tile(t, lo, hi, n_sink, sink_hi, win_lo, BLOCK_X)
                s, need = _x_scores(
                    qx, kn_ptr, rk_ptr, sk_ptr, n, nmask, qpos, q_min, row_ok, d, ctx, q_start, stride_knt,
                    seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW, PREC,
                )  # fmt: skip
                p = tl.exp2(s - m_i[:, None])
                vx = _load_exact(
                    vn_ptr, rv_ptr, sv_ptr, n, nmask & need, dh, dh < D, ctx, q_start, stride_vnt,
                    seq_slot, sink_slot, kvh, HKV, D, SINK, WINDOW,
                )  # fmt: skip
                accx = tl.dot(p.to(dot_t), vx.to(dot_t), accx, input_precision=PREC)
            tl.store(
                obase + D + dh[None, :], (accx / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None]
            )
    if SPLIT and not X_PHASED:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + pid_s * stride_ls + tok * stride_lt + hq, lse, mask=row_ok)


def pair_tables(narrow: bool, max_query_len: int) -> int:
    """The 2-bit codebook decoders of a step (`PAIR_TABLES`' values): byte permutes (2) for decode steps
    of the narrow kernel (`PRMT2_DECODE`), PAIR_TABLES otherwise."""
    return 2 if PRMT2_DECODE and narrow and max_query_len == 1 else PAIR_TABLES


def _asm_for(layout, side: str, bits: int, pairs: int | None = None, join: bool = False) -> tuple[str, str, str, str]:
    """Inline-PTX slice decoders for a side on the GPU (`LOOKUP`), else empty strings (gathers);
    `pairs`: the 2-bit decoders (`pair_tables`; PAIR_TABLES when None); `join`: `join_add`."""
    pairs = PAIR_TABLES if pairs is None else pairs
    none = ("", "", "", "")
    if _interpreting() or LOOKUP == "gather":
        return none
    if fp8_side(layout, side):
        return fp8_slices()
    cb = layout.key_cb16 if layout.key_cb16 is not None else layout.val_cb16
    if cb is not None and not cb.is_cuda:
        return none
    if side == "v" and layout.val_mode == MINMAX:
        if LOOKUP != "shfl" or bits == 3 and not MINMAX3_ASM:
            return none
        return minmax_slices3() if bits == 3 else minmax_slices(bits)
    if LOOKUP == "prmt" and bits != 4 and not (bits == 2 and pairs == 2) or bits in (3, 5) and LOOKUP != "shfl":
        return none
    cache = layout.__dict__.setdefault("_asm_cache", {})
    key = (side, bits, LOOKUP, pairs, join, PRMT3 if bits == 3 else 0)
    if key not in cache:
        from tqserve.kvquant.reference import tq_code_table

        host = tq_code_table(bits, layout.head_dim).half()  # the values the device table was made from
        if bits == 3:
            cache[key] = prmt_slices3(host)[0] if PRMT3 else shfl_slices3(host)
        elif bits == 5:
            cache[key] = shfl_slices5(host)
        elif bits == 2 and pairs == 2:
            cache[key] = prmt_pair_slices(host)
        elif LOOKUP == "shfl" and bits == 2 and pairs:
            cache[key] = shfl_pair_slices(host)
        elif LOOKUP == "shfl":
            cache[key] = shfl_slices(host, bits, join)
        else:
            tables = prmt_tables(host)
            cache[key] = prmt_slices(tables) if tables is not None else none
    return cache[key]


def spread3_asm(layout, side: str, slices: tuple[str, str, str, str]) -> str:
    """`prmt_slices3`' spread for a 3-bit codebook side whose decoders (`_asm_for`'s `slices`) are its byte
    permutes, else "" (shuffles, min-max codes, gathers)."""
    mode, bits = (layout.key_mode, layout.key_bits) if side == "k" else (layout.val_mode, layout.val_bits)
    if not (PRMT3 and mode == CODEBOOK and bits == 3 and slices[0] and slices[0] != slices[1]):
        return ""
    cache = layout.__dict__.setdefault("_asm_cache", {})  # (built once per layout, not per step)
    if "spread3" not in cache:
        from tqserve.kvquant.reference import tq_code_table

        cache["spread3"] = prmt_slices3(tq_code_table(3, layout.head_dim).half())[1]
    return cache["spread3"]


def _asm_prmt_b8(layout) -> tuple[str, str, str, str]:
    """`prmt_slices_b8` of the layout's 2-bit value codebook (the narrow kernel's byte-word values;
    cached like `_asm_for`), or empty strings where `_asm_for` gives none (gathers)."""
    if not _asm_for(layout, "v", 2, 2)[0]:
        return ("", "", "", "")
    cache = layout.__dict__.setdefault("_asm_cache", {})
    if "prmt_b8" not in cache:
        from tqserve.kvquant.reference import tq_code_table

        cache["prmt_b8"] = prmt_slices_b8(tq_code_table(2, layout.head_dim).half())
    return cache["prmt_b8"]


def _asm_b8(layout) -> tuple[str, str, str, str]:
    """`shfl_pair_slices_b8` (or with PAIR_TABLES = 0 `shfl_slices_b8`) of the layout's 2-bit value
    codebook (cached like `_asm_for`)."""
    cache = layout.__dict__.setdefault("_asm_cache", {})
    if ("vb8", PAIR_TABLES) not in cache:
        from tqserve.kvquant.reference import tq_code_table

        host = tq_code_table(2, layout.head_dim).half()
        cache["vb8", PAIR_TABLES] = shfl_pair_slices_b8(host) if PAIR_TABLES else shfl_slices_b8(host)
    return cache["vb8", PAIR_TABLES]


def launch_config(
    rows: int, head_dim: int, exact: bool = False, programs: int = 0, sms: int = 132
) -> tuple[int, int, int, int]:
    """(warps, key tile, programs per SM for split-K, pipeline stages) for programs of `rows` rows;
    `exact`: the layout keeps sink / window copies; `programs`: (request, KV head, query block)
    programs before split-K. A table measured on the card, no run-time autotuning."""
    if rows <= 16 and head_dim == 128 and not exact:
        return PACKED_NUM_WARPS, PACKED_BLOCK_N, PACKED_SPLIT_TARGET, PACKED_STAGES
    if rows <= 16 and head_dim == 128 and programs < sms:
        return FEW_NUM_WARPS, FEW_BLOCK_N, FEW_SPLIT_TARGET, FEW_STAGES
    if rows <= 16 and head_dim >= 128:
        return NUM_WARPS, BLOCK_N, SPLIT_TARGET, NUM_STAGES if programs >= sms else FEW_PROGRAMS_STAGES
    if rows <= 16:
        return SMALL_NUM_WARPS, SMALL_BLOCK_N, SMALL_SPLIT_TARGET, SMALL_STAGES
    target = VERIFY_SPLIT_TARGET if head_dim >= 128 else VERIFY_SMALL_D_SPLIT_TARGET
    if head_dim >= 128:
        stages = VERIFY_EXACT_WIDE_STAGES if exact else VERIFY_WIDE_STAGES
    else:
        stages = VERIFY_STAGES
    return SMALL_NUM_WARPS, SMALL_BLOCK_N, target, stages


def pick_splits(programs: int, max_seq_len: int, sms: int, block_n: int = 128, per_sm: int = 4) -> int:
    """Split-K so that about `per_sm` programs per SM are resident (at least 4 key tiles per split)."""
    target = per_sm * sms
    if programs >= target:
        return 1
    tiles = triton.cdiv(max(1, max_seq_len), block_n)
    return max(1, min(triton.cdiv(target, programs), max(1, tiles // 4), MAX_SPLITS))


def decode_attention(q, k_new, v_new, pages, layout, meta, scale, ring=None, sinks=None, out=None, num_splits=None):
    """`paged.paged_attention` for decode / verify steps over an `eligible` layout (same contract)."""
    import torch

    T, hq, d = q.shape
    hkv = k_new.shape[1]
    group = hq // hkv
    gp = group_pad(group)
    kp = pages[layout.key_name]
    vp = pages[layout.val_name]
    bs = kp.shape[2]
    dev = q.device
    q, k_new, v_new = _row_major(q), _row_major(k_new), _row_major(v_new)
    bq = triton.next_power_of_2(max(1, meta.max_query_len))
    while bq * gp > MAX_ROWS and bq > 1:
        bq //= 2
    bq = max(bq, 16 // gp)  # tl.dot needs at least 16 rows
    n_qblocks = triton.cdiv(max(1, meta.max_query_len), bq)
    programs = meta.num_reqs * hkv * n_qblocks
    exact_copies = bool(layout.sink or layout.window)
    from tqserve.attention import paged_decode_narrow as narrow  # imports this module's helpers

    use_narrow = narrow.eligible(layout, meta.max_query_len, group)
    if use_narrow:
        scalars = tuple(pages[n] for n in (layout.key_scale_name, layout.val_scale_name, layout.val_zero_name) if n)
        warps, block_n, stages, splits, narrow_key = narrow.plan(
            layout, d, group, meta.max_query_len, meta.num_reqs * hkv, meta.max_seq_len, _num_sms(dev), dev, scalars
        )
        splits = num_splits or splits
    else:
        warps, block_n, per_sm, stages = launch_config(bq * gp, d, exact_copies, programs, _num_sms(dev))
        splits = num_splits or pick_splits(programs, meta.max_seq_len, _num_sms(dev), block_n, per_sm)
    tiles = triton.cdiv(max(1, meta.max_seq_len), block_n)
    split_n = triton.cdiv(tiles, splits) * block_n
    splits = triton.cdiv(tiles * block_n, split_n)
    if use_narrow and exact_copies:
        splits += 1  # the exact-pairs program's part comes first

    qx = q
    model_f32 = qx.dtype == torch.float32
    rot_in_kernel = use_narrow and narrow.rotates_query(layout, d, meta.max_query_len)
    if not rot_in_kernel and layout.key_rotation is not None:
        q = rotate_rows(q, layout.key_rotation, hadamard=True)  # y = R x; R is a `Rotation`
    vrot_in_kernel = use_narrow and narrow.unrotates_values(layout, d, meta.max_query_len)
    rotated = layout.rotated_values and not vrot_in_kernel
    # exact values accumulate beside the sliced page accumulators, unless both are in the same space
    npart = narrow.parts(layout, d, meta.max_query_len) if use_narrow else (2 if exact_copies else 1)
    if out is None:
        out = torch.empty_like(qx)
    direct = splits == 1 and npart == 1 and not rotated
    if direct:
        part = out
    else:
        part = torch.empty((max(1, splits), T, hq, npart * d), device=dev, dtype=torch.float32)
    lse = torch.empty((splits, T, hq), device=dev, dtype=torch.float32) if splits > 1 else part
    if exact_copies and (layout.window and ring is None or layout.sink and sinks is None):
        raise ValueError("layout keeps exact copies but no ring / sink buffers were given")
    rk, rv = ring if ring is not None else (k_new, v_new)
    sk, sv = sinks if sinks is not None else (k_new, v_new)
    # unscaled sides (fp8 cast) take another side's scalars as a placeholder the kernel does not read
    some_scale = layout.key_scale_name or layout.val_scale_name
    ks = pages[layout.key_scale_name] if layout.key_scale_name else pages[some_scale] if some_scale else kp
    vs = pages[layout.val_scale_name] if layout.val_scale_name else ks
    vz = pages[layout.val_zero_name] if layout.val_zero_name else vs
    kcb, vcb, _ = centroid_tables(layout, False, model_f32)
    if fp8_side(layout, "k") or fp8_side(layout, "v"):  # fp8 sides gather from the e4m3 table (no asm)
        for t in (kp if fp8_side(layout, "k") else None, vp if fp8_side(layout, "v") else None):
            if t is not None and t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"fp8 pages must be float8_e4m3fn for the decode kernels, got {t.dtype}")
        table = fp8_table(dev, torch.float32 if model_f32 else torch.float16)
        kcb = table if fp8_side(layout, "k") else kcb
        vcb = table if fp8_side(layout, "v") else vcb
    vcb = vcb if vcb is not None else kcb
    # float32 models gather float32 centroids (the asm decoders make fp16 operands)
    pairs = pair_tables(use_narrow, meta.max_query_len)
    join = join_add(layout, meta.max_query_len)
    kasm = ("", "", "", "") if model_f32 else _asm_for(layout, "k", layout.key_bits, pairs, join)
    vasm = ("", "", "", "") if model_f32 else _asm_for(layout, "v", layout.val_bits, pairs, join)
    byte_vals = (
        layout.val_mode == CODEBOOK and layout.val_bits == 2 and bq * gp >= BYTE_VALUES_ROWS and d >= BYTE_VALUES_MIN_D
    )
    # (the narrow kernel takes the two-words-per-register decoders: no byte-word variant there)
    vb8 = byte_vals and bool(vasm[0]) and LOOKUP == "shfl" and not use_narrow
    if vb8:
        vasm = _asm_b8(layout)
    if use_narrow and narrow.byte_values(layout, meta.max_query_len):
        vasm = ("", "", "", "") if model_f32 else _asm_prmt_b8(layout)  # four byte words per register
    stride_os = part.stride(0) if not direct else 0
    dot_f32, prec = _interpreting() or model_f32, "ieee" if model_f32 else "tf32"
    if use_narrow:
        narrow.launch(
            q, kp, ks, vp, vs, vz, kcb, vcb, meta, part, lse, stride_os, splits, split_n, scale * LOG2E,
            layout, kasm, vasm, dot_f32, prec, warps, block_n, stages, narrow_key, (qx, k_new, v_new, rk, rv, sk, sv),
            layout.key_rotation if rot_in_kernel else None, layout.val_rotation if vrot_in_kernel else None,
        )  # fmt: skip
        return finish_parts(part, lse, out, splits, npart, layout, meta, T, hq, d, vrot_in_kernel)
    grid = (n_qblocks, meta.num_reqs * hkv, splits)
    phased = exact_copies and bq * gp >= EXACT_PHASED_ROWS
    LAST_LAUNCH["kernel"] = _decode_kernel[grid](
        q, qx, k_new, v_new, kp, ks, vp, vs, vz, kcb, vcb, rk, rv, sk, sv,
        meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.seq_slots, meta.sink_slots,
        part, lse,
        q.stride(0), qx.stride(0), k_new.stride(0), v_new.stride(0), meta.block_tables.stride(0),
        stride_os, hq * npart * d, lse.stride(0) if splits > 1 else 0, hq,
        split_n, scale * LOG2E,
        HKV=hkv, G=group, GP=gp, D=d, BS=bs, BLOCK_Q=bq, BLOCK_N=block_n,
        KEY_BITS=layout.key_bits, VAL_MODE=layout.val_mode, VAL_BITS=layout.val_bits, SW=S,
        KASM0=kasm[0], KASM1=kasm[1], KASM2=kasm[2], KASM3=kasm[3],
        VASM0=vasm[0], VASM1=vasm[1], VASM2=vasm[2], VASM3=vasm[3],
        SINK=layout.sink, WINDOW=layout.window, NPART=npart, SPLIT=splits > 1,
        DOT_F32=dot_f32, PREC=prec, BLOCK_X=16,
        X_PHASED=phased, XH=EXACT_CHUNKS if phased else 1, FOLD_MASK=bool(FOLD_EXACT_MASK),
        VAL_TRANS=byte_vals, VB8=vb8, ROWS32=bool(ROWS32) and rows32(kp, ks, vp, vs, vz),
        num_warps=warps, num_stages=stages, **({"maxnreg": MAXNREG} if MAXNREG and not _interpreting() else {}),
    )  # fmt: skip
    return finish_parts(part, lse, out, splits, npart, layout, meta, T, hq, d)
