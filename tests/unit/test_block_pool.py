import gc

import pytest

from tqserve.core.block_pool import BlockPool


def test_allocate_never_returns_null_page_and_refcounts():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    assert 0 not in blocks and sorted(blocks) == [1, 2, 3, 4, 5]
    assert pool.num_free == 0
    pool.release(blocks)
    assert pool.num_free == 5


def test_cached_pages_survive_free_and_evict_in_lru_order():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, 11), (b, 22), (c, 33)):
        pool.register(blk, h)
    pool.release([c, b, a])  # reverse order, like a finished request: c evicted first
    assert pool.lookup(11) == a and pool.lookup(33) == c
    (x,) = pool.allocate(1)
    assert x == c and pool.lookup(33) is None and pool.lookup(11) == a
    pool.touch(a)  # a hit takes it off the free list
    assert pool.ref_cnt[a] == 1 and not pool.is_free(a) and a not in pool.iter_free()
    (y,) = pool.allocate(1)
    assert y == b


def test_duplicate_content_keeps_first_page():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.register(a, 7)
    pool.register(b, 7)
    assert pool.lookup(7) == a
    pool.release([a, b])
    assert pool.num_free == 3


def _check_free_queue(pool):
    """The linked free queue agrees with the ref counts and the free count, both directions."""
    fwd = list(pool.iter_free())
    assert len(fwd) == len(set(fwd)) == pool.num_free
    assert set(fwd) == {b for b in range(1, pool.num_blocks) if pool.ref_cnt[b] == 0}
    assert all(pool.is_free(b) == (b in set(fwd)) for b in range(pool.num_blocks))
    back, b = [], pool._prev[0]
    while b != 0:
        back.append(b)
        b = pool._prev[b]
    assert back == fwd[::-1]
    return fwd


