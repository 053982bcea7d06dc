"""Programmatic dependent launch along the decode chain (attention/pdl.py): off where it cannot run, and
on the GPU bit-identical outputs with and without it, eager and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tqserve.attention import pdl


def test_pdl_off_without_a_capable_gpu(monkeypatch):
    assert pdl.enabled(torch.device("cpu")) is False
    assert pdl.launch_options(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no PTX
    assert pdl.enabled(torch.device("cuda", 0)) is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "PDL", 0)
    assert pdl.enabled(torch.device("cuda", 0)) is False


def _graph_replay(fn, out: torch.Tensor) -> torch.Tensor:
    """fn captured once, then replayed into an `out` poisoned with NaN."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("preset", "n_req", "ctx", "qlen"), [
    ("turboquant_4bit_nc", 1, 40000, 1),  # one request: hundreds of splits, combine + finish
    ("turboquant_4bit_nc", 7, 3001, 5),  # verify
    ("tq3", 5, 5000, 1),  # exact sink / window part, rotated values
    ("tq3", 3, 20000, 5),
])  # fmt: skip
def test_pdl_chain_bit_identical(preset, n_req, ctx, qlen, monkeypatch):
    from tqserve.bench.kernels import Case

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    torch.manual_seed(0)
    case = Case(preset, n_req, ctx, qlen, 32, 8, 128, torch.device("cuda"))
    outs = {}
    for on in (0, 1):
        monkeypatch.setattr(pdl, "PDL", on)
        case.out.fill_(float("nan"))
        case.run()
        torch.cuda.synchronize()
        outs[on, "eager"] = case.out.clone()
        outs[on, "graph"] = _graph_replay(case.run, case.out)
    ref = outs[0, "eager"]
    assert torch.isfinite(ref).all()
    for key, out in outs.items():
        assert torch.equal(out, ref), key
