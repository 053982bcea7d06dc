"""The tail of every paged-attention launch: split-K combine, inverse value rotation, exact part, cast.

The attention kernels write float32 partials: one per split of the key range (flash-decoding), and
beside the page part an exact-value part when the layout keeps sink / window copies; codebook values
are summed in the rotated space. `finish_parts` turns those into the step's output in two launches
at most, whatever the layout:

- `_split_reduce_kernel` combines the splits of every (token, query head) with their log-sum-exp
  weights. Its grid also splits the row's columns, so that one request with hundreds of splits
  still spreads over the SMs and each program's [splits, columns] tile stays in registers (one
  program per row over a [256, 256] tile spilled: tq3's combine took 31 us of a 129 us step at
  1 x 128K on the H100, eleventh session).
- `_finish_kernel` rotates the page part back (rows y R with the layer's value rotation, a
  tensor-core dot: `tf32x3` for 16-bit models, IEEE for float32 ones), adds the exact part, casts to
  the model's dtype and zeroes the graph-padding rows. It replaces a cuBLAS GEMM (two launches:
  split-K GEMM + reduce), an add and a cast.

Grids depend on host integers only; the split count and the row counts are not specialized, so one
binary per (layout, split-count class) serves every step (`warm_split_combine` builds them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tqserve.attention.tuning import MAX_SPLITS, NARROW_MAX_SPLITS

# Largest [splits, columns] tile of one combine program (float32 elements; 32 per thread at 4 warps),
# its warps and the fewest columns it takes (A/B knobs: a one-warp program reduces over the splits in
# shuffles only).
COMBINE_TILE = 4096
COMBINE_WARPS = 4
COMBINE_MIN_W = 16
# Issue the partials' load before the log-sum-exps' reduction (1), so that the two L2 round trips of a
# combine program overlap instead of following each other (0: the load after the weights). H100,
# twenty-sixth session, 4bit_nc 1 x 128K, medians of 3 (0 / 1): 0.0805 / 0.0802 ms, 0.0810 / 0.0805 (bs 32)
COMBINE_PART_FIRST = 1
# Steps with few splits (decode and verify steps of a batch) combine whole rows instead: a program takes
# COMBINE_ROWS_TILE // width rows and walks the splits in a static loop, so the loads of every split of its
# rows are in flight at once. The [splits, columns] program above spends 4 warps on one row's 4-16 floats per
# thread and waits on two dependent L2 round trips: H200 (forty-second session, `kernel_probe.py`), 16.0 us of
# a 32 x 5 x 32K verify step (5,120 rows x 4 splits x 128 columns, 10.5 MB of partials) and 5.0 us of a
# 32 x 32K decode step (1,024 rows x 8 splits); whole rows: 4.1 and 3.4 us (replays, medians of 3: 4bit_nc verify
# 0.5626 -> 0.5508 ms with the Hadamard rotation, decode 0.3667 -> 0.3654). Tiles of 512 / 256 floats: 4bit_nc
# decode 0.3673 / 0.3685 ms against 0.3658, tq3 decode (256 columns: page and exact parts) 0.3909 / 0.3905
# against 0.3936, verify alike within 1% (2% slower at 256 for 4bit_nc).
COMBINE_ROWS_MAX_SPLITS = 16
COMBINE_ROWS_TILE = 1024
COMBINE_ROWS_WARPS = 4
# Rows x output columns of one `_finish_kernel` program (tl.dot needs 16 of each).
FINISH_ROWS = 16
FINISH_COLS = 64
FINISH_K = 64  # rotation rows per dot


@triton.jit(do_not_specialize=["n_splits", "stride_ls"])  # split count, tokens x heads
def _split_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, n_splits, stride_ps, stride_pt, stride_ls, stride_lt, stride_ot,
    W: tl.constexpr, BW: tl.constexpr, SP: tl.constexpr, PART_FIRST: tl.constexpr,
):  # fmt: skip
    """Columns [c0, c0 + BW) of one (token, query head): the splits' partials weighted by
    exp2(lse - max) and divided by their sum (base-2 log-sum-exps, as the kernels write them)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    smask = s < n_splits
    c = tl.program_id(2) * BW + tl.arange(0, BW)
    cm = c < W
    part = part_ptr + s[:, None] * stride_ps + t * stride_pt + h * W + c[None, :]
    if PART_FIRST:
        o = tl.load(part, mask=smask[:, None] & cm[None, :])
    lse = tl.load(lse_ptr + s * stride_ls + t * stride_lt + h, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    if not PART_FIRST:
        o = tl.load(part, mask=smask[:, None] & cm[None, :])
    o = tl.where(w[:, None] > 0.0, o, 0.0)  # a split with no keys may have written anything
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * W + c, res.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit(do_not_specialize=["n_rows", "n_splits", "stride_ls"])  # tokens x heads, split count
def _split_rows_kernel(
    part_ptr, lse_ptr, out_ptr, n_rows, n_splits, stride_ps, stride_pt, stride_ls, stride_lt, stride_ot,
    HQ: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BR: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """`_split_reduce_kernel` for rows r = token * HQ + head in [r0, r0 + BR), all W columns: the splits'
    largest log-sum-exp first, then each split's partials weighted by exp2(lse - max), in split order."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    live = r < n_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    c = tl.arange(0, WP)
    cm = c < W
    prow = part_ptr + (t * stride_pt + h * W)[:, None] + c[None, :]
    lrow = lse_ptr + t * stride_lt + h
    m = tl.full([BR], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SP):
        ok = live & (tl.zeros([BR], dtype=tl.int32) + s < n_splits)
        m = tl.maximum(m, tl.load(lrow + stride_ls * s, mask=ok, other=float("-inf")))
    acc = tl.zeros([BR, WP], dtype=tl.float32)
    den = tl.zeros([BR], dtype=tl.float32)
    for s in tl.static_range(SP):
        ok = live & (tl.zeros([BR], dtype=tl.int32) + s < n_splits)
        o = tl.load(prow + tl.full([], s, tl.int64) * stride_ps, mask=ok[:, None] & cm[None, :], other=0.0)
        ls = tl.load(lrow + stride_ls * s, mask=ok, other=float("-inf"))
        w = tl.where(ls > float("-inf"), tl.exp2(ls - m), 0.0)
        acc += w[:, None] * tl.where(w[:, None] > 0.0, o, 0.0)  # a split with no keys may have written anything
        den += w
    dst = out_ptr + (t * stride_ot + h * W)[:, None] + c[None, :]
    tl.store(dst, (acc / den[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["rows", "n_out"])  # tokens x heads: one binary for every step size
def _finish_kernel(
    src_ptr, rot_ptr, out_ptr, rows, n_out, stride_src, stride_ot, hq,
    D: tl.constexpr, DP: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
    ROTATED: tl.constexpr, EXACT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Output rows m (token m // hq, head m % hq), columns [c0, c0 + BC): (y R if ROTATED else y) + x,
    where src row m is [y | x] (x only with EXACT); rows in [rows, n_out) get zeros (graph padding)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    live = m < rows
    cm = c < D
    src = src_ptr + m.to(tl.int64)[:, None] * stride_src
    if ROTATED:
        res = tl.zeros((BM, BC), dtype=tl.float32)
        for k0 in tl.static_range(0, DP, BK):  # K chunks bound the registers at d = 256
            k = k0 + tl.arange(0, BK)
            y = tl.load(src + k[None, :], mask=live[:, None] & (k < D)[None, :], other=0.0)
            r = tl.load(rot_ptr + k[:, None] * D + c[None, :], mask=(k < D)[:, None] & cm[None, :], other=0.0)
            res = tl.dot(y, r, res, input_precision=PREC)
    else:
        res = tl.load(src + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)
    if EXACT:
        res += tl.load(src + D + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)
    res = tl.where(live[:, None], res, 0.0)
    dst = out_ptr + (m // hq).to(tl.int64)[:, None] * stride_ot + (m % hq)[:, None] * D + c[None, :]
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=(m < n_out)[:, None] & cm[None, :])


def combine_width(splits: int, w: int) -> int:
    """Columns per combine program: the row's whole width unless [splits, width] passes COMBINE_TILE."""
    return max(COMBINE_MIN_W, min(triton.next_power_of_2(w), COMBINE_TILE // triton.next_power_of_2(splits)))


def combine_splits(part, lse, red, splits: int, num_tokens: int, hq: int, w: int) -> None:
    """Split-K partials [splits, T, hq, w] + log-sum-exps [splits, T, hq] -> red [T, hq, w] (rows of
    the first num_tokens tokens; red's heads and columns packed)."""
    if splits <= COMBINE_ROWS_MAX_SPLITS:
        wp = triton.next_power_of_2(w)
        br = max(1, COMBINE_ROWS_TILE // wp)
        _split_rows_kernel[(triton.cdiv(num_tokens * hq, br),)](
            part, lse, red, num_tokens * hq, splits, part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
            red.stride(0), HQ=hq, W=w, WP=wp, BR=br, SP=triton.next_power_of_2(splits), num_warps=COMBINE_ROWS_WARPS,
        )  # fmt: skip
        return
    bw = combine_width(splits, w)
    _split_reduce_kernel[(num_tokens, hq, triton.cdiv(w, bw))](
        part, lse, red, splits, part.stride(0), part.stride(1), lse.stride(0), lse.stride(1), red.stride(0),
        W=w, BW=bw, SP=triton.next_power_of_2(splits), PART_FIRST=COMBINE_PART_FIRST, num_warps=COMBINE_WARPS,
    )  # fmt: skip


def _finish(src: torch.Tensor, rot: torch.Tensor | None, out: torch.Tensor, npart: int, num_tokens: int) -> None:
    """`_finish_kernel` over out [T, hq, d] (heads and dims packed) from src rows [T * hq, npart * d]."""
    T, hq, d = out.shape
    if rot is not None and (rot.shape != (d, d) or not rot.is_contiguous() or rot.dtype != torch.float32):
        raise ValueError(f"the value rotation must be a contiguous float32 [{d}, {d}] matrix")
    exact = npart == 2
    dp = max(16, triton.next_power_of_2(d))
    prec = "ieee" if out.dtype == torch.float32 else "tf32x3"
    grid = (triton.cdiv(T * hq, FINISH_ROWS), triton.cdiv(d, FINISH_COLS))
    _finish_kernel[grid](
        src, rot if rot is not None else src, out, num_tokens * hq, T * hq, src.stride(0), out.stride(0), hq,
        D=d, DP=dp, BK=min(dp, FINISH_K), BM=FINISH_ROWS, BC=FINISH_COLS,
        ROTATED=rot is not None, EXACT=exact, PREC=prec,
    )  # fmt: skip


def _packed_rows(out: torch.Tensor) -> bool:
    return out.stride(-1) == 1 and out.stride(-2) == out.shape[-1]


def finish_parts(
    part, lse, out, splits: int, npart: int, layout, meta, T: int, hq: int, d: int, unrotated: bool = False
):
    """Shared tail of the paged kernels' launchers: combine split-K partials, rotate codebook values
    back (rows y R), add the exact-value part when the kernel wrote one, zero graph-padding rows.

    part: [splits, T, hq, npart * d] float32 (or `out` itself when the kernel wrote it directly);
    lse: [splits, T, hq]. `unrotated`: the kernel took codebook values out of the rotated space itself
    (`paged_decode_narrow.unrotates_values`). Returns `out`."""
    rotated = layout.rotated_values and not unrotated
    tail = rotated or npart == 2
    if splits > 1:
        w = npart * d
        red = out if not tail else torch.empty((T, hq, w), device=out.device, dtype=torch.float32)
        combine_splits(part, lse, red, splits, meta.num_tokens, hq, w)
        part = red
    if tail:
        dst = out if _packed_rows(out) else torch.empty(out.shape, device=out.device, dtype=out.dtype)
        rot = layout.val_rotation if rotated else None
        _finish(part.reshape(-1, npart * d)[: T * hq], rot, dst, npart, meta.num_tokens)
        if dst is not out:
            out.copy_(dst)
    elif meta.num_tokens < T:
        out[meta.num_tokens :].zero_()
    return out


def warm_split_combine(layout, hq: int, d: int, model_dtype: torch.dtype, device: torch.device) -> None:
    """Compile the split-K combine for every split-count class (SP = 2 .. the largest cap, a constexpr)
    and every (width, output dtype) a launcher of this layout can ask for, and the finishing kernel:
    which split count a step gets depends on its lengths and batch, so the engine's warm-up steps
    cannot reach them all."""
    rotated = layout.rotated_values
    # (npart, rotated back here): codebook values are rotated back by `_finish_kernel`, or by the decode
    # kernel itself (`paged_decode_narrow.unrotates_values`), whose combine then writes `out` directly
    tails = {(1, True)} if rotated else set()
    combos = {(1, model_dtype)}  # finish_parts writes `out` directly when it can
    if rotated:
        combos.add((1, torch.float32))
    if layout.sink or layout.window:
        combos.add((2, torch.float32))  # the exact-value part beside the page part
        tails.add((2, rotated))  # (the narrow kernel's verify steps rotate back themselves: one part)
    for npart, red_dtype in sorted(combos, key=str):
        w = npart * d
        red = torch.empty((1, hq, w), device=device, dtype=red_dtype)
        splits = 2
        while splits <= max(MAX_SPLITS, NARROW_MAX_SPLITS):
            part = torch.zeros((splits, 1, hq, w), device=device, dtype=torch.float32)
            lse = torch.zeros((splits, 1, hq), device=device, dtype=torch.float32)
            combine_splits(part, lse, red, splits, 1, hq, w)
            splits *= 2
    out = torch.empty((1, hq, d), device=device, dtype=model_dtype)
    for npart, back in sorted(tails):
        src = torch.zeros((hq, npart * d), device=device, dtype=torch.float32)
        _finish(src, layout.val_rotation if back else None, out, npart, 1)
