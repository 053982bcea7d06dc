"""A request resuming after a prefix-cache hit gets its exact-window ring entries before the resume
point from the pages (decoded), not from whatever an earlier request left in its sequence slot."""

from __future__ import annotations

import torch

from tqserve.attention.reference import KVCacheStore
from tqserve.kvquant.presets import make_layer_format


def test_fill_ring_from_pages():
    torch.manual_seed(0)
    hkv, d, bs, window = 2, 16, 4, 6
    fmt = make_layer_format(f"tq_k4v3_ub_s2_w{window}", 0, hkv, d, torch.float32)
    store = KVCacheStore([fmt], 16, bs, 4, 4, torch.device("cpu"))
    table = [5, 2, 9, 7]  # 16 positions on scattered pages
    pos = torch.arange(16)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    fmt.write(store.pages[0], torch.randn(16, hkv, d), torch.randn(16, hkv, d), slots)
    rk, rv = store.ring[0]
    rk.fill_(7.0)  # stale entries of an earlier request in this slot
    rv.fill_(7.0)
    start = 11
    store.fill_ring_from_pages(2, pos[:start], slots[:start])  # more positions than the window
    k, v = fmt.read(store.pages[0], slots)
    for p in range(start - window, start):
        assert torch.equal(rk[2, :, p % window], k[p]), p
        assert torch.equal(rv[2, :, p % window], v[p]), p
    assert (rk[1] == 7.0).all() and (rk[3] == 7.0).all()  # other slots untouched
