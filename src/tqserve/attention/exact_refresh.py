"""Exact sink / window copies after attention, in two launches per layer: the exact-window snapshots due
this step, then the ring and sink refresh.

The torch definition is `KVCacheStore.refresh_exact` (attention/reference.py); these kernels write the
same bytes into every slot a later step reads. They differ only in the null slots (ring slot 0,
snapshot slot 0, sink slot 0), which the reference fills with the writes it discards and these kernels
skip. On the GPU they replace ~20 small torch launches per window layer (gathers, wheres, index_put)
with two, and they read every snapshot row from device buffers, so a CUDA-graph decode step can carry
snapshot rows (padding rows have snapshot slot 0 and write nothing, `InputBatchBuilder.build`).

Order: the snapshot launch reads ring entries of positions before this step's first token, which the
refresh launch may overwrite (a prefill chunk that crosses a snapshot boundary), so it runs first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tqserve.attention.backend import AttentionMetadata
from tqserve.attention.reference import KVCacheStore, _request_index


@triton.jit(do_not_specialize=["num_tokens"])  # the step's token count: one binary for every step size
def _snapshot_kernel(
    k_ptr, v_ptr, stride_kt, stride_vt, num_tokens,
    rk_ptr, rv_ptr, sk_ptr, sv_ptr,
    pos_ptr, stride_pos, start_ptr, tok0_ptr, seq_ptr, slot_ptr,
    HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, WMAX: tl.constexpr,
):  # fmt: skip
    """One (snapshot row, KV head): the exact K / V of positions [b - W, b) into the snapshot slot, entry
    p % W: from the ring before the request's first token of this step, else from this step's k / v.
    Rows of slot 0 (graph padding) and negative positions write nothing."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + r)
    if slot == 0:
        return
    start = tl.load(start_ptr + r)
    tok0 = tl.load(tok0_ptr + r)
    seq = tl.load(seq_ptr + r)
    j = tl.arange(0, WP)
    d = tl.arange(0, DP)
    pos = tl.load(pos_ptr + r * stride_pos + (WMAX - W) + j, mask=j < W, other=-1)  # this layer's last W
    ok = (j < W) & (pos >= 0)
    entry = tl.where(ok, pos % W, 0)
    from_ring = pos < start
    row = tl.minimum(tl.maximum(tok0 + pos - start, 0), num_tokens - 1)
    dm = d[None, :] < D
    ring_at = ((seq * HKV + h) * W + entry[:, None]).to(tl.int64) * D + d[None, :]
    new_k = row[:, None].to(tl.int64) * stride_kt + h * D + d[None, :]
    new_v = row[:, None].to(tl.int64) * stride_vt + h * D + d[None, :]
    dst = ((slot * HKV + h) * W + entry[:, None]).to(tl.int64) * D + d[None, :]
    m_ring = (ok & from_ring)[:, None] & dm
    m_new = (ok & (pos >= start))[:, None] & dm
    m = ok[:, None] & dm
    kx = tl.where(
        m_ring, tl.load(rk_ptr + ring_at, mask=m_ring), tl.load(k_ptr + new_k, mask=m_new).to(sk_ptr.dtype.element_ty)
    )
    tl.store(sk_ptr + dst, kx, mask=m)
    vx = tl.where(
        m_ring, tl.load(rv_ptr + ring_at, mask=m_ring), tl.load(v_ptr + new_v, mask=m_new).to(sv_ptr.dtype.element_ty)
    )
    tl.store(sv_ptr + dst, vx, mask=m)


@triton.jit
def _refresh_kernel(
    k_ptr, v_ptr, stride_kt, stride_vt,
    pos_ptr, req_ptr, seqlen_ptr, seqslot_ptr, sinkslot_ptr,
    rk_ptr, rv_ptr, sk_ptr, sv_ptr,
    HKV: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """One token, every KV head: its K / V into the ring (entry pos % W) when it is among the last W of
    its request, and into the sink buffer when pos < S."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    req = tl.load(req_ptr + t)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    m = (h[:, None] < HKV) & (d[None, :] < D)
    src = h[:, None] * D + d[None, :]
    kx = tl.load(k_ptr + t.to(tl.int64) * stride_kt + src, mask=m)
    vx = tl.load(v_ptr + t.to(tl.int64) * stride_vt + src, mask=m)
    if W > 0:
        if pos >= tl.load(seqlen_ptr + req) - W:
            seq = tl.load(seqslot_ptr + req).to(tl.int64)
            dst = ((seq * HKV + h[:, None]) * W + pos % W) * D + d[None, :]
            tl.store(rk_ptr + dst, kx.to(rk_ptr.dtype.element_ty), mask=m)
            tl.store(rv_ptr + dst, vx.to(rv_ptr.dtype.element_ty), mask=m)
    if S > 0:
        if pos < S:
            ss = tl.load(sinkslot_ptr + req).to(tl.int64)
            dst = ((ss * HKV + h[:, None]) * S + pos) * D + d[None, :]
            tl.store(sk_ptr + dst, kx.to(sk_ptr.dtype.element_ty), mask=m)
            tl.store(sv_ptr + dst, vx.to(sv_ptr.dtype.element_ty), mask=m)


def refresh_exact(store: KVCacheStore, layer: int, k, v, meta: AttentionMetadata) -> None:
    """`KVCacheStore.refresh_exact` in at most two launches: k, v [num_tokens, Hkv, d] of this step."""
    f = store.formats[layer]
    if not (f.window or f.sink):
        return
    t = meta.num_tokens
    if t == 0:
        return
    hkv, d = k.shape[1], k.shape[2]
    dp = triton.next_power_of_2(d)
    k, v = k[:t], v[:t]
    if k.stride(-1) != 1 or k.stride(-2) != d:
        k = k.contiguous()
    if v.stride(-1) != 1 or v.stride(-2) != d:
        v = v.contiguous()
    snaps = meta.ring_snapshots
    if f.window and snaps is not None and store.snapshots[layer] is not None and snaps.slot.numel():
        rk, rv = store.ring[layer]
        sk, sv = store.snapshots[layer]
        _snapshot_kernel[(snaps.slot.numel(), hkv)](
            k, v, k.stride(0), v.stride(0), t, rk, rv, sk, sv,
            snaps.positions, snaps.positions.stride(0),
            *(x.contiguous() for x in (snaps.start, snaps.token0, snaps.seq_slot, snaps.slot)),
            HKV=hkv, D=d, DP=dp, W=f.window, WP=triton.next_power_of_2(f.window), WMAX=snaps.positions.shape[1],
        )  # fmt: skip
    ring = store.ring[layer] if f.window else (k, v)
    sinks = store.sinks[layer] if f.sink else (k, v)
    _refresh_kernel[(t,)](
        k, v, k.stride(0), v.stride(0),
        meta.positions, _request_index(meta), meta.seq_lens, meta.seq_slots, meta.sink_slots,
        ring[0], ring[1], sinks[0], sinks[1],
        HKV=hkv, HP=triton.next_power_of_2(hkv), D=d, DP=dp, W=f.window, S=f.sink,
    )  # fmt: skip
