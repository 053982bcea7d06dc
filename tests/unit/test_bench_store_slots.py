"""`bench.kernels.store_slots`: the slot mappings the store benchmark writes."""

from __future__ import annotations

import pytest
import torch

from tqserve.bench.kernels import store_slots


@pytest.mark.parametrize("order", ["pages", "tokens"])
def test_store_slots_cover_pages_past_the_first(order):
    t, bs = 256, 16
    slots = store_slots(t, bs, order, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert sorted(slots.tolist()) == list(range(bs, bs + t))  # every slot once, page 0 unused


def test_store_slots_page_order():
    """Pages in random order, each filled in slot order (a prefill chunk's mapping)."""
    t, bs = 256, 16
    slots = store_slots(t, bs, "pages", torch.device("cpu"), torch.Generator().manual_seed(0)).view(-1, bs)
    assert (slots[:, 0] % bs == 0).all() and (slots.diff(dim=1) == 1).all()
    assert not (slots[:, 0].diff() > 0).all()  # not simply consecutive pages


def test_store_slots_bad_order():
    with pytest.raises(ValueError, match="slot order"):
        store_slots(16, 16, "rows", torch.device("cpu"))
