"""Scheduler and KV-cache manager without a model: budgets, chunking, preemption, no leaks."""

import random

import pytest

from tqserve.core.kv_cache_manager import CacheLayout, KVCacheManager
from tqserve.core.outputs import RunnerOutput
from tqserve.core.scheduler import Scheduler, SchedulerConfig
from tqserve.request import Request, RequestStatus
from tqserve.sampling_params import SamplingParams


def make(num_blocks=64, bs=4, max_seqs=8, budget=32, prefix=True, chunked=True, **layout):
    kv = KVCacheManager(CacheLayout(num_blocks, bs, max_seqs, enable_prefix_caching=prefix, **layout))
    return Scheduler(SchedulerConfig(max_seqs, budget, 1024, chunked), kv)


def req(rid, n, max_tokens=5, base=0):
    return Request(str(rid), [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens), max_tokens)


def run_to_completion(sched, max_steps=10_000, token=1):
    steps = 0
    seen_tokens = {}
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        assert len({s.request_id for s in out.requests}) == len(out.requests)
        result = RunnerOutput(sampled={s.request_id: token for s in out.requests if s.sample})
        for s in out.requests:
            seen_tokens.setdefault(s.request_id, []).append((s.start_pos, len(s.token_ids)))
        sched.update(out, result)
        steps += 1
        assert steps < max_steps
    return seen_tokens


def test_budget_chunking_and_no_leak():
    s = make(budget=16)
    for i in range(6):
        s.add_request(req(i, 37, base=1000 * i))
    run_to_completion(s)
    kv = s.kv
    # Cached pages stay findable but are free (evictable): nothing is held once all finished.
    assert kv.pool.num_free == kv.pool.num_blocks - 1
    assert all(c == 0 for c in kv.pool.ref_cnt)
    assert len(kv.free_seq_slots) == 8


def test_chunks_are_contiguous_and_cover_prompt():
    s = make(budget=7)
    s.add_request(req(0, 30, max_tokens=3))
    spans = run_to_completion(s)["0"]
    pos = 0
    for start, n in spans:
        assert start == pos
        pos += n
    assert pos == 30 + 3 - 1  # the last sampled token is never fed back


def test_preemption_when_pages_run_out_loses_nothing():
    s = make(num_blocks=12, bs=4, budget=64, prefix=False)
    reqs = [req(i, 10, max_tokens=12, base=100 * i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    run_to_completion(s)
    assert s.num_preemptions > 0
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert len(r.output_token_ids) == 12
    assert all(c == 0 for c in s.kv.pool.ref_cnt)


def test_abort_frees_pages():
    s = make()
    s.add_request(req(0, 20))
    s.add_request(req(1, 20))
    out = s.schedule()
    s.update(out, RunnerOutput())
    s.finish_request("0", RequestStatus.FINISHED_ABORTED)
    s.finish_request("1", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished()
    assert all(c == 0 for c in s.kv.pool.ref_cnt)


def test_prefix_hit_skips_cached_blocks():
    s = make(bs=4, budget=64)
    s.add_request(req("a", 18))
    run_to_completion(s)
    b = req("b", 18)
    s.add_request(b)
    out = s.schedule()
    (sr,) = out.requests
    assert sr.start_pos == 16  # four full blocks of 4 reused
    assert b.num_cached_tokens == 16


def test_window_preset_recomputes_window_and_skips_page_writes():
    s = make(bs=4, budget=64, window=8, sink=2)
    s.add_request(req("a", 30))
    run_to_completion(s)
    b = req("b", 30)
    s.add_request(b)
    (sr,) = s.schedule().requests
    assert b.num_cached_tokens == 28 - 8  # the window is recomputed
    assert sr.start_pos == 28 - 8 and sr.num_page_tokens_cached == 28
    assert sr.sink_slot != 0


def test_random_workload_invariants():
    rng = random.Random(0)
    s = make(num_blocks=40, bs=4, max_seqs=5, budget=24)
    live = []
    for i in range(60):
        r = req(i, rng.randint(1, 40), max_tokens=rng.randint(1, 8), base=rng.choice([0, 500]))
        s.add_request(r)
        live.append(r)
        for _ in range(rng.randint(0, 3)):
            out = s.schedule()
            s.update(out, RunnerOutput(sampled={x.request_id: 7 for x in out.requests if x.sample}))
        if rng.random() < 0.1 and s.running:
            s.finish_request(s.running[0].request_id, RequestStatus.FINISHED_ABORTED)
    run_to_completion(s, token=7)
    assert all(c == 0 for c in s.kv.pool.ref_cnt)
    for r in live:
        assert r.status.finished
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.max_tokens


def test_duplicate_request_id_rejected():
    s = make()
    s.add_request(req(0, 4))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req(0, 4))


def test_sink_slots_are_returned_without_prefix_caching():
    """Every request of a sink preset takes a sink slot with its first page; with prefix caching
    off (pages never cached) the slot must come back when the request ends."""
    s = make(bs=4, budget=64, max_seqs=2, prefix=False, sink=2)
    for i in range(20):  # far more requests than the 2 * max_num_seqs + 1 sink slots
        s.add_request(req(i, 9, max_tokens=2, base=50 * i))
    run_to_completion(s)
    assert len(s.kv.free_sink_slots) == 2 * 2 + 1
    assert not s.kv.sink_of_page


def test_sink_slots_follow_cached_first_pages():
    s = make(num_blocks=16, bs=4, budget=64, max_seqs=2, sink=2, window=4)
    for i in range(12):
        s.add_request(req(i, 13, max_tokens=2, base=50 * i))
    run_to_completion(s)
    kv = s.kv
    # Sinks are kept only for first pages still findable in the prefix cache.
    assert set(kv.sink_of_page) <= set(kv.pool.cached.values())
    assert len(kv.free_sink_slots) + len(kv.sink_of_page) == 2 * 2 + 1


def test_token_slice_equals_all_token_ids_slice():
    r = req("s", 7)
    r.output_token_ids.extend([101, 102, 103, 104])
    every = r.all_token_ids
    for start in range(len(every) + 1):
        for end in range(start, len(every) + 1):
            assert r.token_slice(start, end) == every[start:end], (start, end)
