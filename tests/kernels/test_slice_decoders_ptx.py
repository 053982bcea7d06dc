"""The inline-PTX slice decoders of attention/paged_decode.py, run on the CPU by a small emulator of
the PTX they use (32 lanes in lock step): every code / word combination must decode to the centroid
the torch gathers read. The GPU test `test_asm_decoders_equal_gathers` checks the same decoders
inside the kernels; this one needs no GPU and covers every input word."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tqserve.attention import paged_decode
from tqserve.kvquant.reference import tq_code_table

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a | b << 32).to_bytes(8, "little")
    out = 0
    for k in range(4):
        nib = (sel >> 4 * k) & 0xF
        byte = pool[nib & 7]
        if nib & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * k
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def run_ptx(block: str, inputs: dict[str, list[int]], outputs: list[str]) -> dict[str, list[int]]:
    """Execute one `{ ... }` block on 32 lanes; `inputs` maps $k to per-lane values."""
    regs = [dict() for _ in range(32)]
    for lane in range(32):
        for name, vals in inputs.items():
            regs[lane][name] = vals[lane] & M32
        regs[lane]["%laneid"] = lane

    def val(lane: int, tok: str) -> int:
        tok = tok.strip()
        if tok in regs[lane]:
            return regs[lane][tok]
        return int(tok, 0) & M32

    for line in block.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {lo, hi}, src: a register's 16-bit halves
            lo, hi, src = (x.strip(" {}") for x in rest.split(","))
            for lane in range(32):
                regs[lane][lo], regs[lane][hi] = _halves(regs[lane][src])
            continue
        args = [x.strip() for x in rest.split(",")]
        if op.startswith("shfl.sync.idx"):
            src = [regs[lane][args[1]] for lane in range(32)]
            for lane in range(32):
                regs[lane][args[0]] = src[val(lane, args[2]) & 0x1F]
            continue
        for lane in range(32):
            v = [val(lane, a) for a in args[1:]]
            if op.startswith("mov"):
                r = v[0]
            elif op.startswith("and"):
                r = v[0] & v[1]
            elif op.startswith("or"):
                r = v[0] | v[1]
            elif op.startswith("xor"):
                r = v[0] ^ v[1]
            elif op.startswith("not"):
                r = ~v[0]
            elif op.startswith("shr"):
                r = v[0] >> v[1] if v[1] < 32 else 0
            elif op.startswith("shl"):
                r = v[0] << v[1]
            elif op.startswith("mul.lo"):
                r = v[0] * v[1]
            elif op.startswith("mad.lo"):
                r = v[0] * v[1] + v[2]
            elif op == "cvt.rn.f16x2.e4m3x2":  # two e4m3 bytes (low one first) -> f16x2
                e = torch.tensor([v[0] & 0xFF, (v[0] >> 8) & 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
                h = e.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
                r = int(h[0]) | int(h[1]) << 16
            elif op.startswith("add.rn.f16x2"):
                h = [np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16) for x in v]
                r = int((h[0] + h[1]).view(np.uint16).astype(np.uint32) @ np.array([1, 1 << 16], dtype=np.uint32))
            elif op.startswith("add"):
                r = v[0] + v[1]
            elif op.startswith("prmt"):
                r = _prmt(v[0], v[1], v[2])
            elif op.startswith("lop3"):
                r = _lop3(v[0], v[1], v[2], v[3])
            else:
                raise NotImplementedError(op)
            regs[lane][args[0]] = r & M32
    return {o: [regs[lane][o] for lane in range(32)] for o in outputs}


def _halves(x: int) -> tuple[int, int]:
    return x & 0xFFFF, x >> 16


def _cb_bits(bits: int, d: int = 128) -> list[int]:
    c = tq_code_table(bits, d).half()
    return [int(v) & 0xFFFF for v in c.view(torch.int16).numpy()]


@pytest.mark.parametrize("pairs", [0, 1, 2, 3])
def test_two_bit_pair_decoders(pairs):
    """`shfl_pair_slices` (one shuffle per two codes), `shfl_slices` at 2 bits (pairs joined by a permute,
    or by an f16x2 add: 3) and `prmt_pair_slices` (no shuffle): all 256 x 256 (word 0, word 1) byte-word
    pairs, every slice."""
    host = tq_code_table(2, 128).half()
    table = _cb_bits(2)
    make = {
        0: lambda h: paged_decode.shfl_slices(h, 2),
        1: paged_decode.shfl_pair_slices,
        3: lambda h: paged_decode.shfl_slices(h, 2, True),
    }
    blocks = make.get(pairs, paged_decode.prmt_pair_slices)(host)
    rng = np.random.default_rng(0)
    words = [(w0, w1) for w0 in range(256) for w1 in range(256)]
    rng.shuffle(words)
    for j, block in enumerate(blocks):
        for start in range(0, len(words), 32 * 64 if j else 32):  # slice 0: every pair; others: a sample
            chunk = words[start : start + 32]
            got = run_ptx(block, {"$1": [w0 | w1 << 16 for w0, w1 in chunk]}, ["$0"])["$0"]
            for (w0, w1), r in zip(chunk, got, strict=True):
                assert _halves(r) == (table[(w0 >> 2 * j) & 3], table[(w1 >> 2 * j) & 3]), (j, w0, w1)


@pytest.mark.parametrize("pairs", [0, 1])
def test_two_bit_decoders_byte_words(pairs):
    """`shfl_pair_slices_b8` and `shfl_slices_b8`: four byte words per register -> two fp16x2
    results, every slice."""
    host = tq_code_table(2, 128).half()
    table = _cb_bits(2)
    rng = np.random.default_rng(1)
    blocks = paged_decode.shfl_pair_slices_b8(host) if pairs else paged_decode.shfl_slices_b8(host)
    for j, block in enumerate(blocks):
        for _ in range(64):
            x = [int(v) for v in rng.integers(0, 1 << 32, 32, dtype=np.uint64)]
            got = run_ptx(block, {"$2": x}, ["$0", "$1"])
            for lane in range(32):
                codes = [(x[lane] >> (8 * k + 2 * j)) & 3 for k in range(4)]
                assert _halves(got["$0"][lane]) == (table[codes[0]], table[codes[1]])
                assert _halves(got["$1"][lane]) == (table[codes[2]], table[codes[3]])


@pytest.mark.parametrize("lookup", ["shfl", "prmt", "shfl_add"])
def test_four_bit_decoders(lookup):
    """`shfl_slices` (pairs joined by a permute or an f16x2 add) and `prmt_slices` (symmetric codebook) at 4
    bits: random word pairs, every slice."""
    host = tq_code_table(4, 128).half()
    table = _cb_bits(4)
    rng = np.random.default_rng(2)
    if lookup == "prmt":
        tables = paged_decode.prmt_tables(host)
        assert tables is not None, "the 4-bit codebook is symmetric"
        blocks = paged_decode.prmt_slices(tables)
    else:
        blocks = paged_decode.shfl_slices(host, 4, lookup == "shfl_add")
    if any("setp" in b for b in blocks):  # the 4-bit table takes a predicate: emulate selp here
        blocks = [_inline_selp(b) for b in blocks]
    for j, block in enumerate(blocks):
        for _ in range(64):
            x = [int(v) for v in rng.integers(0, 1 << 32, 32, dtype=np.uint64)]
            got = run_ptx(block, {"$1": x}, ["$0"])["$0"]
            for lane in range(32):
                w0, w1 = _halves(x[lane])
                assert _halves(got[lane]) == (table[(w0 >> 4 * j) & 15], table[(w1 >> 4 * j) & 15])


def _inline_selp(block: str) -> str:
    """Rewrite `setp.ne.u32 p, m, 0; selp.b32 d, x, y, p` (lane bit 3 picks a table half) into the
    emulator's operations: d = y ^ ((x ^ y) & -(m != 0)), with m = lane & 8 -> mask by shifting."""
    block = re.sub(r"setp\.ne\.u32 p, m, 0;\n", "shr.u32 pm, m, 3;\nmul.lo.u32 pm, pm, 0xffffffff;\n", block)

    def sel(match: re.Match) -> str:
        d, x, y = match.group(1), match.group(2), match.group(3)
        return f"xor.b32 {d}, {x}, {y};\nand.b32 {d}, {d}, pm;\nxor.b32 {d}, {d}, {y};\n"

    return re.sub(r"selp\.b32 (\w+), (\w+), (\w+), p;\n", sel, block)


