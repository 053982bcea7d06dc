"""A minimal GGUF reader: metadata and tensor locations in one pass over the header.

gguf-py's GGUFReader builds a numpy view for every string of the tokenizer arrays, which costs
seconds for a 50k-token vocabulary; the loader needs only a few scalars and the tensor table.
Tensor data stays in a read-only memory map. Little-endian GGUF v2/v3 only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {t: np.dtype(f) for t, f in _SCALARS.items()}


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGML order: ne0 (innermost, contiguous) first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8), a view of the memory map

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """Row-major shape (the HF / torch layout): ne reversed."""
        return tuple(reversed(self.shape))


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mm)
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(GGUFValueType(self._scalar("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            dims = tuple(self._scalar("<Q") for _ in range(n_dims))
            qtype = GGMLQuantizationType(self._scalar("<I"))
            infos.append((name, dims, qtype, self._scalar("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
            start = data_start + offset
            self.tensors.append(GGUFTensor(name, dims, qtype, self._mm[start : start + nbytes]))

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def tensor(self, name: str) -> GGUFTensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    # ---- parsing ------------------------------------------------------------------------------

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: GGUFValueType):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = GGUFValueType(self._scalar("<I")), self._scalar("<Q")
            if etype in _NUMPY:  # numeric arrays in one read
                dt = _NUMPY[etype]
                arr = np.frombuffer(self._buf, dtype=dt, count=count, offset=self._pos).copy()
                self._pos += count * dt.itemsize
                return arr
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")
