"""`tqserve bench kernels`: paged attention and store kernels against SDPA and the card's copy rate.

Everything is measured side by side in one process on one card: a device-to-device copy (the
bandwidth ceiling, bytes read + written), `F.scaled_dot_product_attention` on contiguous bf16 KV,
then the Triton kernels over bf16 / fp8 / TurboQuant pages filled with random (never zero) data.
Times are medians of `triton.testing.do_bench` (CUDA events). Bytes are the fewest a kernel must
move: every page byte of every key it attends to, read once. Decode and verify are timed as one call
alone, and as `DECODE_LAYERS` calls back to back (per call), the way a step's graph runs one
attention call per layer; stores likewise (`STORE_LAYERS`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import torch
import torch.nn.functional as F

PRESETS = ["auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq4", "tq3"]


GRAPHS = False  # time CUDA-graph replays of each call (`--graphs`)


def _bench(fn, rep_ms: int = 200) -> float:
    """Median ms of fn (CUDA events; the L2 is flushed before every call). With GRAPHS, fn is
    captured once into a CUDA graph and its replay is timed: the kernels' time without the host's
    launch overhead, which otherwise dominates sub-0.3 ms calls of several launches."""
    import triton

    if GRAPHS:
        fn()  # compile and warm outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def copy_bandwidth(dev) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written, timed as an eager
    call whatever GRAPHS says. Captured in a CUDA graph, `copy_` becomes a memcpy node that the copy
    engine serves at ~2,420 GB/s on an H100, where the eager call (a copy kernel on the SMs) moves
    ~2,990 GB/s (fifteenth session; `copy_bandwidths` gives both): the card's copy rate is the
    faster one. Before that session, every "of copy" fraction of a `--graphs` run was taken against
    the slower one."""
    return max(copy_bandwidths(dev).values())


