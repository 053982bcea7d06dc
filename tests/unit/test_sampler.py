"""Sampler: greedy, filters, penalties, min_tokens bans, seeds, logprobs."""

from __future__ import annotations

import torch

from tqserve.engine.input_batch import build_sampling_batch
from tqserve.engine.sampler import Sampler, _filter
from tqserve.request import Request
from tqserve.sampling_params import SamplingParams

V = 32


def req(params, prompt=(1, 2, 3), out=()):
    r = Request("r", list(prompt), params, params.max_tokens or 16, frozenset({0}))
    r.output_token_ids = list(out)
    return r


def sample(logits, reqs, gens=None, seed=0):
    gens = gens or [None] * len(reqs)
    batch, counts = build_sampling_batch(reqs, gens, V, torch.device("cpu"))
    return Sampler(torch.device("cpu"), seed)(logits, batch, counts)


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    res = sample(logits, [req(SamplingParams(temperature=0))] * 3)
    assert res.token_ids == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_even_with_temperature():
    logits = torch.randn(4, V)
    res = sample(logits, [req(SamplingParams(temperature=1.5, top_k=1))] * 4)
    assert res.token_ids == logits.argmax(-1).tolist()


def test_filter_top_p_and_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = _filter(logits, torch.tensor([0]), torch.tensor([0.7]), torch.tensor([0.0])) > float("-inf")
    assert keep.tolist() == [[True, True, False, False]]
    keep = _filter(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.2])) > float("-inf")
    assert keep.tolist() == [[True, True, True, False]]


def test_sampling_distribution_follows_temperature():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (V - 3)]))
    counts = torch.zeros(V)
    s = Sampler(torch.device("cpu"), 0)
    r = req(SamplingParams(temperature=1.0))
    batch, c = build_sampling_batch([r] * 4000, [None] * 4000, V, torch.device("cpu"))
    toks = s(logits.expand(4000, V).contiguous(), batch, c).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=V).float() / 4000
    assert abs(counts[0] - 0.7) < 0.03 and abs(counts[1] - 0.2) < 0.03


def test_seed_reproducible_across_batches():
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=1.0, seed=1234)
    runs = []
    for others in (0, 5):
        g = torch.Generator().manual_seed(1234)
        reqs = [req(p)] + [req(SamplingParams(temperature=1.0))] * others
        gens = [g] + [None] * others
        lg = torch.cat([logits, torch.randn(others, V)])
        runs.append([sample(lg, reqs, gens, seed=others).token_ids[0] for _ in range(1)])
    assert runs[0] == runs[1]


def test_penalties_and_min_tokens_ban():
    logits = torch.zeros(1, V)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    # frequency penalty pushes token 5 (generated twice) under 6
    res = sample(logits, [req(SamplingParams(temperature=0, frequency_penalty=0.2), out=(5, 5))])
    assert res.token_ids == [6]
    # repetition penalty divides positive logits of seen tokens
    res = sample(logits, [req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(5,))])
    assert res.token_ids == [6]
    # min_tokens bans EOS (id 0) while too short
    logits = torch.zeros(1, V)
    logits[0, 0] = 10
    res = sample(logits, [req(SamplingParams(temperature=0, min_tokens=3), out=(1,))])
    assert res.token_ids != [0]


def test_logprobs_of_chosen_and_top():
    logits = torch.randn(2, V)
    res = sample(logits, [req(SamplingParams(temperature=0, logprobs=3))] * 2)
    lp = torch.log_softmax(logits, -1)
    for row in range(2):
        chosen, rank, top = res.logprobs[row]
        assert rank == 1 and abs(chosen - lp[row].max().item()) < 1e-5
        assert [t for t, _ in top] == lp[row].topk(3).indices.tolist()
