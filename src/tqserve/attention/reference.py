"""Pure-torch paged attention: the executable definition every kernel is tested against.

Works on CPU and GPU. Loops over requests using the host lists the input-batch builder put in the
metadata (no device read-back). For presets with exact copies, key p of a query at position q is
read exact iff `p < sink` or `q - p < window`, otherwise decoded from the page; the current step's
own keys are exact copies straight from k/v (they are what the ring is about to hold).
"""

from __future__ import annotations

import torch

from tqserve.attention.backend import AttentionBackend, AttentionMetadata
from tqserve.kvquant.base import LayerKVFormat


class KVCacheStore:
    """Pages and exact-copy buffers of every attention layer, allocated once at startup."""

    def __init__(
        self,
        formats: list[LayerKVFormat],
        num_blocks: int,
        block_size: int,
        num_seq_slots: int,
        num_sink_slots: int,
        device: torch.device,
        num_snapshot_slots: int = 0,
    ) -> None:
        self.formats = formats
        self.block_size = block_size
        self.pages = [f.allocate(num_blocks, block_size, device) for f in formats]
        self.ring: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.sinks: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        # Exact-window snapshots cached with the prefix: slot 0 is the null slot, entry p % W as in
        # the ring (core/window_snapshots.py).
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for f in formats:
            shape = (f.num_kv_heads, f.head_dim)
            if f.window:
                ring = (num_seq_slots, shape[0], f.window, shape[1])
                self.ring.append(_zeros_pair(ring, f.model_dtype, device))
            else:
                self.ring.append(None)
            if f.window and num_snapshot_slots:
                snap = (num_snapshot_slots + 1, shape[0], f.window, shape[1])
                self.snapshots.append(_zeros_pair(snap, f.model_dtype, device))
            else:
                self.snapshots.append(None)
            if f.sink:
                sink = (num_sink_slots, shape[0], f.sink, shape[1])
                self.sinks.append(_zeros_pair(sink, f.model_dtype, device))
            else:
                self.sinks.append(None)

    def exact_bytes(self) -> int:
        total = 0
        for bufs in (*self.ring, *self.sinks, *self.snapshots):
            if bufs is not None:
                total += sum(t.numel() * t.element_size() for t in bufs)
        return total

    def fill_ring_from_pages(self, seq_slot: int, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """A request resuming after a prefix-cache hit never wrote the ring entries of the positions
        just before its resume point, which its first recomputed queries read as exact copies: fill
        them with the page contents (decoded), the best values that exist for those positions,
        instead of whatever an earlier request left in this slot. `positions` [n] (ascending, ending
        just before the resume point, n >= the largest window) and their page `slots` [n]."""
        for layer, f in enumerate(self.formats):
            if not f.window:
                continue
            pos, sl = positions[-f.window :], slots[-f.window :]
            k, v = f.read(self.pages[layer], sl)  # [n, Hkv, d] float32
            rk, rv = self.ring[layer]
            rk[seq_slot][:, pos % f.window] = k.transpose(0, 1).to(rk.dtype)
            rv[seq_slot][:, pos % f.window] = v.transpose(0, 1).to(rv.dtype)

    def restore_ring(self, snapshot_slots: torch.Tensor, seq_slots: torch.Tensor) -> None:
        """Requests resuming at a boundary with an exact-window snapshot: their rings become the
        snapshots (`snapshot_slots` [n] -> `seq_slots` [n], every window layer)."""
        for layer, snap in enumerate(self.snapshots):
            if snap is None:
                continue
            for ring, saved in zip(self.ring[layer], snap):
                ring[seq_slots] = saved[snapshot_slots]

    def _write_snapshots(self, layer: int, k: torch.Tensor, v: torch.Tensor, snaps) -> None:
        """Exact K/V of positions [b - W, b) into snapshot slots: from the ring for positions before
        the request's first token this step (the ring still holds them: this runs before the ring is
        refreshed), from this step's k / v for the others."""
        f = self.formats[layer]
        pos = snaps.positions[:, -f.window :]  # [n, W] of this layer
        entry = pos % f.window
        from_ring = (pos < snaps.start[:, None])[..., None, None]
        row = (snaps.token0[:, None] + pos - snaps.start[:, None]).clamp(0, k.shape[0] - 1)
        dst = torch.where(pos >= 0, snaps.slot[:, None], 0)  # positions before 0: null slot
        seq = snaps.seq_slot[:, None]
        for ring, saved, new in zip(self.ring[layer], self.snapshots[layer], (k, v)):
            saved[dst, :, entry] = torch.where(from_ring, ring[seq, :, entry], new[row].to(ring.dtype))

    def refresh_exact(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy this step's K/V into the ring (entry pos % W) and, for positions < S, the sinks.
        Runs after attention so the ring still held the previous positions while it was read.
        Exact-window snapshots due this step are written first, while the ring still holds them."""
        f = self.formats[layer]
        if not (f.window or f.sink):
            return
        pos = meta.positions[: meta.num_tokens]
        req_of_token = _request_index(meta)
        if f.window and meta.ring_snapshots is not None and self.snapshots[layer] is not None:
            self._write_snapshots(layer, k, v, meta.ring_snapshots)
        if f.window:
            rk, rv = self.ring[layer]
            # Only the last W tokens of each request are kept; the others would collide on the same
            # entries (a scatter with duplicate indices has no defined winner), so they are sent to
            # the null slot 0.
            last = pos >= meta.seq_lens[req_of_token] - f.window
            slot = torch.where(last, meta.seq_slots[req_of_token], 0).long()
            rk[slot, :, pos % f.window] = k.to(rk.dtype)
            rv[slot, :, pos % f.window] = v.to(rv.dtype)
        if f.sink:
            sk, sv = self.sinks[layer]
            sslot = meta.sink_slots[req_of_token].long()
            # Tokens at positions >= S (and requests without a sink slot) go to null entry 0.
            is_sink = pos < f.sink
            sslot = torch.where(is_sink, sslot, torch.zeros_like(sslot))
            spos = torch.where(is_sink, pos, torch.zeros_like(pos))
            sk[sslot, :, spos] = k.to(sk.dtype)
            sv[sslot, :, spos] = v.to(sv.dtype)


def _zeros_pair(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def _request_index(meta: AttentionMetadata) -> torch.Tensor:
    """Request index of each token (computed on the device once per step, cached in meta.extra)."""
    cached = meta.extra.get("req_of_token")
    if cached is None:
        qsl = meta.query_start_loc
        t = torch.arange(meta.num_tokens, device=qsl.device)
        cached = torch.searchsorted(qsl[1 : meta.num_reqs + 1].contiguous(), t, right=True)
        meta.extra["req_of_token"] = cached
    return cached


class ReferenceBackend(AttentionBackend):
    def __init__(self, store: KVCacheStore) -> None:
        self.store = store

    def forward(self, layer_idx, q, k, v, meta, scale):
        store = self.store
        fmt = store.formats[layer_idx]
        pages = store.pages[layer_idx]
        fmt.write(pages, k, v, meta.slot_mapping[: meta.num_tokens])
        out = torch.empty_like(q)
        bs = store.block_size
        hq, hkv = q.shape[1], k.shape[1]
        group = hq // hkv
        for i in range(meta.num_reqs):
            qs, qe = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            qlen = qe - qs
            start = seq_len - qlen
            table = meta.block_tables[i]
            key_pos = torch.arange(seq_len, device=q.device)
            slots = table[key_pos // bs].long() * bs + key_pos % bs
            kq, vq = fmt.read(pages, slots)  # [L, Hkv, d] float32, decoded pages
            q_pos = torch.arange(start, seq_len, device=q.device)
            if fmt.window or fmt.sink:
                ke, ve, has_exact = self._exact_keys(layer_idx, i, meta, k[qs:qe], v[qs:qe], start, seq_len)
                # exact[qi, p]: key p read exact for query qi
                rel = q_pos[:, None] - key_pos[None, :]
                exact = has_exact[None, :] & ((key_pos[None, :] < fmt.sink) | (rel < fmt.window))
                out[qs:qe] = _attend_mixed(q[qs:qe].float(), kq, vq, ke, ve, exact, q_pos, key_pos, scale, group)
            else:
                out[qs:qe] = _attend(q[qs:qe].float(), kq, vq, q_pos, key_pos, scale, group).to(q.dtype)
        store.refresh_exact(layer_idx, k, v, meta)
        return out

    def _exact_keys(self, layer, i, meta, k_new, v_new, start, seq_len):
        """Exact K/V for every key position of request i where an exact copy exists."""
        f = self.store.formats[layer]
        hkv, d = k_new.shape[1], k_new.shape[2]
        dev = k_new.device
        ke = torch.zeros(seq_len, hkv, d, device=dev)
        ve = torch.zeros(seq_len, hkv, d, device=dev)
        has = torch.zeros(seq_len, dtype=torch.bool, device=dev)
        if f.sink:
            sk, sv = self.store.sinks[layer]
            slot = meta.sink_slots_cpu[i]
            n = min(f.sink, start)
            ke[:n] = sk[slot, :, :n].transpose(0, 1).float()
            ve[:n] = sv[slot, :, :n].transpose(0, 1).float()
            has[:n] = True
        if f.window:
            rk, rv = self.store.ring[layer]
            slot = meta.seq_slots_cpu[i]
            lo = max(0, start - f.window)
            p = torch.arange(lo, start, device=dev)
            ke[lo:start] = rk[slot, :, p % f.window].transpose(0, 1).float()
            ve[lo:start] = rv[slot, :, p % f.window].transpose(0, 1).float()
            has[lo:start] = True
        ke[start:] = k_new.float()
        ve[start:] = v_new.float()
        has[start:] = True
        return ke, ve, has


# Every product below runs on tensors padded to fixed granules: at least MIN_ROWS query rows and
# keys rounded up to KEY_GRANULE (at least MIN_KEYS). With CPU BLAS, a row of a matmul then comes
# out bit-identical whatever the chunk, batch or step it is computed in (fewer rows, or a short
# reduction, take other code paths that round differently). That matters for quantized KV pages:
# a last-bit difference in a layer's output can move the next layer's key across a quantization
# boundary, and greedy output would then depend on chunk sizes or prefix-cache hits.
MIN_ROWS = 16
KEY_GRANULE = 256
MIN_KEYS = 512


def _padded_heads(x: torch.Tensor, rows: int, group: int) -> torch.Tensor:
    """[L, H, d] -> [H * group, rows, d] (GQA heads repeated, rows past L zero)."""
    n, h, d = x.shape
    out = x.new_empty(h, group, rows, d)
    out[:, :, n:] = 0
    out[:, :, :n] = x.transpose(0, 1).unsqueeze(1)  # one copy: the GQA repeat is a broadcast
    return out.view(h * group, rows, d)


def _shape(lq: int, lk: int) -> tuple[int, int]:
    return max(MIN_ROWS, lq), max(MIN_KEYS, -(-lk // KEY_GRANULE) * KEY_GRANULE)


def _scores(
    q: torch.Tensor, keys: torch.Tensor, scale: float, group: int, qp: torch.Tensor | None = None
) -> torch.Tensor:
    # q [Lq, Hq, d], keys [L, Hkv, d] -> [Hq, M, Lpad] (padded rows / keys hold junk or zeros); qp: q padded
    m, lpad = _shape(q.shape[0], keys.shape[0])
    qp = _padded_heads(q, m, 1) if qp is None else qp
    return torch.bmm(qp, _padded_heads(keys, lpad, group).transpose(1, 2)) * scale


def _mask(q_pos: torch.Tensor, key_pos: torch.Tensor, m: int, lpad: int) -> torch.Tensor:
    """True where the score is masked: future keys, padded keys; padded query rows see key 0 only."""
    qp = torch.full((m,), -1, dtype=q_pos.dtype, device=q_pos.device)
    qp[: q_pos.shape[0]] = q_pos
    kp = torch.full((lpad,), torch.iinfo(key_pos.dtype).max, dtype=key_pos.dtype, device=key_pos.device)
    kp[: key_pos.shape[0]] = key_pos
    masked = kp[None, :] > qp[:, None]
    masked[q_pos.shape[0] :, 0] = False
    return masked


def _pv(p: torch.Tensor, vals: torch.Tensor, group: int, lq: int) -> torch.Tensor:
    # p [Hq, M, Lpad], vals [L, Hkv, d] -> [Lq, Hq, d]
    return torch.bmm(p, _padded_heads(vals, p.shape[2], group))[:, :lq].transpose(0, 1)


def _softmax_out(s, vals, q_pos, key_pos, group):
    s = s.masked_fill(_mask(q_pos, key_pos, s.shape[1], s.shape[2])[None], float("-inf"))
    return _pv(torch.softmax(s, dim=-1), vals, group, q_pos.shape[0])


def _attend(q, k, v, q_pos, key_pos, scale, group):
    return _softmax_out(_scores(q, k, scale, group), v, q_pos, key_pos, group)


def _attend_mixed(q, kq, vq, ke, ve, exact, q_pos, key_pos, scale, group):
    """Scores and values chosen per (query, key) between the decoded page and the exact copy."""
    qp = _padded_heads(q, _shape(q.shape[0], ke.shape[0])[0], 1)
    s_exact, s_quant = _scores(q, ke, scale, group, qp), _scores(q, kq, scale, group, qp)
    m, lpad = s_exact.shape[1], s_exact.shape[2]
    ex = torch.zeros((m, lpad), dtype=torch.bool, device=q.device)
    ex[: exact.shape[0], : exact.shape[1]] = exact
    s = torch.where(ex[None], s_exact, s_quant)
    s = s.masked_fill(_mask(q_pos, key_pos, m, lpad)[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    pe = torch.where(ex[None], p, torch.zeros_like(p))
    lq = q_pos.shape[0]
    out = _pv(pe, ve, group, lq) + _pv(p - pe, vq, group, lq)
    return out.to(q.dtype)