def test_free_queue_lru_order():
    pool = BlockPool(8)
    assert _check_free_queue(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate(3) == [1, 2, 3]  # oldest first
    assert _check_free_queue(pool) == [4, 5, 6, 7]
    pool.release([3, 1])  # appended to the tail in the order given
    assert _check_free_queue(pool) == [4, 5, 6, 7, 3, 1]
    pool.touch(6)  # from the middle
    assert _check_free_queue(pool) == [4, 5, 7, 3, 1]
    pool.touch(4)  # the head
    pool.touch(1)  # the tail
    assert _check_free_queue(pool) == [5, 7, 3]
    pool.touch(1)  # a second reference: still out of the queue
    pool.release([1])
    assert _check_free_queue(pool) == [5, 7, 3] and pool.ref_cnt[1] == 1
    pool.release([4, 1, 6])
    assert _check_free_queue(pool) == [5, 7, 3, 4, 1, 6]
    assert pool.allocate(6) == [5, 7, 3, 4, 1, 6] and pool.num_free == 0
    assert _check_free_queue(pool) == [] and pool.usage == 1.0
    pool.release([2])
    assert _check_free_queue(pool) == [2] and pool.num_free == 1
    with pytest.raises(RuntimeError, match="out of pages"):
        pool.allocate(2)


def test_bulk_release_equals_page_by_page():
    """Releases of BULK_RELEASE_MIN pages or more link the queue with vector operations; random
    workloads (shared pages, cached pages, repeated pages) leave both pools in the same state."""
    import random

    from tqserve.core import block_pool

    rng = random.Random(3)
    logs: tuple[list[int], list[int]] = ([], [])
    bulk, each = BlockPool(3000, on_evict=logs[0].append), BlockPool(3000, on_evict=logs[1].append)
    held: list[list[int]] = []
    for step in range(300):
        if held and rng.random() < 0.45:
            pages = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.1:  # a page twice in one call (two references): the page-by-page path
                for p in pages[:3]:
                    bulk.touch(p)
                    each.touch(p)
                pages = pages + pages[:3]
            bulk.release(pages)
            each._release_each(pages)
            continue
        n = rng.choice([1, 5, block_pool.BULK_RELEASE_MIN - 1, block_pool.BULK_RELEASE_MIN, 300])
        if n > bulk.num_free:
            continue
        pages = bulk.allocate(n)
        assert each.allocate(n) == pages
        for p in pages:
            if rng.random() < 0.5:
                bulk.register(p, hash((step, p)))
                each.register(p, hash((step, p)))
        if held and rng.random() < 0.3:  # a prefix hit: another holder shares these pages
            for p in held[-1][: rng.randrange(len(held[-1]) + 1)]:
                if bulk.lookup(bulk.block_hash.get(p, -1)) == p:
                    bulk.touch(p)
                    each.touch(p)
                    pages.append(p)
        held.append(pages[::-1])
    assert bulk.ref_cnt == each.ref_cnt and bulk._next == each._next and bulk._prev == each._prev
    assert bulk.num_free == each.num_free and logs[0] == logs[1] and bulk.cached == each.cached
    assert _check_free_queue(bulk) == _check_free_queue(each)
    # a double free in a bulk release raises before it changes anything
    pool = BlockPool(200)
    pages = pool.allocate(block_pool.BULK_RELEASE_MIN)
    pool.release(pages[1:])
    before = (pool.ref_cnt.tolist(), pool._next.tolist(), pool._prev.tolist(), pool.num_free)
    with pytest.raises(AssertionError, match=f"page {pages[1]} freed twice"):
        pool.release(pages)
    assert (pool.ref_cnt.tolist(), pool._next.tolist(), pool._prev.tolist(), pool.num_free) == before
    with pytest.raises(AssertionError, match="page 0 freed twice"):  # the null page is never allocated
        pool.release(pool.allocate(block_pool.BULK_RELEASE_MIN) + [0])


def test_double_free_is_asserted():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release([a])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release([0])  # the null page is never allocated


def test_on_evict_and_reuse_of_cached_pages():
    evicted = []
    pool = BlockPool(5, on_evict=evicted.append)
    a, b, c = pool.allocate(3)
    pool.register(a, 1)
    pool.register(b, 2)
    pool.release([c])  # never cached: dead at once
    assert evicted == [c]
    pool.release([b, a])
    assert evicted == [c] and pool.lookup(1) == a and pool.lookup(2) == b
    pool.uncache(b)  # still free, no longer findable
    assert evicted == [c, b] and pool.lookup(2) is None and pool.is_free(b)
    assert pool.allocate(2) == [4, c]  # free queue was [4, c, b, a]
    assert evicted == [c, b]  # neither was cached
    assert pool.allocate(2) == [b, a] and evicted == [c, b, a] and pool.lookup(1) is None
    assert pool.block_hash == {} and pool.cached == {}


def test_reserve_sink_scan_may_uncache_the_yielded_page():
    pool = BlockPool(6, on_evict=lambda page: None)
    blocks = pool.allocate(5)
    for i, blk in enumerate(blocks):
        pool.register(blk, 100 + i)
    pool.release(blocks)
    seen = []
    for page in pool.iter_free():
        seen.append(page)
        pool.uncache(page)
    assert seen == blocks and pool.cached == {} and pool.num_free == 5


def test_big_pool_adds_nothing_the_gc_traverses():
    """A GPU pool has millions of pages; per-page bookkeeping in lists / OrderedDicts made every full
    gc.collect() walk them (~100 ms at 4M pages). A full collection visits only GC-tracked objects
    and, through their tp_traverse, their referents: every attribute of the pool must be untracked
    (ints, dicts holding only ints) or have O(1) referents (array.array visits just its type)."""
    n = 2_000_000
    pool = BlockPool(n, on_evict=lambda page: None)
    blocks = pool.allocate(n // 2)
    for i, blk in enumerate(blocks[: n // 4]):
        pool.register(blk, hash((i, "salt")))
    pool.release(blocks[::-1][: n // 4])
    assert pool.num_free == n - 1 - n // 4 and len(pool.cached) == len(pool.block_hash) == n // 4
    del blocks
    # The pool itself: its type and attributes (or its __dict__ with keys and values), O(1).
    assert len(gc.get_referents(pool)) <= 2 + 2 * len(vars(pool)) < 40
    for name, value in vars(pool).items():
        if name == "on_evict":  # the caller's callback: what it holds is not the pool's
            continue
        if gc.is_tracked(value):
            assert len(gc.get_referents(value)) <= 1, name
