"""The launch tail (`attention/finish.py`): split-K combine, inverse value rotation, exact part, cast,
graph-padding rows, against the torch expression it computes. Interpreter on the CPU, real sizes on
the GPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tqserve.attention import finish
from tqserve.attention.finish import combine_splits, finish_parts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rotation(d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q.float().contiguous()


def _want(part, lse, splits, npart, rot, num_tokens, d):
    """The tail in float64 torch: weights exp2(lse - max) over splits with keys, page part (rotated
    back), plus the exact part; rows past num_tokens zero."""
    lse = lse[:splits].double()
    p = part[:splits].double()
    w = torch.exp2(lse - lse.amax(0, keepdim=True))
    w = torch.where(torch.isfinite(lse), w, 0.0)
    y = (w[..., None] * torch.where(w[..., None] > 0, p, 0.0)).sum(0) / w.sum(0)[..., None]
    res = y[..., :d] @ rot.double() if rot is not None else y[..., :d]
    if npart == 2:
        res = res + y[..., d:]
    res[num_tokens:] = 0
    return res


@pytest.mark.parametrize(
    "splits,npart,rotated,d,dtype",
    [
        (1, 1, True, 64, torch.bfloat16),
        (1, 2, False, 64, torch.float32),
        (3, 1, False, 64, torch.bfloat16),
        (3, 2, True, 128, torch.float32),
        (5, 1, True, 64, torch.bfloat16),
        (9, 2, False, 64, torch.float16),
        (16, 2, True, 80, torch.bfloat16),
        (40, 2, True, 80, torch.bfloat16),
        (257, 1, True, 128, torch.float16),
    ],
)
def test_finish_parts_matches_torch(splits, npart, rotated, d, dtype):
    dev = _device()
    gen = torch.Generator().manual_seed(splits * 7 + d)
    T, hq, num_tokens = 5, 3, 4  # one graph-padding token
    part = torch.randn(splits, T, hq, npart * d, generator=gen).to(dev)
    lse = (torch.randn(splits, T, hq, generator=gen) * 4).to(dev)
    if splits > 2:
        lse[1, 0, :] = float("-inf")  # a split that saw no keys: its partial is garbage
        part[1, 0] = float("nan")
    rot = _rotation(d, gen).to(dev) if rotated else None
    layout = SimpleNamespace(rotated_values=rotated, val_rotation=rot)
    meta = SimpleNamespace(num_tokens=num_tokens)
    out = torch.full((T, hq, d), float("nan"), device=dev, dtype=dtype)
    finish_parts(part, lse, out, splits, npart, layout, meta, T, hq, d)
    want = _want(part.cpu(), lse.cpu(), splits, npart, rot.cpu() if rotated else None, num_tokens, d)
    got = out.double().cpu()
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("part_first", [0, 1])
def test_combine_splits_many_columns_per_row(monkeypatch, part_first):
    """Hundreds of splits: the row's columns spread over programs, every column written; the partials
    loaded before or after the weights (`COMBINE_PART_FIRST`), a split without keys ignored either way."""
    monkeypatch.setattr(finish, "COMBINE_PART_FIRST", part_first)
    dev = _device()
    gen = torch.Generator().manual_seed(3)
    splits, T, hq, w = 300, 2, 2, 256
    part = torch.randn(splits, T, hq, w, generator=gen).to(dev)
    lse = torch.randn(splits, T, hq, generator=gen).to(dev)
    lse[7, 1, 0] = float("-inf")
    part[7, 1, 0] = float("nan")
    red = torch.full((T, hq, w), float("nan"), device=dev)
    combine_splits(part, lse, red, splits, T, hq, w)
    want = _want(part.cpu(), lse.cpu(), splits, 1, None, T, w)
    torch.testing.assert_close(red.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits,w", [(2, 64), (4, 128), (7, 256), (16, 128)])
def test_combine_splits_whole_rows(splits, w):
    """Few splits (`COMBINE_ROWS_MAX_SPLITS`): programs of several whole rows, a row count that leaves the
    last program partly empty, splits without keys in some rows; rows past num_tokens are not written."""
    dev = _device()
    gen = torch.Generator().manual_seed(splits * 11 + w)
    T, hq, num_tokens = 23, 7, 21
    part = torch.randn(splits, T, hq, w, generator=gen).to(dev)
    lse = (torch.randn(splits, T, hq, generator=gen) * 4).to(dev)
    lse[splits - 1, 3, 2] = float("-inf")
    part[splits - 1, 3, 2] = float("nan")
    lse[0, 20, :] = float("-inf")
    part[0, 20, :] = float("nan")
    red = torch.full((T, hq, w), float("nan"), device=dev)
    combine_splits(part, lse, red, splits, num_tokens, hq, w)
    want = _want(part.cpu(), lse.cpu(), splits, 1, None, T, w)
    torch.testing.assert_close(red[:num_tokens].double().cpu(), want[:num_tokens], rtol=1e-5, atol=1e-5)
    assert torch.isnan(red[num_tokens:]).all()


@pytest.mark.parametrize("d", [80, 128])
def test_backend_warm_up_builds_tables(d, monkeypatch):
    """The Triton backend's warm-up compiles the combines and builds the query rotation's Hadamard tables at
    power-of-two head sizes (a table made during graph capture would be a capture error), and passes by
    the others (d = 80: two Hadamard blocks, no table). The launches ask for them by their tensors' device
    (cuda:0) and get the warm-up's tables. (This test looked them up as "cuda" and so failed on the GPU until
    the forty-sixth session; the table's key now names the device with its index whichever way it is spelt.)"""
    from tqserve.attention import rotate
    from tqserve.attention.reference import KVCacheStore
    from tqserve.attention.triton_backend import TritonAttentionBackend
    from tqserve.kvquant.presets import make_layer_format

    dev = _device()  # "cuda", without an index
    monkeypatch.setattr(rotate, "_HADAMARD", {})
    fmt = make_layer_format("turboquant_4bit_nc", 0, 1, d, torch.bfloat16)
    backend = TritonAttentionBackend(KVCacheStore([fmt], 2, 16, 1, 1, dev))
    backend.num_q_heads = 2
    backend.warm_up()
    built = dict(rotate._HADAMARD)
    # d = 128: the rotation's table and the narrow kernel's per-slice one (4-bit keys: 4 slices of 32)
    assert sorted(n for n, *_ in built) == ([32, 128] if d == 128 else [])
    for n in (32, 128) if d == 128 else ():
        # the launches ask by their tensors' device (cuda:0): the warm-up's table, nothing built anew
        table = rotate.hadamard_table(n, torch.bfloat16, torch.empty(0, device=dev).device)
        assert rotate._HADAMARD == built and any(t is table for t in built.values())
        assert torch.equal(table.float().abs(), torch.ones(n, n, device=dev))
