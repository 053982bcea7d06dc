"""Dequantization of GGML tensor types in torch (so it can run on the GPU at load time).

Each function takes the raw bytes of whole blocks, `[n_blocks, type_size]` uint8, and returns
`[n_blocks, block_size]` float32. Layouts follow ggml's block structs (little-endian; f16 scales).
`dequantize` covers the common types; anything else falls back to gguf-py's numpy reference.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of each block, as a [n, 1] float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the nibbles of `qs` [..., k] into `out` [..., 2k] (float32): the k low nibbles first,
    then the k high ones (ggml's q4 order). Writing into slices converts to float in the same pass;
    loading runs this over every weight, so it avoids temporaries."""
    k = qs.shape[-1]
    out[..., :k] = qs & 0x0F
    out[..., k:] = qs >> 4
    return out


def _empty(blocks: torch.Tensor, *shape: int) -> torch.Tensor:
    return torch.empty(blocks.shape[0], *shape, dtype=torch.float32, device=blocks.device)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(blocks, 0))


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _unpack_nibbles(blocks[:, 2:], _empty(blocks, 32)).sub_(8).mul_(_f16(blocks, 0))


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _unpack_nibbles(blocks[:, 4:], _empty(blocks, 32)).mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins. Sub-blocks 0-3 keep theirs in the low 6 bits
    of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take 4 bits from bytes 8-11 and their top
    2 bits from the spare high bits of bytes 0-3 / 4-7."""
    s = s.int()
    scale = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    minimum = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    return scale.float(), minimum.float()


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # d f16 | dmin f16 | scales[12] | qs[128]; 8 sub-blocks of 32 values. Each 32-byte chunk of qs
    # holds two sub-blocks: its low nibbles, then its high nibbles.
    n = blocks.shape[0]
    scale, minimum = _q4_k_scales(blocks[:, 4:16])
    q = _unpack_nibbles(blocks[:, 16:].reshape(n, 4, 32), _empty(blocks, 4, 64)).view(n, 8, 32)
    q.mul_((_f16(blocks, 0) * scale).unsqueeze(-1)).sub_((_f16(blocks, 2) * minimum).unsqueeze(-1))
    return q.view(n, 256)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales[16] int8 | d f16; one scale per 16 values.
    # Within each half of 128 values: groups 0,1 are the low nibbles of ql chunks 0,1; groups 2,3
    # their high nibbles; group g takes bits 2g..2g+1 of qh.
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 2, 32)  # [half, 32-byte chunk, l]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    q = torch.empty(n, 2, 4, 32, dtype=torch.uint8, device=blocks.device)
    q[:, :, :2] = ql & 0x0F
    q[:, :, 2:] = ql >> 4
    shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.uint8).view(1, 1, 4, 1)
    q |= ((qh >> shifts) & 3) << 4
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float().mul_(_f16(blocks, 208))
    out = q.view(n, 16, 16).float().sub_(32)
    return out.mul_(scales.unsqueeze(-1)).view(n, 256)


_BLOCK_DEQUANT = {
    GGMLQuantizationType.Q8_0: dequant_q8_0,
    GGMLQuantizationType.Q4_0: dequant_q4_0,
    GGMLQuantizationType.Q4_1: dequant_q4_1,
    GGMLQuantizationType.Q4_K: dequant_q4_k,
    GGMLQuantizationType.Q6_K: dequant_q6_k,
}
_PLAIN = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], device=None) -> torch.Tensor:
    """Raw tensor data as stored in the file (any numpy dtype) -> float32 tensor of `shape`
    (the logical, row-major shape: GGML's ne reversed)."""
    qtype = GGMLQuantizationType(qtype)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if qtype in _PLAIN:
        bytes_ = torch.from_numpy(data.copy()).to(device)
        return bytes_.view(_PLAIN[qtype]).float().reshape(shape)
    if qtype in _BLOCK_DEQUANT:
        _, type_size = GGML_QUANT_SIZES[qtype]
        blocks = torch.from_numpy(data.copy()).to(device).reshape(-1, type_size)
        return _BLOCK_DEQUANT[qtype](blocks).reshape(shape)
    # Rarer types: gguf-py's numpy reference (slower, CPU).
    _, type_size = GGML_QUANT_SIZES[qtype]
    out = gguf_quants.dequantize(data.reshape(-1, type_size), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(device).reshape(shape)


def supported_natively() -> list[str]:
    return sorted(t.name for t in [*_PLAIN, *_BLOCK_DEQUANT])
