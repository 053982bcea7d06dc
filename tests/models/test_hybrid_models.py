"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers' own implementation (its torch
path: fla must not be installed), driven without the engine by the test-only driver of hybrid_factory."""

from __future__ import annotations

import hybrid_factory as hf
import pytest
import torch

VARIANTS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, tmp_path_factory):
    hf_model = hf.make_hf_model(request.param, seed=VARIANTS.index(request.param))
    path = hf.write_checkpoint(hf_model, str(tmp_path_factory.mktemp(request.param)))
    return request.param, hf_model, hf.load_tqserve_model(path)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, hf.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def test_fla_absent():
    # The reference must be transformers' torch path: with fla present it silently swaps in kernels.
    import importlib.util

    assert importlib.util.find_spec("fla") is None


def test_prefill_logits_match_transformers(pair):
    _, hf_model, ours = pair
    ids = _prompt(80, 1)  # crosses a 64-token chunk boundary of the chunked delta rule
    ref = _hf_logits(hf_model, ids)
    got = hf.Driver(ours).step([(1, ids, 0)])
    assert _rel_err(got, ref) <= 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_chunked_batched_steps_match_transformers(pair):
    """Two requests in the same steps, chunks of uneven sizes: states must carry across chunks per slot."""
    _, hf_model, ours = pair
    a, b = _prompt(30, 2), _prompt(19, 3)
    drv = hf.Driver(ours)
    # Dirty the slots first: a request without context must start from zero state, not from the slot.
    for t in drv.pool.conv + drv.pool.ssm:
        t.normal_()
    plan_a, plan_b = [7, 3, 1, 1, 12, 6], [5, 1, 9, 1, 2, 1]
    got_a, got_b, done_a, done_b = [], [], 0, 0
    for na, nb in zip(plan_a, plan_b):
        logits = drv.step([(3, a[done_a : done_a + na], done_a), (5, b[done_b : done_b + nb], done_b)])
        got_a.append(logits[:na])
        got_b.append(logits[na:])
        done_a, done_b = done_a + na, done_b + nb
    for got, ids in ((torch.cat(got_a), a), (torch.cat(got_b), b)):
        ref = _hf_logits(hf_model, ids)
        assert _rel_err(got, ref) <= 1e-4
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_null_slot_is_skipped(pair):
    """A padded request on slot 0 leaves every real slot untouched and does not disturb its neighbours."""
    _, hf_model, ours = pair
    ids = _prompt(9, 4)
    drv = hf.Driver(ours)
    logits = drv.step([(0, _prompt(4, 5), 0), (2, ids, 0)])
    assert _rel_err(logits[4:], _hf_logits(hf_model, ids)) <= 1e-4
    assert all(float(t[1].abs().max()) == 0.0 and float(t[3:].abs().max()) == 0.0 for t in drv.pool.ssm)


def test_greedy_matches_transformers(pair):
    """4 prompts batched, chunked prefill (5 tokens per request per step) then decode, 32 tokens each."""
    _, hf_model, ours = pair
    prompts = [_prompt(n, 10 + n) for n in (3, 17, 40, 9)]
    got = hf.Driver(ours).generate(prompts, max_new=32, chunk=5)
    hf_model.generation_config.eos_token_id = None
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, len(prompt) :]
        assert tokens == ref.tolist()


def test_specs(pair):
    _, hf_model, ours = pair
    cfg = hf_model.config
    n_full = cfg.layer_types.count("full_attention")
    assert ours.kv_layer_specs() == [(cfg.num_key_value_heads, cfg.head_dim)] * n_full
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * 16
    spec = (
        (conv_dim, 4),
        (
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        ),
    )
    assert ours.state_specs() == [spec] * (len(cfg.layer_types) - n_full)
