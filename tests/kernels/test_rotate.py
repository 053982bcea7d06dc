"""`attention.rotate` (the query rotation of codebook keys): the Triton kernel against its torch
reference (on the GPU, and under the interpreter on tiny shapes), and the device dispatch."""

from __future__ import annotations

import pytest
import torch

from tqserve.attention.rotate import rotate_rows, rotate_rows_kernel, rotate_rows_reference
from tqserve.kvquant.rotation import Rotation

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rot(d: int) -> torch.Tensor:
    return Rotation(d, layer_idx=3).matrix.float().to(DEV).contiguous()


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads", [(1, 1), (3, 7), (5, 32)])
def test_rotate_rows_matches_reference(d, dtype, tokens, heads):
    gen = torch.Generator().manual_seed(d + tokens)
    # a strided token dim (a view into a fused qkv output) is read in place
    qkv = torch.randn(tokens, heads + 2, d, generator=gen).to(DEV, dtype)
    x = qkv[:, :heads]
    rot = _rot(d)
    got = rotate_rows_kernel(x, rot)
    want = rotate_rows_reference(x, rot)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate_rows(x, rot), want, rtol=1e-5, atol=1e-5)


def test_rotate_rows_many_rows_and_empty():
    rot = _rot(64)
    x = torch.randn(4200, 64, device=DEV)  # a long extend's rows: many row blocks
    torch.testing.assert_close(rotate_rows_kernel(x, rot), rotate_rows_reference(x, rot), rtol=1e-5, atol=1e-5)
    assert rotate_rows_kernel(x[:0], rot).shape == (0, 64)


@pytest.mark.parametrize("fn", [rotate_rows, rotate_rows_kernel])
def test_rotate_rows_rejects_bad_rotation(fn):
    with pytest.raises(ValueError, match="rot"):
        fn(torch.randn(2, 64, device=DEV), torch.randn(64, 64, device=DEV).half())
    with pytest.raises(ValueError, match="x must be"):
        fn(torch.randn(2, 2, 2, 64, device=DEV), _rot(64))


@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,heads", [(3, 7), (160, 32)])
def test_rotate_rows_hadamard_matches_reference(d, dtype, tokens, heads):
    """`hadamard=True` (R a randomized Hadamard block): 16-bit rows at a power-of-two d take one 16-bit dot
    (`_hadamard_kernel`, on the GPU), everything else the general kernel; the same result either way, to
    float32 rounding. 160 x 32 rows is a 32 x 5 verify step's query (GPU only: ~45 s under the interpreter)."""
    if DEV == "cpu" and tokens * heads > 64:
        pytest.skip("real-size rows run on the GPU")
    gen = torch.Generator().manual_seed(d * 3 + tokens)
    qkv = (torch.randn(tokens, heads + 2, d, generator=gen) * 3).to(DEV, dtype)
    x = qkv[:, :heads]
    rot = _rot(d)
    want = rotate_rows_reference(x, rot)
    got = rotate_rows(x, rot, hadamard=True)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate_rows_kernel(x, rot, hadamard=True), want, rtol=1e-5, atol=1e-5)
