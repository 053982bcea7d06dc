"""Static launch configurations for the paged-attention kernels, per shape class.

No runtime autotuning (invariant 4: every specialization is known before graph capture). A shape
class is decided from host integers only: the step's `max_query_len`, the GQA group and head size.
Numbers were picked on an H100 (see docs/benchmarks.md, "Kernels"); they are leads for other cards.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class AttnConfig:
    block_q: int  # query tokens per program (rows = block_q * padded group)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    prefetch: bool = False  # register double buffering of packed tiles (paged.py `PREFETCH`)


def group_pad(group: int) -> int:
    return triton.next_power_of_2(group)


# Benchmarks may pin a configuration per shape class ("decode" / "extend") to compare variants.
OVERRIDES: dict[str, AttnConfig] = {}


def pick_config(
    max_query_len: int, group: int, head_dim: int, packed: bool, exact: bool = False, codebook_key_bits: int = 0
) -> AttnConfig:
    """Decode (1 token), verify (a few tokens) and extend (long chunks) get different tiles.

    Rows of a program are (query token, query head of the KV head): decode packs the GQA group
    into the rows of one tensor-core tile (padded to 16), extend fills up to 128 rows.
    """
    gp = group_pad(group)
    dp = triton.next_power_of_2(head_dim)
    big_d = dp >= 256
    if max_query_len <= 16:
        # Decode / spec-verify: cover every query token of a request in one program so each page is
        # read once per (request, KV head); tiles are memory-bound, so wide key tiles.
        bq = triton.next_power_of_2(max(1, max_query_len))
        while bq * gp > 64 and bq > 1:
            bq //= 2
        bq = max(bq, 16 // gp)  # tl.dot needs at least 16 rows
        if "decode" in OVERRIDES:
            o = OVERRIDES["decode"]
            return AttnConfig(bq, o.block_n, o.num_warps, o.num_stages, o.prefetch)
        block_n = 32 if big_d else 64
        if packed:
            # Packed pages (TurboQuant / min-max values): the next tile's packed words, norms and scales
            # are loaded into registers while this one is decoded (no software pipeliner: it stages the
            # words through shared memory before they are converted in registers anyway, which cost
            # 1.5x (4bit_nc) to 2.3x (tq4) in H200 runs 4-6, docs/benchmarks.md "Kernels").
            # Tiles from the H200 sweep of 2026-11-26 (decode 32 x 32K): 3- and 4-bit keys without exact
            # copies run best with 128-key tiles (4bit_nc 2.37 vs 2.57 ms at 64, 3bit_nc 2.17 vs 2.42),
            # 5-bit keys (per-element lookups, most registers) with 32 (tq4 3.77 vs 4.17 ms at 64);
            # sink / window presets keep 64 in decode. Verify 32 x (1+4) (32 rows), 4bit_nc: 128 keys
            # 3.06 ms, 64 keys 3.56, 32 keys 3.71; tq4: 32 keys 4.53, 64 keys 5.21; tq3 (sink / window):
            # 32 keys 3.46, 64 keys 3.80 (fewer spills).
            if codebook_key_bits >= 5 or (exact and bq * gp > 16):
                block_n = 32
            elif codebook_key_bits in (3, 4) and not exact and not big_d and bq * gp <= 32:
                block_n = 128
            return AttnConfig(bq, block_n, _warps(bq * gp, block_n), 1, True)
        return AttnConfig(bq, block_n, _warps(bq * gp, block_n), 3)
    # Extend: compute-bound, flash-attention style 64..128-row tiles (64 when decoding packed
    # tiles or d = 256: a 128-row tile with two accumulators overflows shared memory).
    rows = 64 if (big_d or packed) else 128
    if "extend" in OVERRIDES:
        o = OVERRIDES["extend"]
        return AttnConfig(max(1, o.block_q // gp), o.block_n, o.num_warps, o.num_stages)
    bq = max(1, rows // gp)
    block_n = 32 if big_d else 64
    # exact sink/window tiles add a second key tile, a second value tile and (rotated values) a
    # second accumulator: one pipeline stage keeps that under the 227 KB of shared memory.
    return AttnConfig(bq, block_n, 8, 1 if (exact or big_d) else 2)


def _warps(rows: int, block_n: int) -> int:
    """Warps of a decode / verify program. 64-row tiles against 32-key tiles get 8: with 4 warps
    Triton 3.6 miscompiles that shape on sm_90 (out-of-bounds shared-memory reads in the score dot,
    or silently wrong scores; H100, 2026-11-26: 16-token chunks of a GQA-3 model, 5-token verify
    at GQA 7, tq4 / tq3 pages). 8 warps, 64-key tiles or 32-row tiles all compute it correctly;
    tests/kernels/test_paged_attention.py::test_wide_rows_short_key_tiles keeps the shape covered."""
    return 8 if rows >= 64 and block_n <= 32 else 4


# Largest split counts the launchers pick (here and paged_decode.pick_splits; the narrow decode
# kernel's, attention/paged_decode_narrow.py); the warm-up compiles the split-K combine up to the
# larger (finish.warm_split_combine).
MAX_SPLITS = 128
NARROW_MAX_SPLITS = 512


def pick_splits(num_reqs: int, num_kv_heads: int, num_qblocks: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """Split-K count (flash-decoding) so that few long requests still fill the card.

    Depends on host integers only, so the grid does not depend on data.
    """
    programs = max(1, num_reqs * num_kv_heads * num_qblocks)
    target = 2 * sms
    if programs >= target:
        return 1
    tiles = triton.cdiv(max(1, max_seq_len), block_n)
    # at least 8 tiles per split, so the partial-result traffic stays small
    by_len = max(1, tiles // 8)
    return max(1, min(triton.cdiv(target, programs), by_len, MAX_SPLITS))
