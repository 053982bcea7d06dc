"""Exact-window snapshots cached with the prefix (core/window_snapshots.py): the slot pool's LRU bound,
snapshots dropped with their block's page, hits that restore a snapshot and resume at the hit, and
the runner side (snapshots written from the ring and the step's k/v, restored into another ring)."""

from __future__ import annotations

import random

import torch

from tqserve.attention.reference import KVCacheStore
from tqserve.core.kv_cache_manager import CacheLayout, KVCacheManager
from tqserve.core.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from tqserve.core.scheduler import Scheduler, SchedulerConfig
from tqserve.core.window_snapshots import WindowSnapshots
from tqserve.engine.input_batch import InputBatchBuilder
from tqserve.kvquant.presets import make_layer_format
from tqserve.request import Request, RequestStatus
from tqserve.sampling_params import SamplingParams


def make(num_blocks=64, bs=4, max_seqs=4, budget=64, snaps=4, **layout):
    layout = {"sink": 2, "window": 6, **layout}
    kv = KVCacheManager(CacheLayout(num_blocks, bs, max_seqs, num_snapshot_slots=snaps, **layout))
    return Scheduler(SchedulerConfig(max_seqs, budget, 1024), kv)


def req(rid, n, max_tokens=3, base=0):
    return Request(str(rid), [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens), max_tokens)


def step(s, token=1):
    out = s.schedule()
    s.update(out, RunnerOutput(sampled={x.request_id: token for x in out.requests if x.sample}))
    return out


def run(s):
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
    return outs


def test_lru_bound_and_slots_in_use_this_step():
    snaps = WindowSnapshots(2)
    lookup = {10: 1, 11: 2, 12: 3}.get  # block hash -> cached page
    assert snaps.take("a", 10) == 1 and snaps.take("a", 11) == 2
    assert snaps.take("a", 12) is None  # both slots are written this step: nothing to evict
    assert snaps.find(10) is None  # not usable before its step ran and linked it to its page
    snaps.link("a", lookup)
    snaps.begin_step()
    assert snaps.find(10) == 1  # touched: 11 is now the least recently used
    slot = snaps.take("b", 12)
    assert slot == 2 and set(snaps.entries) == {10, 12}
    assert len(snaps.entries) <= snaps.num_slots
    snaps.link("b", lookup)
    assert snaps.find(11) is None and snaps.find(12) == 2
    # A snapshot whose block never got cached is dropped; one of a request that left unlinked, too.
    snaps.begin_step()
    snaps.take("c", 13, replace=None)
    snaps.link("c", lookup)
    assert 13 not in snaps.entries
    snaps.take("d", 14)
    snaps.release("d")
    assert 14 not in snaps.entries
    assert len(snaps.free_slots) + len(snaps.entries) == 2


def test_hit_restores_snapshot_and_resumes_at_the_hit():
    s = make()
    s.add_request(req("a", 30))
    outs = run(s)
    # The prompt's last full-block boundary (28) is written in the prefill step.
    assert [b for b, _ in outs[0].requests[0].ring_snapshots] == [28]
    b = req("b", 30)
    s.add_request(b)
    out = s.schedule()
    (sr,) = out.requests
    assert sr.start_pos == 28 and sr.num_page_tokens_cached == 28 and b.num_cached_tokens == 28
    assert out.ring_restores == [(outs[0].requests[0].ring_snapshots[0][1], sr.seq_slot)]
    assert not out.ring_fills


def test_without_snapshots_the_window_is_recomputed_from_pages():
    s = make(snaps=0)
    s.add_request(req("a", 30))
    run(s)
    b = req("b", 30)
    s.add_request(b)
    out = s.schedule()
    (sr,) = out.requests
    assert sr.start_pos == 28 - 6 and not out.ring_restores
    assert out.ring_fills == [(sr.seq_slot, sr.block_table, 22)]


