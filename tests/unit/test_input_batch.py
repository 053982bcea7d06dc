"""InputBatchBuilder's block-table rows: written only where a request's page list changed, yet always
equal to every scheduled request's pages (growth, reordering, new lists after preemption, padding)."""

from __future__ import annotations

import random

import torch

from tqserve.core.outputs import ScheduledRequest, SchedulerOutput
from tqserve.engine.input_batch import InputBatchBuilder


def _decode(rid: str, table: list[int], pos: int) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], pos, table, 0, 0, 0, True)


def _check(builder: InputBatchBuilder, sched: SchedulerOutput, pad_to: int = 0) -> None:
    meta = builder.build(sched, pad_to=pad_to).meta
    bt = meta.block_tables
    for i, s in enumerate(sched.requests):
        assert bt[i, : len(s.block_table)].tolist() == s.block_table, f"row {i} ({s.request_id})"
    for i in range(len(sched.requests), pad_to):
        assert not bt[i].any(), f"padding row {i} must read the null page only"


def test_block_table_rows_follow_the_page_lists():
    bs, rng = 4, random.Random(0)
    builder = InputBatchBuilder(64, 8, 32, bs, torch.device("cpu"))
    tables = {f"r{i}": [10 * i + j + 1 for j in range(3)] for i in range(6)}
    pos = {rid: 3 * bs - 1 for rid in tables}
    next_page = 1000
    for step in range(40):
        order = sorted(tables)
        if step % 7 == 3:
            rng.shuffle(order)  # requests change rows (another request finished or was preempted)
        if step % 11 == 5:
            victim = order[0]  # preempted and resumed: a new list, same length, other pages
            tables[victim] = [next_page + j for j in range(len(tables[victim]))]
            next_page += 100
        for rid in order:
            pos[rid] += 1
            if pos[rid] // bs >= len(tables[rid]):
                tables[rid].append(next_page)  # grows in place, as allocate_slots extends it
                next_page += 1
        reqs = [_decode(rid, tables[rid], pos[rid]) for rid in order[: 4 + step % 3]]
        _check(builder, SchedulerOutput(requests=reqs, num_tokens=len(reqs)), pad_to=8 if step % 5 == 0 else 0)


def test_a_shorter_list_in_the_same_row_is_rewritten():
    builder = InputBatchBuilder(16, 2, 8, 4, torch.device("cpu"))
    table = [5, 6, 7]
    _check(builder, SchedulerOutput(requests=[_decode("a", table, 9)], num_tokens=1))
    del table[1:]  # not something the cache manager does, but the rows must not trust the length
    table.append(9)
    _check(builder, SchedulerOutput(requests=[_decode("a", table, 5)], num_tokens=1))
