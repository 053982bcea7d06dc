"""Exact-window snapshots cached with the prefix (presets with a recent window W). No torch.

A request's ring holds the exact K/V of its last W positions. When a request crosses a block
boundary b that a later request is likely to resume at (its prompt's last full block, and the latest
block boundary it reached while decoding), the runner copies the exact K/V of positions [b - W, b)
of every window layer into a snapshot slot, keyed by the hash of the block ending at b. A later
prefix-cache hit whose resume boundary has a snapshot restores the ring from it and resumes exactly
there: nothing is recomputed, and the result is bit-identical to computing the prefix afresh.

Slots are a fixed pool sized at startup (`num_window_snapshots`), reused in LRU order. A snapshot
lives only as long as the cached page of its block: evicting that page drops the snapshot. A
snapshot is usable only once linked to its page, i.e. after the step that wrote it has run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class WindowSnapshots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots, 0, -1))  # slot 0 is the null slot
        self.entries: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, oldest first
        self.page_of: dict[int, int] = {}  # block hash -> cached page it is linked to
        self.hash_of_page: dict[int, int] = {}
        self.busy: set[int] = set()  # slots read or written by the step being scheduled
        self.pending: dict[str, list[int]] = {}  # request -> hashes written this step, not linked yet
        self.latest: dict[str, int] = {}  # request -> hash of its latest decode-boundary snapshot
        # request -> (slot, boundary): a decode-boundary snapshot written by a step scheduled before
        # its last token was read back (async scheduling), named by its block's hash once it is (`key`)
        self.unkeyed: dict[str, tuple[int, int]] = {}

    def begin_step(self) -> None:
        self.busy.clear()

    def find(self, block_hash: int) -> int | None:
        """The slot holding the snapshot at the boundary ending block `block_hash`, or None."""
        if block_hash not in self.page_of:  # absent, or its step has not run yet
            return None
        slot = self.entries[block_hash]
        self.entries.move_to_end(block_hash)
        self.busy.add(slot)
        return slot

    def take(self, request_id: str, block_hash: int, replace: int | None = None) -> int | None:
        """A slot for request `request_id` to write the snapshot of `block_hash` into this step, or
        None (already held, or every slot is in use by this step). `replace`: a snapshot of the same
        request that this one supersedes (freed first)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if replace is not None and replace in self.entries and self.entries[replace] not in self.busy:
            self.drop(replace)
        slot = self._free_slot()
        if slot is None:
            return None
        self.entries[block_hash] = slot
        self.busy.add(slot)
        self.pending.setdefault(request_id, []).append(block_hash)
        return slot

    def reserve(self, request_id: str, boundary: int) -> int | None:
        """A slot for the request's decode-boundary snapshot at `boundary` whose block hash is not known
        yet (the step's last token is still being sampled), or None; `key` names it later."""
        if request_id in self.unkeyed:
            return None
        slot = self._free_slot()
        if slot is not None:
            self.busy.add(slot)
            self.unkeyed[request_id] = (slot, boundary)
        return slot

    def key(self, request_id: str, hash_at: Callable[[int], int | None]) -> None:
        """Name the request's reserved snapshot once its tokens are known (`hash_at(boundary)`: the hash
        of the block ending there, None while a token is missing); it then replaces the request's latest
        decode-boundary snapshot, as `take` does, and is linked like the others (`link`)."""
        entry = self.unkeyed.get(request_id)
        if entry is None:
            return
        slot, boundary = entry
        h = hash_at(boundary)
        if h is None:
            return
        del self.unkeyed[request_id]
        if h in self.entries:  # that block's snapshot is held already: the new copy is not needed
            self.free_slots.append(slot)
            return
        old = self.latest.get(request_id)
        if old is not None and old in self.entries and self.entries[old] not in self.busy:
            self.drop(old)
        self.entries[h] = slot
        self.pending.setdefault(request_id, []).append(h)
        self.latest[request_id] = h

    def _free_slot(self) -> int | None:
        """A free slot, evicting the least recently used snapshot no step being scheduled uses."""
        if self.free_slots:
            return self.free_slots.pop()
        victim = next((h for h, s in self.entries.items() if s not in self.busy), None)
        if victim is None:
            return None
        self.drop(victim)
        return self.free_slots.pop()

    def link(self, request_id: str, lookup: Callable[[int], int | None]) -> None:
        """After the step: tie the request's new snapshots to the cached pages of their blocks
        (`lookup`: block hash -> page or None); a snapshot whose block is not cached is dropped."""
        for h in self.pending.pop(request_id, []):
            if h not in self.entries:
                continue
            page = lookup(h)
            if page is None:
                self.drop(h)
                continue
            self.page_of[h] = page
            self.hash_of_page[page] = h

    def page_evicted(self, page: int) -> None:
        h = self.hash_of_page.pop(page, None)
        if h is not None:
            self.drop(h)

    def release(self, request_id: str) -> None:
        """The request is gone: drop snapshots it wrote that were never linked (aborted mid-step)."""
        for h in self.pending.pop(request_id, []):
            self.drop(h)
        self.latest.pop(request_id, None)
        entry = self.unkeyed.pop(request_id, None)
        if entry is not None:  # later steps reuse the slot after the one writing it (one stream)
            self.free_slots.append(entry[0])

    def drop(self, block_hash: int) -> None:
        slot = self.entries.pop(block_hash, None)
        if slot is None:
            return
        self.free_slots.append(slot)
        page = self.page_of.pop(block_hash, None)
        if page is not None:
            self.hash_of_page.pop(page, None)
