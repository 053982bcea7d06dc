"""Batched torch paged attention for the CPU: one padded gather + masked softmax for all requests of
a decode / verify step, instead of the reference's loop over requests. Wider steps (prefill chunks)
and presets with exact sink/window copies go through the reference, which defines the numbers.
"""

from __future__ import annotations

import torch

from tqserve.attention.reference import ReferenceBackend, _request_index

# Steps whose longest query is at most this go through the batched path.
MAX_BATCHED_QUERY = 16


class TorchPagedBackend(ReferenceBackend):
    def forward(self, layer_idx, q, k, v, meta, scale):
        fmt = self.store.formats[layer_idx]
        if meta.max_query_len > MAX_BATCHED_QUERY or fmt.window or fmt.sink or meta.num_reqs == 1:
            return super().forward(layer_idx, q, k, v, meta, scale)
        pages = self.store.pages[layer_idx]
        fmt.write(pages, k, v, meta.slot_mapping[: meta.num_tokens])
        return _batched_attention(q, fmt, pages, self.store.block_size, meta, scale)


def _batched_attention(q, fmt, pages, bs, meta, scale):
    dev = q.device
    r, t = meta.num_reqs, meta.num_tokens
    lmax, qmax = meta.max_seq_len, meta.max_query_len
    hq, d = q.shape[1], q.shape[2]
    seq_lens = meta.seq_lens[:r].long()
    key_pos = torch.arange(lmax, device=dev)
    valid = key_pos[None, :] < seq_lens[:, None]  # [R, L]
    table = meta.block_tables[:r].long()
    blk = torch.gather(table, 1, (key_pos // bs).expand(r, lmax).clamp(max=table.shape[1] - 1))
    slots = torch.where(valid, blk * bs + key_pos % bs, 0)
    keys, vals = fmt.read(pages, slots.reshape(-1))
    hkv = keys.shape[1]
    keys = keys.view(r, lmax, hkv, d)
    vals = vals.view(r, lmax, hkv, d)
    # Pad queries to [R, Qmax]: token j of request i sits at row i, column j - query_start[i].
    req = _request_index(meta)[:t]
    col = torch.arange(t, device=dev) - meta.query_start_loc[req].long()
    qp = torch.zeros(r, qmax, hq, d, dtype=torch.float32, device=dev)
    qp[req, col] = q[:t].float()
    qlen = (meta.query_start_loc[1 : r + 1] - meta.query_start_loc[:r]).long()
    q_pos = (seq_lens - qlen)[:, None] + torch.arange(qmax, device=dev)[None, :]  # [R, Qmax]
    group = hq // hkv
    qg = qp.view(r, qmax, hkv, group, d)
    s = torch.einsum("rqhgd,rkhd->rhgqk", qg, keys) * scale
    allowed = valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [R, Q, L]
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # padded query rows have no key
    o = torch.einsum("rhgqk,rkhd->rqhgd", p, vals).reshape(r, qmax, hq, d)
    out = torch.empty_like(q)
    out[:t] = o[req, col].to(q.dtype)
    return out
