"""Page free list with ref counts and an LRU of cached pages. No torch (invariant 6).

Page 0 is the null page: never allocated, target of skipped writes and padding.
Free pages form one LRU queue; a free page that still holds a cached block stays findable by its
hash until it is taken from the queue for reuse (evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        """`on_evict(page)` is called when a page's content can no longer be found: it was taken
        for reuse or uncached, or it was freed without ever being cached."""
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (page 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> page id
        # Free pages in eviction order (oldest first). Values unused.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of pages: asked {n}, free {len(self.free)}")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            if self.on_evict is not None:
                self.on_evict(block)

    def uncache(self, block: int) -> None:
        """Make a page unfindable by hash (its side data is gone) without freeing it."""
        self._evict(block)

    def touch(self, block: int) -> None:
        """Take a reference on a cached page found by hash."""
        if self.ref_cnt[block] == 0:
            del self.free[block]
        self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per page; free pages join the LRU tail. Callers pass a request's pages
        in reverse so its last pages are evicted before its prefix."""
        for block in blocks:
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"page {block} freed twice"
            if self.ref_cnt[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None and self.on_evict is not None:
                    self.on_evict(block)  # nobody can hit an uncached page: its side data is dead

    def register(self, block: int, block_hash: int) -> None:
        """Record a full page under its chained hash. A page with the same content already cached
        keeps the entry; this one stays uncached and is freed normally."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)
