"""The batched CPU decode path equals the per-request reference on mixed decode / verify batches."""

from __future__ import annotations

import pytest
import torch

from tqserve.attention.reference import KVCacheStore, ReferenceBackend
from tqserve.attention.torch_paged import TorchPagedBackend
from tqserve.core.outputs import ScheduledRequest, SchedulerOutput
from tqserve.engine.input_batch import InputBatchBuilder
from tqserve.kvquant.base import ExactFormat

MIXED = [(9, 1), (1, 1), (23, 3), (16, 1), (5, 5)]  # (seq_len, query_len): decode and verify
UNIFORM = [(13, 1)] * 4  # same-length decodes: the unmasked path


@pytest.mark.parametrize("lens", [MIXED, UNIFORM, [(7, 1)]], ids=["mixed", "uniform", "single"])
@pytest.mark.parametrize("preset", ["auto", "bfloat16"])
def test_batched_decode_matches_reference(preset, lens):
    """Exact pages (model dtype, or bfloat16 storage under a float32 model) take the batched path;
    quantized presets always go through the reference (see torch_paged.py)."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 6, 2, 16, 4
    storage = torch.float32 if preset == "auto" else torch.bfloat16
    fmt = [ExactFormat(hkv, d, torch.float32, 0, storage_dtype=storage)]
    store = KVCacheStore(fmt, 64, bs, 8, 8, torch.device("cpu"))
    pages = store.pages[0]
    # Fill every page through the format's own writer, from random K/V.
    slots = torch.arange(64 * bs)
    fmt[0].write(pages, torch.randn(64 * bs, hkv, d), torch.randn(64 * bs, hkv, d), slots)
    reqs, nxt = [], 1
    for i, (sl, ql) in enumerate(lens):
        nb = -(-sl // bs)
        table = list(range(nxt, nxt + nb))
        nxt += nb
        reqs.append(ScheduledRequest(str(i), [0] * ql, sl - ql, table, i + 1, 0, 0, True))
    sched = SchedulerOutput(requests=reqs, num_tokens=sum(q for _, q in lens))
    builder = InputBatchBuilder(64, 8, 16, bs, torch.device("cpu"))
    t = sched.num_tokens
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    ref = ReferenceBackend(store).forward(0, q, k, v, builder.build(sched).meta, 0.25)
    got = TorchPagedBackend(store).forward(0, q, k, v, builder.build(sched).meta, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
