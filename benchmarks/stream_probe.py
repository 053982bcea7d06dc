"""How fast can the decode kernels' page reads go at all? A diagnostic, not a kernel of the engine.

`paged_decode_narrow` streams packed pages at ~78% of the card's copy rate at 32 x 32K and less at
1 x 128K, while SDPA streams its contiguous bf16 K / V at ~100%. This probe separates the read
pattern from the compute: `_stream_kernel` walks the same pages the same way (one program per
(request, KV head, split), key tiles through the block table, the packed key / value words and the
per-token scalars of each tile, the pipeliner's asynchronous copies) but only folds the words into
an integer sum. If it streams near the copy rate with the narrow kernel's launch shape (one warp,
32-key tiles, 3 stages, the planner's splits), the narrow kernel is held back by its compute
(instruction latency at its occupancy), not by the reads; if not, by the read pattern itself. The
other launch shapes show what wider programs would buy.

    python benchmarks/stream_probe.py [--presets turboquant_4bit_nc,tq3] [--graphs]

Prints, per case and launch shape, ms, GB/s of the page bytes, the fraction of the copy rate, and
the narrow kernel (`paged_attention`) and SDPA on the same case for reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tqserve.bench import kernels as bk  # noqa: E402


@triton.jit
def _stream_kernel(
    kp_ptr, vp_ptr, ks_ptr, vs_ptr, vz_ptr, bt_ptr, seqlen_ptr, out_ptr, stride_bt, split_n,
    HKV: tl.constexpr, BS: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr, ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Sum of every 32-bit word of this program's keys' pages (KW / VW words per key and side; the
    fp16 scalars through their 32-bit words), written to out[program]."""
    pid_rh = tl.program_id(0)
    pid_s = tl.program_id(1)
    req = pid_rh // HKV
    kvh = pid_rh % HKV
    seq_len = tl.load(seqlen_ptr + req)
    lo = pid_s * split_n
    hi = tl.minimum(seq_len, lo + split_n)
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    kw_ = tl.arange(0, KW)
    vw_ = tl.arange(0, VW)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        page = tl.load(bt_ptr + req * stride_bt + n // BS, mask=nmask, other=0).to(tl.int64)
        row = page * (HKV * BS) + kvh * BS + n % BS
        k = tl.load(kp_ptr + row[:, None] * KW + kw_[None, :], mask=nmask[:, None], other=0)
        v = tl.load(vp_ptr + row[:, None] * VW + vw_[None, :], mask=nmask[:, None], other=0)
        acc += tl.sum(k, 1) + tl.sum(v, 1)
        acc += tl.load(ks_ptr + row // 2, mask=nmask, other=0) + tl.load(vs_ptr + row // 2, mask=nmask, other=0)
        if ZEROS:
            acc += tl.load(vz_ptr + row // 2, mask=nmask, other=0)
    tl.store(out_ptr + pid_rh * tl.num_programs(1) + pid_s, tl.sum(acc, 0))


def stream(case, warps: int, block_n: int, stages: int, programs_per_sm: int):
    """A closure launching the probe over `case`'s pages, split so that (request x KV head) x splits
    fills programs_per_sm programs on every SM."""
    pages = case.pages
    kp, vp = pages["k_idx"], pages["v_idx"]
    hkv, bs = kp.shape[1], kp.shape[2]
    i32 = torch.int32
    ks, vs = pages["k_scale"].view(i32), pages["v_scale"].view(i32)
    vz = pages["v_zero"].view(i32) if "v_zero" in pages else vs
    meta = case.meta
    slots = torch.cuda.get_device_properties(kp.device).multi_processor_count * programs_per_sm
    pairs = meta.num_reqs * hkv
    longest = meta.max_seq_len
    splits = max(1, slots // pairs)
    split_n = triton.cdiv(triton.cdiv(longest, splits), block_n) * block_n
    splits = triton.cdiv(longest, split_n)
    out = torch.empty(pairs * splits, device=kp.device, dtype=i32)

    def run():
        _stream_kernel[(pairs, splits)](
            kp.view(i32), vp.view(i32), ks, vs, vz, meta.block_tables, meta.seq_lens, out,
            meta.block_tables.stride(0), split_n,
            HKV=hkv, BS=bs, KW=kp.shape[3] // 4, VW=vp.shape[3] // 4, ZEROS="v_zero" in pages, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return run, splits


SHAPES = [  # (warps, key tile, stages, programs per SM): the narrow kernel's first
    (1, 32, 3, 16),
    (1, 64, 3, 16),
    (1, 32, 4, 16),
    (1, 32, 3, 8),
    (4, 128, 3, 4),
    (4, 128, 2, 4),
    (8, 256, 2, 2),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="turboquant_4bit_nc,tq3")
    ap.add_argument("--cases", default="1x131072,32x32768", help="requests x context, comma-separated")
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (as `tqserve bench kernels`)")
    args = ap.parse_args()
    bk.GRAPHS = args.graphs
    dev = torch.device("cuda")
    copy = bk.copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}; copy {copy:.0f} GB/s; graphs {args.graphs}")
    for spec in args.cases.split(","):
        n_req, ctx = (int(x) for x in spec.split("x"))
        sdpa_ms, _ = bk.sdpa_decode_ms(n_req, ctx, 1, 32, 8, 128, dev)
        print(f"case {n_req} x {ctx}: sdpa {sdpa_ms:.4f} ms")
        for preset in args.presets.split(","):
            case = bk.Case(preset, n_req, ctx, 1, 32, 8, 128, dev)
            nbytes = n_req * (ctx + 1) * case.fmt.page_bytes_per_token()
            ms = bk._bench(case.run)
            print(f"  {preset} paged_attention {ms:.4f} ms ({sdpa_ms / ms:.2f}x sdpa)")
            for warps, block_n, stages, per_sm in SHAPES:
                run, splits = stream(case, warps, block_n, stages, per_sm)
                ms = bk._bench(run)
                gbs = nbytes / ms / 1e6
                print(
                    f"  {preset} stream warps {warps} tile {block_n} stages {stages} {per_sm}/SM splits {splits}: "
                    f"{ms:.4f} ms, {gbs:.0f} GB/s ({gbs / copy:.1%} of copy)"
                )
            case.free()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
