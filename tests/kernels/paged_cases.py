"""Random paged-attention batches shared by the kernel tests and the benchmark (host-side builder)."""

from __future__ import annotations

import random

import torch

from tqserve.attention.backend import AttentionMetadata


def make_meta(
    ctx_lens: list[int],
    q_lens: list[int],
    block_size: int,
    num_blocks: int,
    device: torch.device | str,
    seed: int = 0,
    pad_tokens: int = 0,
    reserve: list[int] | None = None,
) -> AttentionMetadata:
    """A batch where request i already holds ctx_lens[i] tokens and adds q_lens[i] this step.

    Pages are drawn at random from 1..num_blocks-1 (page 0 is the null page) and never shared;
    seq slots are 1..n and sink slots 1..n (0 = null). `reserve`: tokens to hold pages for per
    request (at least its length), so that steps of a growing request draw the same pages."""
    rng = random.Random(seed)
    n = len(ctx_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    held = seq_lens if reserve is None else [max(s, r) for s, r in zip(seq_lens, reserve)]
    blocks_per = [(s + block_size - 1) // block_size for s in held]
    max_blocks = max(blocks_per)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    if sum(blocks_per) > len(free):
        raise ValueError("not enough pages")
    tables, slot_map, positions, qsl = [], [], [], [0]
    for i in range(n):
        pages = [free.pop() for _ in range(blocks_per[i])]
        tables.append(pages + [0] * (max_blocks - len(pages)))
        for p in range(ctx_lens[i], seq_lens[i]):
            slot_map.append(pages[p // block_size] * block_size + p % block_size)
            positions.append(p)
        qsl.append(qsl[-1] + q_lens[i])
    num_tokens = qsl[-1]
    slot_map += [-1] * pad_tokens
    positions += [0] * pad_tokens
    dev = torch.device(device)

    def t(x, dt):
        return torch.tensor(x, dtype=dt, device=dev)

    return AttentionMetadata(
        num_reqs=n,
        num_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t(tables, torch.int32),
        slot_mapping=t(slot_map, torch.int64),
        positions=t(positions, torch.int64),
        seq_slots=t(list(range(1, n + 1)), torch.int32),
        sink_slots=t(list(range(1, n + 1)), torch.int32),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        seq_slots_cpu=list(range(1, n + 1)),
        sink_slots_cpu=list(range(1, n + 1)),
        block_tables_cpu=tables,
        slot_mapping_cpu=slot_map,
    )


def fill_context(store, layer: int, meta: AttentionMetadata, ctx_lens: list[int], gen: torch.Generator) -> None:
    """Write random K/V for every request's already-cached positions (pages through the format's
    torch `write`, exact copies into the ring / sinks as the previous steps would have left them)."""
    fmt = store.formats[layer]
    pages = store.pages[layer]
    bs = store.block_size
    dev = pages[next(iter(pages))].device
    hkv, d = fmt.num_kv_heads, fmt.head_dim
    for i, c in enumerate(ctx_lens):
        if c == 0:
            continue
        k = torch.randn(c, hkv, d, generator=gen).to(dev, fmt.model_dtype)
        v = torch.randn(c, hkv, d, generator=gen).to(dev, fmt.model_dtype)
        pos = torch.arange(c)
        table = meta.block_tables_cpu[i]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)], device=dev)
        fmt.write(pages, k, v, slots)
        if fmt.window:
            rk, rv = store.ring[layer]
            keep = pos[max(0, c - fmt.window) :]
            rk[meta.seq_slots_cpu[i], :, keep % fmt.window] = k[keep].transpose(0, 1).to(rk.dtype)
            rv[meta.seq_slots_cpu[i], :, keep % fmt.window] = v[keep].transpose(0, 1).to(rv.dtype)
        if fmt.sink:
            sk, sv = store.sinks[layer]
            n = min(fmt.sink, c)
            sk[meta.sink_slots_cpu[i], :, :n] = k[:n].transpose(0, 1).to(sk.dtype)
            sv[meta.sink_slots_cpu[i], :, :n] = v[:n].transpose(0, 1).to(sv.dtype)


def backend_step_errors(
    preset: str,
    hq: int,
    hkv: int,
    d: int,
    steps: list[tuple[list[int], list[int]]],
    gen_seed: int,
    meta_seed: int,
    device: torch.device,
    nblocks: int | None = None,
    bs: int = 16,
) -> list[float]:
    """Store kernel + paged attention + exact-copy refresh through the Triton backend vs the
    reference backend, step after step (`steps`: (context lengths, query lengths) per step, e.g. a
    prefill then a decode / verify): the attention kernel reads what the store kernel wrote. Returns
    each step's relative L2 error. Every step holds the pages of the last step's lengths (`make_meta`
    draws the same pages for the same counts, so a request keeps its pages as it grows)."""
    from tqserve.attention.reference import KVCacheStore, ReferenceBackend
    from tqserve.attention.triton_backend import TritonAttentionBackend
    from tqserve.kvquant.presets import make_layer_format

    if nblocks is None:
        nblocks = sum((c + q + bs - 1) // bs for c, q in zip(*steps[-1])) + 4
    gen = torch.Generator().manual_seed(gen_seed)
    fmt = make_layer_format(preset, 0, hkv, d, torch.bfloat16)
    nseq = len(steps[0][0]) + 1  # seq / sink slots 1..n (0 is the null slot)
    ref_be = ReferenceBackend(KVCacheStore([fmt], nblocks, bs, nseq, nseq, device))
    tri_be = TritonAttentionBackend(KVCacheStore([fmt], nblocks, bs, nseq, nseq, device))
    errs = []
    final = [c + q for c, q in zip(*steps[-1])]
    for ctx, ql in steps:
        meta = make_meta(ctx, ql, bs, nblocks, device, seed=meta_seed, reserve=final)
        t = meta.num_tokens
        q, k, v = (torch.randn(t, h, d, generator=gen).to(device, torch.bfloat16) for h in (hq, hkv, hkv))
        ref = ref_be.forward(0, q, k, v, meta, d**-0.5)
        out = tri_be.forward(0, q, k, v, meta, d**-0.5)
        assert not out.isnan().any()
        errs.append(float((out.float() - ref.float()).norm() / ref.float().norm()))
    return errs
