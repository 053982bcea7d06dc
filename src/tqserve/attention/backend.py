"""The attention backend interface and the per-step metadata every backend reads.

The input-batch builder (engine/input_batch.py) fills `AttentionMetadata` once per step from
persistent buffers sized at startup (invariants 2 and 3). Model code passes it through untouched;
only attention layers read it (invariant 7).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class RingSnapshots:
    """Exact-window snapshots written this step (core/window_snapshots.py), one row per snapshot:
    the exact K/V of positions [b - W, b) (W: the largest window) go to a snapshot slot, read from
    the request's ring for positions before its first token this step, else from this step's k/v."""

    positions: torch.Tensor  # [n, W] int64: b - W .. b - 1 (negative ones are discarded)
    start: torch.Tensor  # [n] int64: position of the request's first token this step
    token0: torch.Tensor  # [n] int64: that token's row in this step's k / v
    seq_slot: torch.Tensor  # [n] int64: the request's ring
    slot: torch.Tensor  # [n] int64: the snapshot slot written


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step. Device tensors are views of persistent buffers.

    Tokens of a step are laid out request after request; request i owns query tokens
    `query_start_loc[i]:query_start_loc[i+1]`, which sit at positions
    `seq_lens[i] - query_len_i ... seq_lens[i] - 1` of its sequence.
    """

    num_reqs: int
    num_tokens: int  # real (unpadded) tokens
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context + this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_seq] int32 (page ids)
    slot_mapping: torch.Tensor  # [num_tokens] int64: page slot (block*block_size+offset); -1 = do not write
    positions: torch.Tensor  # [num_tokens] int64
    seq_slots: torch.Tensor  # [num_reqs] int32: persistent per-request slot (exact window ring, GDN state); 0 = null
    sink_slots: torch.Tensor  # [num_reqs] int32: sink-buffer entry of the request's first page (0 = none)
    # Host copies made by the builder from the same Python lists (never read back from the device);
    # the torch reference backend loops over them.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    seq_slots_cpu: list[int] = field(default_factory=list)
    sink_slots_cpu: list[int] = field(default_factory=list)
    block_tables_cpu: list[list[int]] = field(default_factory=list)
    slot_mapping_cpu: list[int] = field(default_factory=list)
    ring_snapshots: RingSnapshots | None = None
    # Extra per-model-family metadata (GDN chunk indices, spec-decode info) goes here by name.
    extra: dict = field(default_factory=dict)


class AttentionBackend(ABC):
    """Owns the KV pages (and exact-copy buffers) of every attention layer and runs attention.

    `forward` must (1) write this step's K/V into the pages at `slot_mapping` (quantized once, by the
    layer's KV format), (2) compute causal attention for every query token over its request's whole
    sequence reading what is stored (invariant 1), and (3) refresh any exact-copy buffers.
    q: [T, Hq, d]; k, v: [T, Hkv, d]; returns [T, Hq, d] in q's dtype.
    """

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
