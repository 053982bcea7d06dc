"""The byte-permute decoders' PTX (`paged_decode.prmt_pair_slices`, `prmt_slices_b8`), run on the CPU by a
small emulator of the few integer instructions they use, against the codebook lookup they stand for. (The
GPU tests compare the kernels' outputs with the gathers; this checks the strings themselves in CI.)"""

from __future__ import annotations

import random

import pytest
import torch

from tqserve.attention import paged_decode
from tqserve.kvquant.reference import tq_codebook

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i is byte (sel nibble i & 7) of {b, a}; bit 3 of the
    nibble replicates that byte's sign bit instead."""
    src = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nib = sel >> 4 * i & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit k of the result is bit (a_k << 2 | b_k << 1 | c_k) of the 8-bit lut."""
    out = 0
    for k in range(32):
        out |= (lut >> ((a >> k & 1) << 2 | (b >> k & 1) << 1 | (c >> k & 1)) & 1) << k
    return out


def _run(asm: str, inputs: dict[str, int], outputs: list[str]) -> list[int]:
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & MASK

    for line in asm.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *args = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(args[0])
        elif op == "shr.u32":
            regs[d] = val(args[0]) >> val(args[1])
        elif op == "shl.b32":
            regs[d] = (val(args[0]) << val(args[1])) & MASK
        elif op == "and.b32":
            regs[d] = val(args[0]) & val(args[1])
        elif op == "xor.b32":
            regs[d] = val(args[0]) ^ val(args[1])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(args[0]), val(args[1]), val(args[2]), val(args[3]))
        elif op == "mad.lo.u32":
            regs[d] = (val(args[0]) * val(args[1]) + val(args[2])) & MASK
        elif op == "prmt.b32":
            regs[d] = _prmt(val(args[0]), val(args[1]), val(args[2]))
        else:
            raise AssertionError(f"instruction the emulator does not know: {line!r}")
    return [regs[o] for o in outputs]


def _bits(codebook16: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFF for v in codebook16.view(torch.int16).tolist()]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prmt_slices_b8_decode_four_bytes(head_dim):
    """Four byte words in $2 -> $0 = (c[code_j of byte 0], of byte 1), $1 = (of bytes 2, 3)."""
    cb16 = tq_codebook(2, head_dim)[0].half()
    c = _bits(cb16)
    decoders = paged_decode.prmt_slices_b8(cb16)
    rng = random.Random(0)
    for word in [0, MASK, 0x1B1B1B1B] + [rng.getrandbits(32) for _ in range(200)]:
        for j, asm in enumerate(decoders):
            lo, hi = _run(asm, {"$2": word}, ["$0", "$1"])
            codes = [(word >> (8 * b + 2 * j)) & 3 for b in range(4)]
            assert lo == c[codes[0]] | c[codes[1]] << 16, (hex(word), j)
            assert hi == c[codes[2]] | c[codes[3]] << 16, (hex(word), j)


def test_prmt_pair_slices_decode_two_words():
    """Two 16-bit words in $1 -> $0 = (c[code_j of word 0], c[code_j of word 1]), codes at bits 2j and
    16 + 2j (the bits of the other slices are ignored)."""
    cb16 = tq_codebook(2, 128)[0].half()
    c = _bits(cb16)
    rng = random.Random(1)
    for word in [0, MASK] + [rng.getrandbits(32) for _ in range(200)]:
        for j, asm in enumerate(paged_decode.prmt_pair_slices(cb16)):
            (out,) = _run(asm, {"$1": word}, ["$0"])
            a, b = word >> 2 * j & 3, word >> (16 + 2 * j) & 3
            assert out == c[a] | c[b] << 16, (hex(word), j)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_i8_keys_decode_eight_codes(head_dim):
    """The int8 key decoder (`paged_decode_narrow.i8_keys_ptx`): 4 code bytes in $2 (sign-magnitude 4-bit
    codes, nibble i = coordinate i) -> $0 = the int8 grid numbers x of nibbles 0-3, $1 = of nibbles 4-7, a byte
    each; and the grid itself: the codec's float32 centroids by code are (x + 1/2) g."""
    from tqserve.attention import paged_decode_narrow as narrow
    from tqserve.kvquant.reference import tq_code_table, tq_int8_codes, tq_int8_grid

    x, g = tq_int8_codes(4, head_dim)
    cents = tq_code_table(4, head_dim).double()
    assert torch.allclose(cents, (torch.tensor(x, dtype=torch.float64) + 0.5) * g, rtol=1e-6, atol=0)
    asm = narrow.i8_keys_ptx(x)
    rng = random.Random(2)
    words = [0, MASK, 0x76543210, 0xFEDCBA98, 0x88888888] + [rng.getrandbits(32) for _ in range(500)]
    for word in words:
        lo, hi = _run(asm, {"$2": word}, ["$0", "$1"])
        got = [(lo >> 8 * i) & 0xFF for i in range(4)] + [(hi >> 8 * i) & 0xFF for i in range(4)]
        want = [x[(word >> 4 * i) & 0xF] & 0xFF for i in range(8)]
        assert got == want, hex(word)
    with pytest.raises(AssertionError):
        narrow.i8_keys_ptx(list(range(16)))  # not symmetric
    with pytest.raises(AssertionError):
        narrow.i8_keys_ptx(tq_int8_grid(4, head_dim)[0])  # sorted order, not code order
