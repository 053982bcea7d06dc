"""The GPU attention backend: fused store kernel, then the Triton paged-attention kernel family.

Same contract and same numbers as `attention/reference.py` (the executable definition): write this
step's K/V into pages (quantized once), attend reading what is stored plus the exact sink / window
copies, then refresh those copies. Everything is driven by device metadata; launch grids use host
integers only (`max_query_len`, `max_seq_len`, `num_reqs`, token count), so a step can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch

from tqserve.attention.backend import AttentionBackend, AttentionMetadata
from tqserve.attention.exact_refresh import refresh_exact
from tqserve.attention.finish import warm_split_combine
from tqserve.attention.paged import PageLayout, layout_for_format, paged_attention
from tqserve.attention.paged_decode import slices
from tqserve.attention.reference import KVCacheStore
from tqserve.attention.rotate import hadamard16, hadamard_table
from tqserve.kvquant.store_triton import StorePlan, store_kv


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, store: KVCacheStore) -> None:
        self.store = store
        dev = next(iter(store.pages[0].values())).device if store.pages else torch.device("cpu")
        self.device = dev
        self.num_q_heads: int | None = None  # seen at the first forward (warm_up needs it)
        # Codebooks, rotation matrices and kernel arguments are built once at startup (invariant 3).
        self.layouts: list[PageLayout] = [layout_for_format(f, dev) for f in store.formats]
        self.plans: list[StorePlan] = [StorePlan(f, dev) for f in store.formats]

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store = self.store
        self.num_q_heads = q.shape[1]  # for warm_up(): the query heads of this rank
        pages = store.pages[layer_idx]
        t = k.shape[0]
        store_kv(pages, self.plans[layer_idx], k, v, meta.slot_mapping[:t])
        out = paged_attention(
            q,
            k,
            v,
            pages,
            self.layouts[layer_idx],
            meta,
            scale,
            ring=store.ring[layer_idx],
            sinks=store.sinks[layer_idx],
        )
        refresh_exact(store, layer_idx, k, v, meta)
        return out

    def warm_up(self) -> None:
        """After the engine's warm-up steps (which set `num_q_heads`): compile what no step shape is
        sure to reach, the split-K combine of every split-count class of each distinct layout, and build
        the Hadamard tables of the query rotation's 16-bit dots (device tensors: none may be made while
        a CUDA graph is captured)."""
        heads = self.num_q_heads
        if heads is None:
            return
        seen = set()
        for fmt, layout in zip(self.store.formats, self.layouts):
            key = (layout.rotated_values, bool(layout.sink or layout.window), fmt.head_dim, fmt.model_dtype)
            if key not in seen:
                seen.add(key)
                warm_split_combine(layout, heads, fmt.head_dim, fmt.model_dtype, self.device)
            if layout.key_rotation is not None and hadamard16(fmt.head_dim, fmt.model_dtype):
                hadamard_table(fmt.head_dim, fmt.model_dtype, self.device)
                # the narrow decode kernel's in-kernel rotation dots one slice at a time (`ROT16`)
                per_slice = fmt.head_dim // slices(layout.key_bits)
                if per_slice >= 16:
                    hadamard_table(per_slice, fmt.model_dtype, self.device)
