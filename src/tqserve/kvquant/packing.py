"""Pack b-bit indices into bytes with no wasted bits (docs/architecture.md fixes the layout).

Per token and KV head the d indices form one little-endian bit stream: index j occupies bits
[j*b, (j+1)*b), its bit k is stream bit j*b + k, and stream bit i lives in byte i // 8 at bit
i % 8. A row of d indices takes ceil(d*b / 8) bytes (exact for the head sizes used: d*b % 8 == 0
whenever d is a multiple of 8).
"""

from __future__ import annotations

import torch


def packed_bytes(num_indices: int, bits: int) -> int:
    return (num_indices * bits + 7) // 8


def pack_bits(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx [..., n] integer in [0, 2^bits) -> uint8 [..., packed_bytes(n, bits)]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if idx.shape[-1] % 8 == 0 and bits < 8:
        return _pack_groups(idx, bits)
    return _pack_stream(idx, bits)


def _pack_stream(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout's definition, one bit at a time (any n)."""
    n = idx.shape[-1]
    nbytes = packed_bytes(n, bits)
    shifts = torch.arange(bits, device=idx.device, dtype=torch.int32)
    # stream[..., j, k] = bit k of index j, which is stream bit j*bits + k.
    stream = (idx.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    stream = stream.reshape(*idx.shape[:-1], n * bits)
    pad = nbytes * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = torch.arange(8, device=idx.device, dtype=torch.int32)
    byte_vals = (stream.view(*idx.shape[:-1], nbytes, 8) << weights).sum(-1)
    return byte_vals.to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 [..., packed_bytes(n, bits)] -> int64 indices [..., n]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if n % 8 == 0 and bits < 8 and packed.shape[-1] == n * bits // 8:
        return _unpack_groups(packed, bits, n)
    return _unpack_stream(packed, bits, n)


def _unpack_stream(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.to(torch.int32).unsqueeze(-1) >> weights) & 1
    stream = stream.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., : n * bits]
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    idx = (stream.view(*packed.shape[:-1], n, bits) << shifts).sum(-1)
    return idx.long()


# Eight indices fill exactly `bits` bytes of the stream, so a row of n = 8 m indices is m groups, each one
# little-endian integer of 8 * bits <= 56 bits (int64, sign bit clear) with index j at bit j * bits: one
# shift per index and per byte instead of one per bit (the CPU reference unpacks every page it reads,
# every step).
def _group_shifts(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.arange(8, device=device, dtype=torch.int64) * bits,
        torch.arange(bits, device=device, dtype=torch.int64) * 8,
    )


def _pack_groups(idx: torch.Tensor, bits: int) -> torch.Tensor:
    lead, n = idx.shape[:-1], idx.shape[-1]
    index_shift, byte_shift = _group_shifts(bits, idx.device)
    # the shifted indices occupy disjoint bits, so their sum is their OR
    word = (idx.to(torch.int64).reshape(*lead, n // 8, 8) << index_shift).sum(-1)
    return ((word.unsqueeze(-1) >> byte_shift) & 0xFF).to(torch.uint8).view(*lead, n * bits // 8)


def _unpack_groups(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    lead = packed.shape[:-1]
    index_shift, byte_shift = _group_shifts(bits, packed.device)
    word = (packed.to(torch.int64).reshape(*lead, n // 8, bits) << byte_shift).sum(-1)
    return ((word.unsqueeze(-1) >> index_shift) & ((1 << bits) - 1)).view(*lead, n)