def test_decode_boundary_snapshot_replaces_the_previous_one():
    s = make()
    a = req("a", 13, max_tokens=10)  # prompt boundary 12; 22 computed: decode reaches 16 and 20
    s.add_request(a)
    outs = run(s)
    written = [b for o in outs for r in o.requests for b, _ in r.ring_snapshots]
    assert written == [12, 16, 20]
    # The prompt snapshot and the latest decode boundary stay; 16 was superseded by 20.
    kv = s.kv
    bs = kv.block_size
    hashes = kv._hash_blocks(a, 24)  # recompute the chain: the request's own hashes are gone
    kept = {b for b in (12, 16, 20) if hashes[b // bs - 1] in kv.snaps.entries}
    assert kept == {12, 20}


def test_snapshot_dropped_when_its_page_is_evicted():
    s = make(num_blocks=12, bs=4)
    s.add_request(req("a", 30, max_tokens=1))
    run(s)
    kv = s.kv
    assert len(kv.snaps.entries) == 1
    (h,) = kv.snaps.entries
    page = kv.pool.lookup(h)
    assert kv.snaps.page_of[h] == page
    s.add_request(req("big", 40, max_tokens=1, base=1000))  # needs every page: evicts a's blocks
    run(s)
    assert kv.pool.lookup(h) is None
    assert h not in kv.snaps.entries and page not in kv.snaps.hash_of_page
    b = req("b", 30)
    s.add_request(b)
    out = s.schedule()
    assert out.requests[0].start_pos == 0 and not out.ring_restores


def test_fallback_resume_writes_no_snapshot_below_its_window():
    """A request that recomputed its window from decoded pages has inexact values near the hit: it
    must not cache them as a snapshot."""
    s = make(snaps=4)
    s.add_request(req("a", 30, max_tokens=1))
    run(s)
    s.kv.snaps.entries.clear()  # forget a's snapshot (as if evicted alone)
    s.kv.snaps.page_of.clear()
    s.kv.snaps.hash_of_page.clear()
    s.kv.snaps.free_slots = list(range(4, 0, -1))
    s.add_request(req("b", 34, max_tokens=1))  # same first 30 tokens: hit of 28, prompt boundary 32
    out = s.schedule()
    assert out.ring_fills and out.requests[0].start_pos == 22
    assert out.requests[0].ring_snapshots == []  # 32 - 6 < 28 + 6: its window is not exact


def test_random_workload_keeps_slots_consistent():
    rng = random.Random(1)
    s = make(num_blocks=30, bs=4, max_seqs=3, budget=20, snaps=3)
    restores = 0
    for i in range(40):
        s.add_request(req(i, rng.randint(5, 30), max_tokens=rng.randint(1, 10), base=rng.choice([0, 300])))
        for _ in range(rng.randint(0, 3)):
            out = step(s)
            # No slot is written twice, or written and restored from, in one step.
            slots = [sl for r in out.requests for _, sl in r.ring_snapshots] + [sl for sl, _ in out.ring_restores]
            assert len(set(slots)) == len(slots)
            restores += len(out.ring_restores)
        if rng.random() < 0.1 and s.running:
            s.finish_request(s.running[0].request_id, RequestStatus.FINISHED_ABORTED)
    run(s)
    assert restores > 0
    sn = s.kv.snaps
    assert len(sn.entries) <= 3 and len(sn.free_slots) + len(sn.entries) == 3
    assert not sn.pending
    for h, page in sn.page_of.items():  # every snapshot belongs to a cached page
        assert s.kv.pool.lookup(h) == page and sn.hash_of_page[page] == h


def test_snapshot_write_and_restore_are_exact():
    """Runner side: a snapshot taken mid-chunk holds the exact K/V of [b - W, b) (older positions
    from the ring, the rest from the step's k/v) and restoring it gives another ring those values."""
    torch.manual_seed(0)
    hkv, d, bs, window = 2, 8, 4, 6
    fmt = make_layer_format(f"tq_k4v3_ub_s2_w{window}", 0, hkv, d, torch.float32)
    store = KVCacheStore([fmt], 16, bs, 4, 4, torch.device("cpu"), num_snapshot_slots=3)
    builder = InputBatchBuilder(32, 4, 8, bs, torch.device("cpu"), window=window)
    k, v = torch.randn(20, hkv, d), torch.randn(20, hkv, d)
    table = [3, 7, 1, 9, 5]

    def run_step(start, end, snaps):
        sr = ScheduledRequest("a", [0] * (end - start), start, table, 2, 1, 0, True, ring_snapshots=snaps)
        meta = builder.build(SchedulerOutput(requests=[sr], num_tokens=end - start)).meta
        store.refresh_exact(0, k[start:end], v[start:end], meta)

    run_step(0, 7, [])
    run_step(7, 11, [(8, 1)])  # positions 2..6 from the ring, 7 from this step
    run_step(11, 17, [(16, 3)])  # chunk reaching past the boundary: 10 from the ring, 11..15 from k
    sk, sv = store.snapshots[0]
    for b, slot in ((8, 1), (16, 3)):
        for p in range(b - window, b):
            assert torch.equal(sk[slot, :, p % window], k[p]) and torch.equal(sv[slot, :, p % window], v[p]), (b, p)
    assert (sk[2] == 0).all()  # untouched slot
    rk, rv = store.ring[0]
    rk[3].fill_(9.0)
    store.restore_ring(torch.tensor([1]), torch.tensor([3]))
    for p in range(8 - window, 8):
        assert torch.equal(rk[3, :, p % window], k[p]) and torch.equal(rv[3, :, p % window], v[p])
    assert torch.equal(rk[2, :, 16 % window], k[16])  # the request's own ring is untouched


def test_reserved_snapshot_named_once_its_token_is_known():
    """Async scheduling: a decode-boundary snapshot is scheduled before the boundary's last token is read
    back. Its slot is reserved (and busy for that step), named by the block hash once the token is known,
    replacing the request's previous decode snapshot; a request that leaves first gives the slot back,
    and a block already held frees the new copy."""
    pool = WindowSnapshots(3)
    old = pool.take("r", 111)
    pool.link("r", lambda h: 7)
    pool.latest["r"] = 111
    pool.begin_step()
    slot = pool.reserve("r", 32)
    assert slot is not None and slot != old and slot in pool.busy and pool.reserve("r", 48) is None
    pool.key("r", lambda b: None)  # the token is not back yet
    assert pool.unkeyed == {"r": (slot, 32)} and 111 in pool.entries
    pool.key("r", lambda b: 222 if b == 32 else None)
    assert pool.entries.get(222) == slot and 111 not in pool.entries and pool.latest["r"] == 222
    pool.link("r", lambda h: 9)
    assert pool.find(222) == slot
    free = len(pool.free_slots)
    pool.begin_step()
    s2 = pool.reserve("q", 16)
    pool.release("q")  # finished before its token came back
    assert not pool.unkeyed and len(pool.free_slots) == free and s2 in pool.free_slots
    s3 = pool.reserve("q", 16)
    pool.key("q", lambda b: 222)  # that block's snapshot is held already
    assert s3 in pool.free_slots and pool.entries[222] == slot