def copy_bandwidths(dev) -> dict[str, float]:
    """GB/s of the same 1 GiB copy as an eager call and as a CUDA-graph replay."""
    global GRAPHS
    n = 1 << 30
    a = torch.randn(n // 2, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    saved, out = GRAPHS, {}
    try:
        for label, graphs in (("eager", False), ("graph", True)):
            GRAPHS = graphs
            out[label] = 2 * n / (_bench(lambda: b.copy_(a)) * 1e-3) / 1e9
    finally:
        GRAPHS = saved
    return out


def _meta(n_req: int, ctx: int, qlen: int, bs: int, dev):
    from tqserve.attention.backend import AttentionMetadata

    seq = ctx + qlen
    per = math.ceil(seq / bs)
    perm = torch.randperm(n_req * per, device=dev).to(torch.int32) + 1  # page 0 is the null page
    tables = perm.view(n_req, per)
    qsl = torch.arange(0, n_req + 1, device=dev, dtype=torch.int32) * qlen
    pos = (ctx + torch.arange(qlen, device=dev)).repeat(n_req)
    req = torch.arange(n_req, device=dev).repeat_interleave(qlen)
    slots = tables[req, pos // bs].long() * bs + pos % bs
    return AttentionMetadata(
        num_reqs=n_req,
        num_tokens=n_req * qlen,
        max_query_len=qlen,
        max_seq_len=seq,
        query_start_loc=qsl,
        seq_lens=torch.full((n_req,), seq, device=dev, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        positions=pos,
        seq_slots=torch.arange(1, n_req + 1, device=dev, dtype=torch.int32),
        sink_slots=torch.arange(1, n_req + 1, device=dev, dtype=torch.int32),
    ), n_req * per + 1


def _fill_pages(pages: dict[str, torch.Tensor]) -> None:
    """Random, valid, never-zero page contents (timing only)."""
    for name, t in pages.items():
        if t.dtype == torch.uint8:
            t.random_(0, 256)
        elif t.dim() == 3:  # per-token scale / norm / zero
            t.uniform_(0.05, 1.0) if not name.endswith("zero") else t.uniform_(-1.0, -0.1)
        else:
            t.copy_(torch.randn(t.shape, device=t.device).to(t.dtype))


class Case:
    def __init__(self, preset, n_req, ctx, qlen, hq, hkv, d, dev, bs=16):
        from tqserve.attention.paged import layout_for_format
        from tqserve.kvquant.presets import make_layer_format

        self.fmt = make_layer_format(preset, 5, hkv, d, torch.bfloat16)
        self.meta, nblocks = _meta(n_req, ctx, qlen, bs, dev)
        self.pages = self.fmt.allocate(nblocks, bs, dev)
        _fill_pages(self.pages)
        self.layout = layout_for_format(self.fmt, dev)
        t = n_req * qlen
        self.q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
        self.k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
        self.ring = self.sinks = None
        if self.fmt.window:
            shape = (n_req + 1, hkv, self.fmt.window, d)
            self.ring = (torch.randn(shape, device=dev).bfloat16(), torch.randn(shape, device=dev).bfloat16())
        if self.fmt.sink:
            shape = (n_req + 1, hkv, self.fmt.sink, d)
            self.sinks = (torch.randn(shape, device=dev).bfloat16(), torch.randn(shape, device=dev).bfloat16())
        self.out = torch.empty_like(self.q)
        self.d = d
        # fewest bytes: every page byte of every (request, key) read once + q / out
        self.bytes = n_req * (ctx + qlen) * self.fmt.page_bytes_per_token() + 2 * self.q.numel() * 2

    def run(self, num_splits: int | None = None):
        from tqserve.attention.paged import paged_attention

        return paged_attention(
            self.q, self.k, self.v, self.pages, self.layout, self.meta, self.d**-0.5,
            ring=self.ring, sinks=self.sinks, out=self.out, num_splits=num_splits,
        )  # fmt: skip

    def free(self):
        self.pages = None


def sdpa_decode_ms(n_req, ctx, qlen, hq, hkv, d, dev, layers: int = 1) -> tuple[float, float]:
    """SDPA over contiguous bf16 K/V [B, Hkv, L, d] with GQA (no causal mask needed for qlen 1). With
    `layers` > 1, that many calls back to back, each on K/V of its own; ms per call."""
    calls = []
    for _ in range(layers):
        q = torch.randn(n_req, hq, qlen, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(n_req, hkv, ctx + qlen, d, device=dev, dtype=torch.bfloat16)
        calls.append((q, k, torch.randn_like(k)))

    def run() -> None:
        for q, k, v in calls:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms = _bench(run) / layers
    nbytes = 2 * calls[0][1].numel() * 2
    return ms, nbytes


def sdpa_flash_tflops(dev, hq=32, hkv=8, d=128, L=8192) -> float:
    """Causal bf16 prefill through SDPA (flash backend): the extend throughput anchor."""
    q = torch.randn(1, hq, L, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, hq, L, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = 4 * hq * d * L * L / 2
    return flops / (ms * 1e-3) / 1e12


def sdpa_flash_extend_ms(dev, hq, hkv, d, ctx, chunk) -> float:
    """SDPA (flash backend, bf16) on the extend shape: the chunk's queries against the whole prefix
    (no mask) plus the chunk against itself (causal), K/V expanded to every query head. The same
    useful work as the paged extend step, short of merging the two softmax partials."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, hq, chunk, d, device=dev, dtype=torch.bfloat16)
    kp = torch.randn(1, hq, ctx, d, device=dev, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    kc = torch.randn(1, hq, chunk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)

    def run():
        F.scaled_dot_product_attention(q, kp, vp)
        F.scaled_dot_product_attention(q, kc, vc, is_causal=True)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return _bench(run)


def extend_rows(dev, ctx, chunk, presets, hq, hkv, d, flash_8k, rows, sweep=(), old=("turboquant_4bit_nc",)):
    """Extend: one `chunk`-token chunk over a `ctx` prefix, TFLOP/s of the causal work against SDPA
    flash on the same shape and on an 8K causal prefill. Packed presets run the extend kernel
    (attention/paged_extend.py); `old` presets are timed through paged.py's kernel as well, `sweep`
    presets with other tile shapes."""
    from tqserve.attention import paged_extend

    flops = 4 * hq * d * chunk * (ctx + (chunk + 1) / 2)
    f_ms = sdpa_flash_extend_ms(dev, hq, hkv, d, ctx, chunk)
    flash = flops / (f_ms * 1e-3) / 1e12
    rows.append({"case": f"sdpa flash extend {chunk} over {ctx}", "ms": f_ms, "TFLOPs": flash})
    print(f"sdpa flash extend {chunk} over {ctx} (bf16, same shape): {f_ms:.3f} ms {flash:.0f} TFLOP/s", flush=True)

    def one(name, c, **extra):
        ms = _bench(c.run)
        tf = flops / (ms * 1e-3) / 1e12
        ck = paged_extend.LAST_LAUNCH.get("kernel") if paged_extend.takes(c.layout) else None
        regs = (getattr(ck, "n_regs", "?"), getattr(ck, "n_spills", "?")) if ck is not None else ("", "")
        row = {"case": name, "ms": ms, "TFLOPs": tf, "vs_flash_same_shape": tf / flash, "vs_flash_8k": tf / flash_8k}
        row.update(extra, regs=regs[0], spills=regs[1])
        rows.append(row)
        print(
            f"{name:58s} {ms:8.3f} ms {tf:5.0f} TFLOP/s  {tf / flash:5.2f} of flash (same shape)  "
            f"{tf / flash_8k:5.2f} of flash 8K  regs {regs[0]} spills {regs[1]}",
            flush=True,
        )

    for p in presets:
        c = Case(p, 1, ctx, chunk, hq, hkv, d, dev)
        one(f"paged {p} extend {chunk} over {ctx}", c)
        ref = None
        if p in old and paged_extend.takes(c.layout):
            new = c.run().float().clone()
            paged_extend.ENABLED = False
            try:
                one(f"paged {p} extend {chunk} over {ctx} (paged.py kernel)", c)
                ref = c.run().float().clone()
            finally:
                paged_extend.ENABLED = True
            err = float((new - ref).norm() / ref.norm())
            rows[-1]["rel_err_vs_extend_kernel"] = err
            print(f"    extend kernel vs paged.py kernel on the same pages: rel err {err:.2e}", flush=True)

        def check(c=c, ref=ref):
            if ref is not None:
                err = float((c.run().float() - ref).norm() / ref.norm())
                rows[-1]["rel_err_vs_paged_py"] = err
                print(f"    vs paged.py kernel: rel err {err:.2e}", flush=True)

        if p in sweep and paged_extend.takes(c.layout):
            from tqserve.attention.paged import FAST

            FAST["prefetch"] = False
            try:
                one(f"  sweep {p} default tiles, no register prefetch", c)
                check()
            finally:
                FAST["prefetch"] = True
            for cfg in (
                paged_extend.ExtendConfig(128, 64, 8),
                paged_extend.ExtendConfig(256, 32, 16),
                paged_extend.ExtendConfig(256, 64, 16, lazy=True),
                paged_extend.ExtendConfig(128, 128, 8),
            ):
                paged_extend.OVERRIDE["extend"] = cfg
                try:
                    one(f"  sweep {p} rows={cfg.rows} bn={cfg.block_n} w={cfg.num_warps} lazy={int(cfg.lazy)}", c)
                    check()
                except Exception as e:  # out of resources: report and go on
                    print(f"  sweep {p} {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
                finally:
                    paged_extend.OVERRIDE.clear()
        c.free()
        del c
        torch.cuda.empty_cache()
    return flash


STORE_LAYERS = 8  # the back-to-back store rows: layers per timed call
# The back-to-back decode / verify rows: (requests, layers per timed call) at the long and the batch
# context. A lone graph replay charges each call ~8 us of graph launch (H100, twenty-third session:
# turboquant_4bit_nc 1 x 128K replay 79.3 us, kernels 67.6 + 3.7 us, gap 0.3); in a step's graph
# the attention calls of all layers share one launch.
DECODE_LAYERS = ((1, 8), (32, 4))


def store_slots(t: int, bs: int, order: str, dev, generator=None) -> torch.Tensor:
    """Slot mapping of a t-token store into pages of bs slots, page 0 left unused. "pages": the pages in
    random order, each filled in slot order - what a prefill chunk writes (a request's tokens fill its
    pages in order; the pages come from the free list in any order). "tokens": every token at a random
    slot - the worst case, which no step produces at this size (a decode step's one token per request
    does, at a few hundred tokens); every fp16 scalar is then a 2-byte write into a sector of its own."""
    if order == "pages":
        first = (torch.randperm(t // bs, device=dev, generator=generator) + 1) * bs
        return (first[:, None] + torch.arange(bs, device=dev)).flatten()
    if order == "tokens":
        return torch.randperm(t, device=dev, generator=generator) + bs
    raise ValueError(f"slot order must be 'pages' or 'tokens', got {order!r}")


def store_case(preset, t, hkv, d, dev, order: str = "pages", layers: int = 1) -> tuple[float, float]:
    """(ms per store call, GB/s) of a t-token store. With `layers` > 1 the timed call is that many
    stores back to back, each with K / V and pages of its own (the stores of a prefill forward, one
    per layer), and the time is per store: what one store kernel takes in a stream of work, without the
    ~4.5 us a lone graph replay spends launching (sixteenth session: ncu 51.1 us of 55.5 us timed)."""
    from tqserve.kvquant.presets import make_layer_format
    from tqserve.kvquant.store_triton import StorePlan, store_kv

    fmt = make_layer_format(preset, 5, hkv, d, torch.bfloat16)
    bs = 16
    plan = StorePlan(fmt, dev)
    calls = []
    for _ in range(layers):
        pages = fmt.allocate(t // bs + 2, bs, dev)
        k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        calls.append((pages, k, v, store_slots(t, bs, order, dev)))

    def run() -> None:
        for pages, k, v, slots in calls:
            store_kv(pages, plan, k, v, slots)

    ms = _bench(run) / layers
    nbytes = 2 * calls[0][1].numel() * 2 + t * fmt.page_bytes_per_token() + t * 8
    return ms, nbytes / (ms * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tqserve bench kernels", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller contexts (smoke run)")
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (no host launch overhead)")
    ap.add_argument("--json", default=None, help="write all numbers here")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--sweep", action="store_true", help="also time decode tile variants")
    ap.add_argument("--only", choices=["extend"], default=None, help="run one section only")
    ap.add_argument("--extend-sweep", action="store_true", help="also time extend kernel tile variants")
    ap.add_argument("--extend-presets", default="auto,fp8,turboquant_4bit_nc,turboquant_3bit_nc,tq4,tq3")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    global GRAPHS
    GRAPHS = args.graphs
    presets = args.presets.split(",")
    hq, hkv, d = 32, 8, 128
    ctx = 4096 if args.quick else 32768
    long_ctx = 16384 if args.quick else 131072
    res: dict = {
        "card": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "command": "tqserve bench kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__,
        "timing": "CUDA-graph replays" if GRAPHS else "eager calls",
    }
    import triton

    res["triton"] = triton.__version__
    copies = copy_bandwidths(dev)
    bw = max(copies.values())
    res["copy_GBps"] = bw
    res["copy_GBps_by_timing"] = copies
    rows = []

    def record(name, ms, nbytes, base_ms=None):
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = {"case": name, "ms": ms, "GBps": gbps, "bw_frac": gbps / bw}
        if base_ms:
            row["speedup_vs_sdpa"] = base_ms / ms
        rows.append(row)
        sp = f"{row.get('speedup_vs_sdpa', float('nan')):6.2f}x" if base_ms else "       "
        print(f"{name:44s} {ms:8.3f} ms {gbps:8.0f} GB/s ({gbps / bw:5.1%} of copy) {sp}", flush=True)
        return ms

    timings = ", ".join(f"{k} {v:.0f}" for k, v in copies.items())
    print(f"card {res['card']}  copy {bw:.0f} GB/s ({timings})", flush=True)
    if args.only == "extend":
        flash = sdpa_flash_tflops(dev)
        res["sdpa_flash_causal_TFLOPs"] = flash
        print(f"sdpa flash causal prefill 8192: {flash:.0f} TFLOP/s", flush=True)
        res["sdpa_flash_extend_TFLOPs"] = extend_rows(
            dev, ctx, 2048, args.extend_presets.split(","), hq, hkv, d, flash, rows,
            sweep=("turboquant_4bit_nc", "tq4") if args.extend_sweep else (),
            old=("turboquant_4bit_nc", "tq4", "fp8"),
        )  # fmt: skip
        res["rows"] = rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    # ---- decode 32 x ctx
    sd_ms, sd_bytes = sdpa_decode_ms(32, ctx, 1, hq, hkv, d, dev)
    record(f"sdpa decode 32x{ctx}", sd_ms, sd_bytes)
    decode_ms = {}
    from tqserve.attention.paged import LAST_LAUNCH

    for p in presets:
        c = Case(p, 32, ctx, 1, hq, hkv, d, dev)
        LAST_LAUNCH.clear()  # filled by whichever launcher (general, sliced, narrow) runs this case
        decode_ms[p] = record(f"paged {p} decode 32x{ctx}", _bench(c.run), c.bytes, sd_ms)
        ck = LAST_LAUNCH.get("kernel")
        if ck is not None:
            name = getattr(ck, "name", "?")
            regs, spills = getattr(ck, "n_regs", "?"), getattr(ck, "n_spills", "?")
            rows[-1].update(kernel=name, regs=regs, spills=spills)
            print(f"    {name}: regs {regs} spills {spills} shared {ck.metadata.shared}", flush=True)
        c.free()
        del c
        torch.cuda.empty_cache()
    # ---- decode tile sweep (chooses tuning.py's decode entry; reported, not used above)
    if args.sweep:
        from tqserve.attention import tuning

        tiles = ((64, 4, 2), (32, 4, 2), (64, 4, 3), (64, 4, 1), (64, 8, 2), (128, 8, 2), (32, 4, 3), (128, 4, 2))
        for p in [x for x in ("turboquant_4bit_nc", "tq4", "turboquant_3bit_nc") if x in presets]:
            for n_req, L, split_list in ((32, ctx, (1, 2, 3, 4)), (1, long_ctx, (16, 33, 48, 64, 96, 128))):
                c = Case(p, n_req, L, 1, hq, hkv, d, dev)
                base = sd_ms if n_req > 1 else sdpa_decode_ms(1, long_ctx, 1, hq, hkv, d, dev)[0]
                for bn, nw, ns in tiles if n_req > 1 or p == "turboquant_4bit_nc" else tiles[:1]:
                    tuning.OVERRIDES["decode"] = tuning.AttnConfig(1, bn, nw, ns)
                    try:
                        record(f"sweep {p} {n_req}x{L} bn={bn} w={nw} s={ns}", _bench(c.run), c.bytes, base)
                    except Exception as e:  # out of resources: report and go on
                        print(f"sweep {p} bn={bn} w={nw} s={ns}: {type(e).__name__}", flush=True)
                    tuning.OVERRIDES.clear()
                for sp in split_list:
                    record(f"sweep {p} {n_req}x{L} splits={sp}", _bench(lambda c=c, sp=sp: c.run(sp)), c.bytes, base)
                c.free()
                del c
                torch.cuda.empty_cache()
    # ---- verify 32 x (1+4) x ctx
    for p in presets:
        c = Case(p, 32, ctx, 5, hq, hkv, d, dev)
        ms = record(f"paged {p} verify 32x(1+4)x{ctx}", _bench(c.run), c.bytes, sd_ms)
        rows[-1]["vs_decode"] = ms / decode_ms[p]  # the acceptance ratio (the x column is SDPA decode's)
        print(f"    verify / decode: {ms / decode_ms[p]:.2f}x", flush=True)
        c.free()
        del c
        torch.cuda.empty_cache()
    # ---- decode 1 x long_ctx
    sl_ms, sl_bytes = sdpa_decode_ms(1, long_ctx, 1, hq, hkv, d, dev)
    record(f"sdpa decode 1x{long_ctx}", sl_ms, sl_bytes)
    for p in presets:
        c = Case(p, 1, long_ctx, 1, hq, hkv, d, dev)
        record(f"paged {p} decode 1x{long_ctx}", _bench(c.run), c.bytes, sl_ms)
        c.free()
        del c
        torch.cuda.empty_cache()
    # ---- the same calls back to back, one per layer with K/V and pages of its own; ms per call
    for n_req, layers in DECODE_LAYERS:
        L = long_ctx if n_req == 1 else ctx
        base, nbytes = sdpa_decode_ms(n_req, L, 1, hq, hkv, d, dev, layers)
        record(f"sdpa decode {n_req}x{L}, {layers} layers", base, nbytes)
        for p in presets:
            one_ms = {}
            for qlen in (1, 5) if n_req > 1 else (1,):
                cases = [Case(p, n_req, L, qlen, hq, hkv, d, dev) for _ in range(layers)]
                ms = _bench(lambda cases=cases: [c.run() for c in cases]) / layers
                kind = f"decode {n_req}x{L}" if qlen == 1 else f"verify {n_req}x(1+{qlen - 1})x{L}"
                one_ms[qlen] = record(f"paged {p} {kind}, {layers} layers", ms, cases[0].bytes, base)
                if qlen > 1:
                    rows[-1]["vs_decode"] = ms / one_ms[1]
                    print(f"    verify / decode: {ms / one_ms[1]:.2f}x", flush=True)
                for c in cases:
                    c.free()
                del cases
                torch.cuda.empty_cache()
    # ---- extend: 2048-token chunk over a ctx prefix
    flash = sdpa_flash_tflops(dev)
    res["sdpa_flash_causal_TFLOPs"] = flash
    print(f"sdpa flash causal prefill 8192: {flash:.0f} TFLOP/s", flush=True)
    ext = [x for x in ("auto", "fp8", "turboquant_4bit_nc", "turboquant_3bit_nc", "tq4", "tq3") if x in presets]
    res["sdpa_flash_extend_TFLOPs"] = extend_rows(dev, ctx, 2048, ext, hq, hkv, d, flash, rows)
    # ---- store: one call alone (a prefill chunk's slots; every token at a random slot), then the
    # stores of STORE_LAYERS layers back to back, per store
    for order, layers in (("pages", 1), ("tokens", 1), ("pages", STORE_LAYERS)):
        for p in presets:
            ms, gbps = store_case(p, 16384, hkv, d, dev, order, layers)
            name = f"store {p} 16384 tok, {order} in random order" + (f", {layers} layers" if layers > 1 else "")
            rows.append({"case": name, "ms": ms, "GBps": gbps, "bw_frac": gbps / bw})
            print(f"{name:58s} {ms:8.3f} ms {gbps:8.0f} GB/s ({gbps / bw:5.1%} of copy)", flush=True)
            torch.cuda.empty_cache()
    res["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