def test_three_bit_permute_decoders():
    """`prmt_slices3`: the spread puts code k of a 24-bit group (bits above it random) in nibble k with bit 3
    clear, and slice j of two spread groups with the selector of byte j // 2 is (c[code j], c[code j]) of
    the two as f16x2, every slice, random groups."""
    host = tq_code_table(3, 128).half()
    table = _cb_bits(3)
    (even, odd, *_), spread = paged_decode.prmt_slices3(host)
    rng = np.random.default_rng(4)
    for _ in range(32):
        w = [[int(v) for v in rng.integers(0, 1 << 32, 32, dtype=np.uint64)] for _ in range(2)]
        n = [run_ptx(spread, {"$1": x}, ["$0"])["$0"] for x in w]
        for lane in range(32):
            for k in range(8):
                assert (n[0][lane] >> 4 * k) & 0xF == (w[0][lane] >> 3 * k) & 7
        for j in range(8):
            sel = [(j // 2) | (4 + j // 2) << 4] * 32
            got = run_ptx(even if j % 2 == 0 else odd, {"$1": n[0], "$2": n[1], "$3": sel}, ["$0"])["$0"]
            for lane in range(32):
                want = tuple(table[(x[lane] >> 3 * j) & 7] for x in w)
                assert _halves(got[lane]) == want, (j, lane)


def test_fp8_decoders():
    """`fp8_slices`: slice j of two words is (e4m3 byte j of the first, of the second) as f16x2, exactly the
    fp16 value of each byte (the gathers' table, `fp8_table`), for random words without NaN bytes."""
    table = [int(v) & 0xFFFF for v in paged_decode.fp8_table("cpu", torch.float16).view(torch.int16)]
    rng = np.random.default_rng(3)
    nan_free = [b for b in range(256) if b & 0x7F != 0x7F]  # e4m3fn NaN: S.1111.111 (the store never writes it)
    for j, block in enumerate(paged_decode.fp8_slices()):
        for _ in range(16):
            words = [[int.from_bytes(bytes(rng.choice(nan_free, 4)), "little") for _ in range(32)] for _ in range(2)]
            got = run_ptx(block, {"$1": words[0], "$2": words[1]}, ["$0"])["$0"]
            for lane in range(32):
                want = tuple(table[(w[lane] >> 8 * j) & 0xFF] for w in words)
                assert _halves(got[lane]) == want, (j, lane)


@pytest.mark.parametrize("bits", [2, 4])
def test_minmax_decoders(bits):
    """`minmax_slices`: u = 2^b + idx as fp16, bit-identical to `_mm_slice`, every 16-bit word."""
    blocks = paged_decode.minmax_slices(bits)
    words = list(range(1 << 16))
    for j, block in enumerate(blocks):
        for start in range(0, len(words), 32 * 97):
            chunk = [words[(start + k) % len(words)] for k in range(32)]
            x = [w | ((w * 7919) & 0xFFFF) << 16 for w in chunk]
            got = run_ptx(block, {"$1": x}, ["$0"])["$0"]
            for lane in range(32):
                for half, w in zip(_halves(got[lane]), _halves(x[lane]), strict=True):
                    idx = (w >> bits * j) & ((1 << bits) - 1)
                    want = np.float16(2**bits + idx).view(np.uint16)
                    assert half == int(want), (bits, j, w)


def test_three_bit_decoders():
    """`shfl_slices3` (codebook) and `minmax_slices3` (u = 8 + code): two int32 words per call whose
    low 3 bits are the codes and whose higher bits are the next codes (the kernel shifts slice j's
    code down): every code pair, with random high bits."""
    table = _cb_bits(3)
    shfl = paged_decode.shfl_slices3(tq_code_table(3, 128).half())
    mm = paged_decode.minmax_slices3()
    assert len(set(shfl)) == 1 and len(set(mm)) == 1  # one string serves every slice
    rng = np.random.default_rng(3)
    pairs = [(a, b) for a in range(8) for b in range(8)]
    for start in range(0, len(pairs), 32):
        chunk = pairs[start : start + 32]
        hi = rng.integers(0, 1 << 29, size=(len(chunk), 2))
        x1 = [a | int(h) << 3 for (a, _), h in zip(chunk, hi[:, 0], strict=True)]
        x2 = [b | int(h) << 3 for (_, b), h in zip(chunk, hi[:, 1], strict=True)]
        got = run_ptx(shfl[0], {"$1": x1, "$2": x2}, ["$0"])["$0"]
        got_mm = run_ptx(mm[0], {"$1": x1, "$2": x2}, ["$0"])["$0"]
        for (a, b), r, r_mm in zip(chunk, got, got_mm, strict=True):
            assert _halves(r) == (table[a], table[b]), (a, b)
            want = tuple(int(np.float16(8 + c).view(np.uint16)) for c in (a, b))
            assert _halves(r_mm) == want, (a, b)
