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
    assert pool.ref_cnt[a] == 1 and a not in pool.free
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
