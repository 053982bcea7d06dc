"""Page free list with ref counts and an LRU of cached pages. No torch (invariant 6).

Page 0 is the null page: never allocated, target of skipped writes and padding.
Free pages form one LRU queue; a free page that still holds a cached block stays findable by its
hash until it is taken from the queue for reuse (evicted).

Storage: nothing proportional to the number of pages is a container the cyclic garbage collector
traverses. A GPU pool of compressed pages has millions of pages; as Python lists / an OrderedDict
they cost ~100 ms per full gc.collect() at 4M pages, a stall in the middle of a decode step. So:
- ref counts live in an `array.array('i')` (arrays are not GC-tracked);
- the free queue is a doubly linked list over two `array.array('i')` (prev / next), with page 0
  as the sentinel (head = next[0] is the oldest free page, tail = prev[0] the newest). A page is
  in the queue exactly when its ref count is 0 (page 0 aside), so no membership flag is needed;
- hashes are kept in plain dicts holding only ints (page -> hash, hash -> page), which CPython
  leaves untracked, and only for cached pages.
numpy views share the arrays' memory (untracked too) so that releasing a long request's pages is a
few vector operations: a Python loop costs ~0.3 us a page, 20 ms of engine stall for a 1M-token
request.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

import numpy as np

# Releases of at least this many pages link them into the free queue with vector operations.
BULK_RELEASE_MIN = 64


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        """`on_evict(page)` is called when a page's content can no longer be found: it was taken
        for reuse or uncached, or it was freed without ever being cached."""
        if num_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (page 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # Not GC-tracked (see module docstring): arrays, and dicts holding only ints.
        self.ref_cnt = array("i", bytes(4 * num_blocks))
        self.block_hash: dict[int, int] = {}  # page id -> block hash, cached pages only
        self.cached: dict[int, int] = {}  # block hash -> page id
        # Free queue, oldest first: 0 -> 1 -> 2 -> ... -> num_blocks - 1 -> 0.
        self._next = array("i", range(1, num_blocks + 1))
        self._next[num_blocks - 1] = 0
        self._prev = array("i", range(-1, num_blocks - 1))
        self._prev[0] = num_blocks - 1
        self._num_free = num_blocks - 1
        self.on_evict = on_evict
        # Views of the three arrays for bulk releases (never resized, so the buffers stay put).
        self._ref_np = np.frombuffer(self.ref_cnt, dtype=np.intc)
        self._next_np = np.frombuffer(self._next, dtype=np.intc)
        self._prev_np = np.frombuffer(self._prev, dtype=np.intc)

    # ---- free queue ------------------------------------------------------------------------
    def _unlink(self, block: int) -> None:
        nxt, prv = self._next, self._prev
        p, n = prv[block], nxt[block]
        nxt[p] = n
        prv[n] = p
        self._num_free -= 1

    def _append(self, block: int) -> None:
        nxt, prv = self._next, self._prev
        tail = prv[0]
        nxt[tail] = block
        prv[block] = tail
        nxt[block] = 0
        prv[0] = block
        self._num_free += 1

    def is_free(self, block: int) -> bool:
        """True when the page is in the free queue (unreferenced; maybe still cached)."""
        return block != 0 and self.ref_cnt[block] == 0

    def iter_free(self) -> Iterator[int]:
        """Free pages in eviction order, oldest first. The queue must not change while iterating,
        except that the page just yielded may be taken out (or uncached)."""
        nxt = self._next
        block = nxt[0]
        while block != 0:
            following = nxt[block]
            yield block
            block = following

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return 1.0 - self._num_free / (self.num_blocks - 1)

    # ---- pages -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self._num_free:
            raise RuntimeError(f"out of pages: asked {n}, free {self._num_free}")
        out = []
        nxt, prv, ref_cnt, block_hash = self._next, self._prev, self.ref_cnt, self.block_hash
        for _ in range(n):
            block = nxt[0]  # pop the head (oldest)
            head = nxt[block]
            nxt[0] = head
            prv[head] = 0
            if block in block_hash:
                self._evict(block)
            ref_cnt[block] = 1
            out.append(block)
        self._num_free -= len(out)
        return out

    def _evict(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            if self.on_evict is not None:
                self.on_evict(block)

    def uncache(self, block: int) -> None:
        """Make a page unfindable by hash (its side data is gone) without freeing it."""
        self._evict(block)

    def touch(self, block: int) -> None:
        """Take a reference on a cached page found by hash."""
        if self.ref_cnt[block] == 0:
            self._unlink(block)
        self.ref_cnt[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per page; free pages join the LRU tail. Callers pass a request's pages
        in reverse so its last pages are evicted before its prefix."""
        if len(blocks) >= BULK_RELEASE_MIN and len(set(blocks)) == len(blocks):
            self._release_bulk(blocks)
        else:
            self._release_each(blocks)

    def _release_each(self, blocks: list[int]) -> None:
        ref_cnt, block_hash, on_evict = self.ref_cnt, self.block_hash, self.on_evict
        for block in blocks:
            cnt = ref_cnt[block] - 1
            assert cnt >= 0, f"page {block} freed twice"
            ref_cnt[block] = cnt
            if cnt == 0:
                self._append(block)
                if on_evict is not None and block not in block_hash:
                    on_evict(block)  # nobody can hit an uncached page: its side data is dead

    def _release_bulk(self, blocks: list[int]) -> None:
        """`release` for distinct pages, as vector operations: the pages whose count drops to 0 are
        chained in the order given and the chain joins the queue's tail, as one `_append` each would."""
        idx = np.asarray(blocks, dtype=np.int64)
        ref = self._ref_np
        cnt = ref[idx] - 1
        bad = cnt < 0  # (page 0 included: never allocated, its count stays 0)
        if bad.any():
            raise AssertionError(f"page {int(idx[bad.argmax()])} freed twice")
        ref[idx] = cnt
        freed = idx[cnt == 0]
        if not len(freed):
            return
        nxt, prv = self._next_np, self._prev_np
        tail = int(prv[0])
        nxt[tail] = freed[0]
        prv[freed[0]] = tail
        nxt[freed[:-1]] = freed[1:]
        prv[freed[1:]] = freed[:-1]
        nxt[freed[-1]] = 0
        prv[0] = freed[-1]
        self._num_free += len(freed)
        if self.on_evict is not None:
            block_hash = self.block_hash
            for block in freed.tolist():
                if block not in block_hash:
                    self.on_evict(block)  # nobody can hit an uncached page: its side data is dead

    def register(self, block: int, block_hash: int) -> None:
        """Record a full page under its chained hash. A page with the same content already cached
        keeps the entry; this one stays uncached and is freed normally."""
        if block_hash in self.cached or block in self.block_hash:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)
