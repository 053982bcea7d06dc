"""The contract between the paged KV cache and a KV storage format (one instance per attention layer).

A format decides what bytes a page holds for each token and KV head. The engine allocates pages
through `allocate`, writes every new token once through `write` (the torch reference; Triton store
kernels replace it on the GPU) and the reference attention reads tokens back through `read`.
Exact copies (sink tokens, a recent window) are not part of the page: the attention backend keeps
them in buffers sized at startup and applies the position rule
`exact iff key_pos < sink or query_pos - key_pos < window`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def null_redirect(slot_mapping: torch.Tensor) -> torch.Tensor:
    """Send skipped writes (slot < 0) to slot 0: page 0 is the null page, never given to a request
    and never read, so a fixed-shape scatter needs no data-dependent masking (invariant 2)."""
    return slot_mapping.clamp(min=0)


def page_offsets(pages: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) index vectors for a `[num_blocks, Hkv, block_size, ...]` tensor, skipped
    writes redirected to the null page."""
    bs = pages.shape[2]
    slots = null_redirect(slot_mapping)
    return slots // bs, slots % bs


class LayerKVFormat(ABC):
    name: str = "?"
    sink: int = 0  # exact sink tokens (positions 0..sink-1)
    window: int = 0  # exact recent window W: key exact when query_pos - key_pos < W

    def __init__(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype, layer_idx: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.model_dtype = model_dtype
        self.layer_idx = layer_idx

    @abstractmethod
    def page_bytes_per_token(self) -> int:
        """Exact bytes one token occupies in a page, all KV heads, K and V together."""

    @abstractmethod
    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Allocate the page tensors of one layer."""

    @abstractmethod
    def write(
        self,
        cache: dict[str, torch.Tensor],
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store k, v [T, Hkv, d] at page slots `slot_mapping` [T] (int64; negative = skip, see
        `null_redirect`)."""

    @abstractmethod
    def read(self, cache: dict[str, torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (k, v) [N, Hkv, d] in float32 for page slots [N], decoded from what is stored."""


class ExactFormat(LayerKVFormat):
    """Pages hold K and V in the model dtype (the `auto` / `bfloat16` preset)."""

    name = "auto"

    def __init__(
        self,
        num_kv_heads,
        head_dim,
        model_dtype,
        layer_idx,
        storage_dtype: torch.dtype | None = None,
    ):
        super().__init__(num_kv_heads, head_dim, model_dtype, layer_idx)
        self.storage_dtype = storage_dtype or model_dtype

    def page_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.storage_dtype).bits // 8

    def allocate(self, num_blocks, block_size, device):
        shape = (num_blocks, self.num_kv_heads, block_size, self.head_dim)
        return {
            "k": torch.zeros(shape, dtype=self.storage_dtype, device=device),
            "v": torch.zeros(shape, dtype=self.storage_dtype, device=device),
        }

    def write(self, cache, k, v, slot_mapping, offsets: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`offsets`: (page, offset) of each slot when the caller already has them (shared by layers)."""
        page, off = offsets if offsets is not None else page_offsets(cache["k"], slot_mapping)
        cache["k"][page, :, off] = k.to(self.storage_dtype)
        cache["v"][page, :, off] = v.to(self.storage_dtype)

    def read(self, cache, slots):
        bs = cache["k"].shape[2]
        page, off = slots // bs, slots % bs
        return cache["k"][page, :, off].float(), cache["v"][page, :, off].float()
