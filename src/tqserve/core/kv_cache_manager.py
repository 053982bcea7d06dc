"""Pages, sequence slots, sink slots and state checkpoints of every request. No torch.

- Pages: a request's block table grows as it computes; full blocks are registered under a chained
  hash of their tokens (seeded with the model/KV configuration) so later requests can share them.
- Sequence slots (1..max_num_seqs; 0 is null): index the per-request exact-window ring of TurboQuant
  presets and the recurrent state of GDN layers.
- Sink slots: exact copies of the first S tokens, tied to the physical first page, so requests
  sharing page 0 share the sinks and a hit on page 0 always finds them.
- State checkpoints (hybrid models): the recurrent state after exactly k*block_size tokens, keyed by
  the hash of the block ending there, with their own LRU.
- Exact-window snapshots (presets with a window W): the exact K/V of the W positions before a block
  boundary, keyed the same way, so a hit resumes there without recomputing (window_snapshots.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from tqserve.core.block_pool import BlockPool
from tqserve.core.window_snapshots import WindowSnapshots
from tqserve.request import Request


@dataclass(frozen=True)
class CacheLayout:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    enable_prefix_caching: bool = True
    sink: int = 0  # exact sink tokens of the KV preset (0: none)
    window: int = 0  # exact recent window of the KV preset (0: none)
    has_state: bool = False  # hybrid model: GDN states live in slots
    num_checkpoint_slots: int = 0
    checkpoint_interval: int = 0  # tokens between prefill checkpoints (multiple of block_size)
    cache_salt: int = 0  # hash of model + KV configuration
    num_snapshot_slots: int = 0  # exact-window snapshots cached with the prefix (0: none)


class PrefixHit(NamedTuple):
    pages: list[int]  # cached pages to share
    num_hit_tokens: int  # tokens they cover
    resume_at: int  # where computation resumes (earlier when a window or a state must be rebuilt)
    checkpoint_slot: int | None = None  # state checkpoint to restore (hybrid models)
    snapshot_slot: int | None = None  # exact-window snapshot to restore the ring from


class KVCacheManager:
    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(layout.num_blocks, on_evict=self._on_page_evicted)
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # blocks of a request already offered to the cache
        self.seq_slot: dict[str, int] = {}
        self.free_seq_slots = list(range(layout.max_num_seqs, 0, -1))
        # Sinks: one slot per distinct live first page; cached-free first pages keep theirs in an LRU.
        self.sink_of_page: dict[int, int] = {}
        self.free_sink_slots = list(range(2 * layout.max_num_seqs + 1, 0, -1)) if layout.sink else []
        # Checkpoints: block hash -> slot, LRU order; slots are numbered after the sequence slots.
        first = layout.max_num_seqs + 1
        self.free_ckpt_slots = list(range(first + layout.num_checkpoint_slots - 1, first - 1, -1))
        self.ckpt: OrderedDict[int, int] = OrderedDict()
        use_snaps = layout.window and layout.enable_prefix_caching and layout.num_snapshot_slots
        self.snaps = WindowSnapshots(layout.num_snapshot_slots) if use_snaps else None
        # Requests that resumed after a hit by recomputing the window from decoded pages (no snapshot):
        # their exact values near the hit differ from a first computation's, so they write no
        # snapshot whose window reaches below the hit (request id -> smallest boundary allowed).
        self.snapshot_floor: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.snapshot_hits = 0  # hits that resumed from an exact-window snapshot

    # ---- hashing -------------------------------------------------------------------------
    def _hash_blocks(self, request: Request, upto: int) -> list[int]:
        """Chained hashes of the request's full blocks covering tokens [0, upto)."""
        hashes = self.block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        if (len(hashes) + 1) * bs > upto:
            return hashes
        # never a block with a token not read back yet (async scheduling): its hash would be wrong
        upto = min(upto, request.num_tokens)
        while (len(hashes) + 1) * bs <= upto:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.layout.cache_salt
            hashes.append(hash((parent, tuple(request.token_slice(i * bs, (i + 1) * bs)))))
        return hashes

    # ---- admission -----------------------------------------------------------------------
    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Find cached pages for the request's prefix, where computation resumes, and what must be
        restored there (a state checkpoint, an exact-window snapshot)."""
        lay = self.layout
        sp = request.sampling_params
        if not lay.enable_prefix_caching or sp.prompt_logprobs is not None or sp.prompt_logprobs_full:
            # Prompt logprobs need every prompt position computed.
            return PrefixHit([], 0, 0)
        # At least the last prompt token is always computed: its logits start generation.
        hashes = self._hash_blocks(request, request.num_tokens - 1)
        pages: list[int] = []
        for h in hashes:
            page = self.pool.lookup(h)
            if page is None:
                break
            pages.append(page)
        hit = len(pages) * self.block_size
        resume, ckpt = hit, None
        if lay.has_state:
            resume, ckpt = 0, None
            for i in range(len(pages), 0, -1):
                slot = self.ckpt.get(hashes[i - 1])
                if slot is not None:
                    resume, ckpt = i * self.block_size, slot
                    self.ckpt.move_to_end(hashes[i - 1])
                    break
        snap = None
        if lay.window:
            if self.snaps is not None:
                # An exact-window snapshot at a boundary no more than W before the hit (at the
                # checkpoint's boundary for hybrid models): resume exactly there.
                bs = self.block_size
                cands = [resume] if lay.has_state else range(hit, hit - lay.window - 1, -bs)
                for b in cands:
                    if b <= lay.sink or b <= 0:
                        break
                    snap = self.snaps.find(hashes[b // bs - 1])
                    if snap is not None:
                        resume = b
                        break
            if snap is None:
                resume = min(resume, hit - lay.window)
        if resume <= lay.sink or resume <= 0:
            # Recomputing would reach the shared sinks (or there is nothing to resume from).
            return PrefixHit([], 0, 0)
        if lay.has_state and ckpt is None:
            return PrefixHit([], 0, 0)
        return PrefixHit(pages, hit, resume, ckpt, snap)

    def admit(self, request: Request, pages: list[int], num_skipped: int) -> bool:
        """Give a waiting request its sequence slot and shared pages. False if no slot is free."""
        if not self.free_seq_slots:
            return False
        self.seq_slot[request.request_id] = self.free_seq_slots.pop()
        for p in pages:
            self.pool.touch(p)
        self.block_tables[request.request_id] = list(pages)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_skipped
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for tokens up to num_computed + num_new. False when pages run out."""
        table = self.block_tables[request.request_id]
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        fresh_first = not table
        if fresh_first and self.layout.sink and not self._reserve_sink():
            return False
        table.extend(self.pool.allocate(need))
        if fresh_first and self.layout.sink:
            self.sink_of_page[table[0]] = self.free_sink_slots.pop()
        return True

    def _reserve_sink(self) -> bool:
        if self.free_sink_slots:
            return True
        # Evict the sinks of the oldest free first page; that page can no longer be hit.
        for page in self.pool.iter_free():
            if page in self.sink_of_page:
                self.pool.uncache(page)
                return bool(self.free_sink_slots)
        return False

    def _on_page_evicted(self, page: int) -> None:
        slot = self.sink_of_page.pop(page, None)
        if slot is not None:
            self.free_sink_slots.append(slot)
        if self.snaps is not None:
            self.snaps.page_evicted(page)

    # ---- after a step ---------------------------------------------------------------------
    def cache_full_blocks(self, request: Request) -> None:
        if not self.layout.enable_prefix_caching:
            return
        rid = request.request_id
        # Only known tokens hash: with async scheduling the computed count may include a token whose
        # id is still being read back.
        done = min(request.num_computed_tokens, request.num_tokens)
        if self.snaps is None and done < (self.num_registered.get(rid, 0) + 1) * self.block_size:
            return  # no new full block: most decode steps of every request
        table = self.block_tables[rid]
        hashes = self._hash_blocks(request, done)
        # Lookups may have hashed further than the computed pages reach.
        full = min(len(hashes), len(table), done // self.block_size)
        for i in range(self.num_registered.get(rid, 0), full):
            self.pool.register(table[i], hashes[i])
        self.num_registered[rid] = full
        if self.snaps is not None:
            bs = self.block_size
            self.snaps.key(rid, lambda b: self._hash_blocks(request, b)[b // bs - 1] if b <= done else None)
            self.snaps.link(rid, self.pool.lookup)

    def begin_step(self) -> None:
        if self.snaps is not None:
            self.snaps.begin_step()

    def snapshot_captures(self, request: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Exact-window snapshots the request writes in a step computing positions [start, end):
        (boundary, snapshot slot) for its prompt's last full-block boundary (where a repeat of the
        prompt resumes) and for a step ending on a block boundary past the prompt (its latest one
        while decoding replaces the previous: where a follow-up turn or a preempted request resumes)."""
        if self.snaps is None:
            return []
        bs, rid = self.block_size, request.request_id
        prompt_b = (request.num_prompt_tokens - 1) // bs * bs
        cands = [(prompt_b, False)] if start < prompt_b <= end else []
        if end % bs == 0 and end > max(prompt_b, start):
            cands.append((end, True))
        floor = max(self.layout.sink + 1, self.snapshot_floor.get(rid, 0))
        out = []
        for b, decode in cands:
            if b < floor:
                continue
            if b > request.num_tokens:  # async scheduling: the boundary's token is still being sampled
                slot = self.snaps.reserve(rid, b)
                if slot is not None:
                    out.append((b, slot))
                continue
            h = self._hash_blocks(request, b)[b // bs - 1]
            slot = self.snaps.take(rid, h, replace=self.snaps.latest.get(rid) if decode else None)
            if slot is not None:
                out.append((b, slot))
                if decode:
                    self.snaps.latest[rid] = h
        return out

    def needs_known_tokens(self, request: Request, end: int) -> bool:
        """Whether a step computing up to `end` may save a state checkpoint, keyed by the hash of tokens
        [0, end): with async scheduling the last of them may still be on its way back, and such a step
        waits until it is known (every checkpoint_interval tokens of a hybrid model's decode).
        Exact-window snapshots do not wait: their slot is reserved and named later (`snapshot_captures`)."""
        if end <= request.num_tokens or end % self.block_size:
            return False
        lay = self.layout
        # `checkpoint_slot_for`: a deferred step is a one-token decode, saved every checkpoint_interval
        return (
            lay.has_state
            and lay.enable_prefix_caching
            and bool(lay.num_checkpoint_slots)
            and end % lay.checkpoint_interval == 0
        )

    def checkpoint_slot_for(self, request: Request, n: int, prefill: bool) -> int | None:
        """A checkpoint slot to save the request's state into, or None. Prefill chunks end on the
        boundaries the scheduler chose (every checkpoint_interval tokens and the prompt's last full
        block); decode saves only every checkpoint_interval tokens to bound the copy traffic.
        `n` is the request's computed length once the step has run."""
        if not (self.layout.has_state and self.layout.enable_prefix_caching) or n == 0 or n % self.block_size:
            return None
        if not prefill and n % self.layout.checkpoint_interval:
            return None
        if not self.layout.num_checkpoint_slots:
            return None
        h = self._hash_blocks(request, n)[n // self.block_size - 1]
        if h in self.ckpt:
            self.ckpt.move_to_end(h)
            return None
        if self.free_ckpt_slots:
            slot = self.free_ckpt_slots.pop()
        else:
            _, slot = self.ckpt.popitem(last=False)
        self.ckpt[h] = slot
        return slot

    # ---- release --------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.block_tables.pop(rid, [])
        self.pool.release(list(reversed(table)))
        slot = self.seq_slot.pop(rid, None)
        if slot is not None:
            self.free_seq_slots.append(slot)
        self.block_hashes.pop(rid, None)
        self.num_registered.pop(rid, None)
        self.snapshot_floor.pop(rid, None)
        if self.snaps is not None:
            self.snaps.release(rid)

    # ---- views for the runner ---------------------------------------------------------------
    def sink_slot(self, request_id: str) -> int:
        table = self.block_tables.get(request_id)
        return self.sink_of_page.get(table[0], 0) if table else 0

    @property
    def usage(self) -> float:
        return self.pool.usage
