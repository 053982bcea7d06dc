"""Batched torch paged attention for the CPU: one padded gather + masked softmax for all requests of
a decode / verify step of exact pages, instead of the reference's loop over requests. Wider steps
(prefill chunks) and every quantized preset go through the reference, which defines the numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tqserve.attention.reference import ReferenceBackend, _request_index
from tqserve.kvquant.base import ExactFormat, null_redirect

# Steps whose longest query is at most this go through the batched path.
MAX_BATCHED_QUERY = 16


class TorchPagedBackend(ReferenceBackend):
    def forward(self, layer_idx, q, k, v, meta, scale):
        fmt = self.store.formats[layer_idx]
        if not isinstance(fmt, ExactFormat) or meta.max_query_len > MAX_BATCHED_QUERY:
            # Quantized pages always take the reference path: its products are padded to fixed
            # granules, so a token's keys and values come out bit-identical whatever the step shape
            # (a last-bit difference could cross a quantization boundary; see reference.py).
            return super().forward(layer_idx, q, k, v, meta, scale)
        pages = self.store.pages[layer_idx]
        fmt.write(pages, k, v, None, offsets=_page_offsets(meta, self.store.block_size))
        return _batched_attention(q, pages, self.store.block_size, meta, scale)


def _page_offsets(meta, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of every token's slot, computed once per step for all layers."""
    po = meta.extra.get("page_offsets")
    if po is None:
        slots = null_redirect(meta.slot_mapping[: meta.num_tokens])
        po = meta.extra["page_offsets"] = (slots // bs, slots % bs)
    return po


def _step_plan(meta, bs: int) -> dict:
    """Index vectors and the mask shared by every layer of a step (built once, kept in meta.extra)."""
    plan = meta.extra.get("torch_paged")
    if plan is not None:
        return plan
    dev = meta.query_start_loc.device
    r, t = meta.num_reqs, meta.num_tokens
    lmax, qmax = meta.max_seq_len, meta.max_query_len
    seq_lens = meta.seq_lens[:r].long()
    nblk = -(-lmax // bs)
    # Token j of request i sits at row i, column j - query_start[i] of the padded queries.
    req = _request_index(meta)[:t]
    col = torch.arange(t, device=dev) - meta.query_start_loc[req].long()
    qlen = (meta.query_start_loc[1 : r + 1] - meta.query_start_loc[:r]).long()
    q_pos = (seq_lens - qlen)[:, None] + torch.arange(qmax, device=dev)[None, :]  # [R, Qmax]
    key_pos = torch.arange(lmax, device=dev)
    # Causal within the request's own length (pages past it are stale or page 0); padded query rows
    # see key 0 only, so no row is empty, and are discarded.
    allowed = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    allowed |= key_pos[None, None, :] == 0
    # Decode steps whose requests all have the same length need no mask (SDPA's fastest path);
    # the host list comes from the input-batch builder, no device read.
    uniform = qmax == 1 and min(meta.seq_lens_cpu) == lmax
    plan = {
        "req": req,
        "col": col,
        "mask": None if uniform else allowed[:, None],  # [R, 1, Qmax, L]
        "page_ids": meta.block_tables[:r, :nblk].long(),
        "nblk": nblk,
    }
    meta.extra["torch_paged"] = plan
    return plan


def _gather_pages(pages, plan, r: int, lmax: int):
    """K/V of every request's first lmax positions, [R, Hkv, L, d] float32 (SDPA's layout): rows
    (page, head) of the pages viewed as [nb * Hkv, bs * d], ordered (request, head, page), so one
    index_select per tensor lands them in place, no transpose copy."""
    nblk = plan["nblk"]
    nb, hkv, bs, d = pages["k"].shape
    rows = plan.get(("rows", hkv))
    if rows is None:
        heads = torch.arange(hkv, device=plan["page_ids"].device)
        rows = plan[("rows", hkv)] = ((plan["page_ids"] * hkv)[:, None, :] + heads[None, :, None]).reshape(-1)
    k, v = (pages[n].view(nb * hkv, bs * d).index_select(0, rows).view(r, hkv, nblk * bs, d) for n in ("k", "v"))
    return k[:, :, :lmax].float(), v[:, :, :lmax].float()


def _batched_attention(q, pages, bs, meta, scale):
    r, t = meta.num_reqs, meta.num_tokens
    plan = _step_plan(meta, bs)
    keys, vals = _gather_pages(pages, plan, r, meta.max_seq_len)
    if meta.max_query_len == 1 and t == r:
        # Pure decode: token i is request i's only query, so q needs no padding scatter.
        qp = q[:t].float().unsqueeze(1)
    else:
        qp = q.new_zeros((r, meta.max_query_len, q.shape[1], q.shape[2]), dtype=torch.float32)
        qp[plan["req"], plan["col"]] = q[:t].float()
    o = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, vals, attn_mask=plan["mask"], scale=scale, enable_gqa=True
    )  # [R, Hq, Qmax, d]
    if meta.max_query_len == 1 and t == r == q.shape[0]:
        return o.squeeze(2).to(q.dtype)  # no padding rows: the output is SDPA's, as a view
    out = torch.empty_like(q)
    if meta.max_query_len == 1 and t == r:
        out[:t] = o.squeeze(2).to(q.dtype)
    else:
        out[:t] = o.transpose(1, 2)[plan["req"], plan["col"]].to(q.dtype)
    return out
