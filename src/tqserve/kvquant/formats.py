"""Page formats built from one codec for keys and one for values.

A `VectorCodec` turns x [T, Hkv, d] into named tensors [T, Hkv, ...] and back; `CodecFormat`
stores them in page tensors `k_<field>` / `v_<field>` of shape [num_blocks, Hkv, block_size, ...]
(the LayerKVFormat contract in base.py). Each token is quantized exactly once, when written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tqserve.kvquant import reference as ref
from tqserve.kvquant.base import LayerKVFormat, page_offsets
from tqserve.kvquant.packing import packed_bytes
from tqserve.kvquant.rotation import Rotation

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _nbytes(spec: FieldSpec) -> int:
    total = 0
    for shape, dtype in spec.values():
        n = 1
        for s in shape:
            n *= s
        total += n * (torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits) // 8
    return total


class VectorCodec(ABC):
    """Encodes one K or V vector per (token, KV head)."""

    label: str = "?"
    rotated: bool = False  # True when the stored values live in the rotated space

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    @abstractmethod
    def fields(self) -> FieldSpec:
        """Trailing shape and dtype of each stored tensor (per token and KV head)."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def decode(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 [..., d] in the original (unrotated) space."""

    def bytes_per_vector(self) -> int:
        return _nbytes(self.fields())

    def bits_per_value(self) -> float:
        return 8.0 * self.bytes_per_vector() / self.head_dim


class ExactCodec(VectorCodec):
    def __init__(self, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__(head_dim)
        self.dtype = dtype
        self.label = {
            torch.bfloat16: "bf16",
            torch.float16: "fp16",
            torch.float32: "fp32",
        }.get(dtype, str(dtype))

    def fields(self) -> FieldSpec:
        return {"x": ((self.head_dim,), self.dtype)}

    def encode(self, x):
        return {"x": x.to(self.dtype)}

    def decode(self, f):
        return f["x"].float()


class TurboQuantCodec(VectorCodec):
    rotated = True

    def __init__(
        self, head_dim: int, bits: int, rotation: Rotation, scale_mode: str = "nc", search: bool = False
    ) -> None:
        super().__init__(head_dim)
        self.bits, self.rotation, self.search = bits, rotation, search
        self.base_mode = scale_mode
        # The search encoder's indices differ from nearest-centroid ones: a distinct mode name, so the
        # Triton store kernel picks its search path (and a kernel without it could not silently
        # write nearest-centroid bits).
        self.scale_mode = f"{scale_mode}+search" if search else scale_mode
        self.label = f"tq{bits}-{self.scale_mode}"

    def fields(self) -> FieldSpec:
        return {
            "idx": ((packed_bytes(self.head_dim, self.bits),), torch.uint8),
            "scale": ((), torch.float16),
        }

    def encode(self, x):
        idx, scale = ref.tq_encode(x, self.rotation, self.bits, self.base_mode, self.search)
        return {"idx": idx, "scale": scale}

    def decode(self, f):
        return ref.tq_decode(f["idx"], f["scale"], self.rotation, self.bits, self.head_dim)


class Fp8ScaledCodec(VectorCodec):
    label = "fp8e4m3+scale"

    def fields(self) -> FieldSpec:
        return {"q": ((self.head_dim,), ref.FP8_DTYPE), "scale": ((), torch.float16)}

    def encode(self, x):
        q, scale = ref.fp8_encode(x)
        return {"q": q, "scale": scale}

    def decode(self, f):
        return ref.fp8_decode(f["q"], f["scale"])


class Fp8CastCodec(VectorCodec):
    label = "fp8e4m3"

    def fields(self) -> FieldSpec:
        return {"q": ((self.head_dim,), ref.FP8_DTYPE)}

    def encode(self, x):
        return {"q": ref.fp8_cast(x)}

    def decode(self, f):
        return f["q"].float()


class MinMaxCodec(VectorCodec):
    def __init__(self, head_dim: int, bits: int) -> None:
        super().__init__(head_dim)
        self.bits = bits
        self.label = f"minmax{bits}"

    def fields(self) -> FieldSpec:
        return {
            "idx": ((packed_bytes(self.head_dim, self.bits),), torch.uint8),
            "scale": ((), torch.float16),
            "zero": ((), torch.float16),
        }

    def encode(self, x):
        idx, scale, zero = ref.minmax_encode(x, self.bits)
        return {"idx": idx, "scale": scale, "zero": zero}

    def decode(self, f):
        return ref.minmax_decode(f["idx"], f["scale"], f["zero"], self.bits, self.head_dim)


class CodecFormat(LayerKVFormat):
    """Keys and values each through their own codec; optional exact sink / window declared here and
    applied by the attention backend."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        model_dtype: torch.dtype,
        layer_idx: int,
        key_codec: VectorCodec,
        value_codec: VectorCodec,
        name: str = "codec",
        sink: int = 0,
        window: int = 0,
    ) -> None:
        super().__init__(num_kv_heads, head_dim, model_dtype, layer_idx)
        self.key_codec, self.value_codec = key_codec, value_codec
        self.name, self.sink, self.window = (
            name,
            sink,
            window,
        )  # instance attributes shadow the class defaults

    @property
    def rotation(self) -> Rotation | None:
        for c in (self.key_codec, self.value_codec):
            if isinstance(c, TurboQuantCodec):
                return c.rotation
        return None

    def _specs(self) -> FieldSpec:
        spec: FieldSpec = {}
        for prefix, codec in (("k_", self.key_codec), ("v_", self.value_codec)):
            for name, s in codec.fields().items():
                spec[prefix + name] = s
        return spec

    def page_bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.key_codec.bytes_per_vector() + self.value_codec.bytes_per_vector())

    def allocate(self, num_blocks, block_size, device):
        return {
            name: torch.zeros(
                (num_blocks, self.num_kv_heads, block_size, *shape),
                dtype=dtype,
                device=device,
            )
            for name, (shape, dtype) in self._specs().items()
        }

    def write(self, cache, k, v, slot_mapping):
        first = next(iter(cache.values()))
        page, off = page_offsets(first, slot_mapping)
        for prefix, codec, x in (
            ("k_", self.key_codec, k),
            ("v_", self.value_codec, v),
        ):
            for name, t in codec.encode(x).items():
                cache[prefix + name][page, :, off] = t

    def _gather(self, cache, prefix, slots):
        bs = next(iter(cache.values())).shape[2]
        page, off = slots // bs, slots % bs
        n = len(prefix)
        return {name[n:]: t[page, :, off] for name, t in cache.items() if name.startswith(prefix)}

    def read(self, cache, slots):
        k = self.key_codec.decode(self._gather(cache, "k_", slots))
        v = self.value_codec.decode(self._gather(cache, "v_", slots))
        return k, v
