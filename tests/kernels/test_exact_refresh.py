"""The exact-copy refresh kernels (attention/exact_refresh.py) against `KVCacheStore.refresh_exact`.

Every ring, sink and snapshot buffer starts random, so entries a step must leave alone are checked too;
the null slots (0) are left out: the reference fills them with the writes it discards, the kernels skip
those writes."""

from __future__ import annotations

import copy

import pytest
import torch
from paged_cases import make_meta
from triton_env import DEV, triton_kernels

from tqserve.attention.backend import RingSnapshots
from tqserve.attention.exact_refresh import refresh_exact
from tqserve.attention.reference import KVCacheStore
from tqserve.kvquant.presets import make_layer_format

pytestmark = triton_kernels


def _store(preset: str, hkv: int, d: int, n_slots: int, gen: torch.Generator) -> KVCacheStore:
    fmt = make_layer_format(preset, 3, hkv, d, torch.bfloat16)
    store = KVCacheStore([fmt], 64, 16, n_slots, n_slots, DEV, num_snapshot_slots=5)
    for bufs in (store.ring[0], store.sinks[0], store.snapshots[0]):
        for t in bufs or ():
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return store


def _snapshots(rows: list[tuple[int, int, int, int, int]], window: int, pad: int) -> RingSnapshots:
    """Rows (boundary, start, first token row, sequence slot, snapshot slot), then `pad` padding rows
    (snapshot slot 0, positions of their own) as a graph step carries."""
    rows = rows + [(7 * i + 3, 0, 0, 0, 0) for i in range(pad)]
    info = torch.tensor(rows, dtype=torch.int64)
    pos = info[:, :1] - window + torch.arange(window)[None, :]
    info = info[:, 1:].T.contiguous().to(DEV)  # [4, n], as the input-batch builder lays it out
    return RingSnapshots(pos.to(DEV), info[0], info[1], info[2], info[3])


@pytest.mark.parametrize(
    ("preset", "hkv", "d"),
    [("tq3", 2, 64), ("tq3", 3, 128), ("tq_k5v3_ncs_s4_w44+v4@7.17.23", 1, 64), ("tq_k4v2_ub_w32", 2, 64),
     ("tq_k4v2_ub_s4", 2, 64)],
)  # fmt: skip
def test_refresh_matches_reference(preset, hkv, d):
    """A decode row, a prefill from scratch longer than the window across four block boundaries, a
    decode row deep in its sequence and a chunk that starts inside the sink and crosses a boundary;
    snapshot rows reading the ring, this step's k / v or both (and positions before 0), padding rows."""
    gen = torch.Generator().manual_seed(3)
    ctx, qlens = [40, 0, 100, 2], [1, 70, 1, 30]
    meta = make_meta(ctx, qlens, 16, 64, DEV, seed=4)
    store = _store(preset, hkv, d, len(ctx) + 1, gen)
    fmt = store.formats[0]
    t = meta.num_tokens
    k, v = (torch.randn(t, hkv, d, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    qsl = meta.query_start_loc_cpu
    if fmt.window:
        rows = [(32, 0, qsl[1], 2, 1), (101, 100, qsl[2], 3, 2), (32, 2, qsl[3], 4, 3), (41, 40, qsl[0], 1, 4)]
        rows.append((64, 0, qsl[1], 2, 5))
        meta.ring_snapshots = _snapshots(rows, fmt.window, pad=3)
    ref = copy.deepcopy(store)
    ref.refresh_exact(0, k, v, meta)
    refresh_exact(store, 0, k, v, meta)
    for name in ("ring", "sinks", "snapshots"):
        mine, want = getattr(store, name)[0], getattr(ref, name)[0]
        if want is None:
            assert mine is None
            continue
        for a, b in zip(mine, want):
            assert torch.equal(a[1:], b[1:]), name
    if fmt.window:  # the rows wrote something: the check above is not vacuous
        assert not torch.equal(store.snapshots[0][0][1:], _store(preset, hkv, d, len(ctx) + 1,
                               torch.Generator().manual_seed(3)).snapshots[0][0][1:])  # fmt: skip


def test_graph_padding_rows_write_nothing():
    """Padding rows only (a graph step without a snapshot due) leave every snapshot slot as it was."""
    gen = torch.Generator().manual_seed(5)
    meta = make_meta([20, 33], [1, 1], 16, 64, DEV, seed=6)
    store = _store("tq3", 2, 64, 3, gen)
    meta.ring_snapshots = _snapshots([], store.formats[0].window, pad=4)
    before = [t.clone() for t in store.snapshots[0]]
    k, v = (torch.randn(2, 2, 64, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    refresh_exact(store, 0, k, v, meta)
    assert all(torch.equal(a, b) for a, b in zip(store.snapshots[0], before))
