"""GPU paths of Gated DeltaNet vs the torch reference at Qwen3-Next-like sizes: fla-core prefill with
slots gathered / scattered (mixed fresh and continuing requests), the Triton decode kernel for batch
1..256 with null slots, and a tiny hybrid model on CUDA (fla prefill + Triton decode) vs its CPU path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tqserve.ops.gdn import reference as ref

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")

HK, DK, HV, DV, K = 16, 128, 32, 128, 4  # Qwen3-Next-80B per-layer GDN dims
CONV_DIM = 2 * HK * DK + HV * DV


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _inputs(t: int, num_slots: int, dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    proj = torch.randn(t, CONV_DIM + 3 * HV, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(CONV_DIM, K, device="cuda", generator=gen) * 0.5).to(dtype)
    A_log = torch.empty(HV, device="cuda").uniform_(0.1, 2.0, generator=gen).log()
    dt_bias = 1.0 + 0.2 * torch.randn(HV, device="cuda", generator=gen)
    conv_pool = torch.randn(num_slots, CONV_DIM, K, device="cuda", generator=gen).to(dtype).float()
    ssm_pool = torch.randn(num_slots, HV, DK, DV, device="cuda", generator=gen) * 0.1
    return proj, weight, A_log, dt_bias, conv_pool, ssm_pool


def _split(proj):
    return (
        proj[:, :CONV_DIM],
        proj[:, CONV_DIM : CONV_DIM + HV],
        proj[:, CONV_DIM + HV : CONV_DIM + 2 * HV],
    )


@needs_cuda
@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_prefill_matches_reference(dtype):
    import hybrid_factory as hf

    from tqserve.layers.gated_delta_net import GdnStepInfo
    from tqserve.ops.gdn.fla_ops import gdn_prefill_fla

    lens, ctx = [1, 37, 200, 64, 5, 130], [0, 12, 0, 64, 3, 1]
    slots = [3, 7, 1, 9, 2, 5]
    meta = hf.build_meta(list(zip(slots, ctx, lens)), "cuda")
    proj, weight, A_log, dt_bias, conv_pool, ssm_pool = _inputs(sum(lens), 12, dtype, 0)
    mixed, b, a = _split(proj)
    exp_conv, exp_ssm = conv_pool.clone(), ssm_pool.clone()
    exp = ref.gdn_varlen_reference(
        mixed.float(), a.float(), b.float(), weight.float(), None, A_log, dt_bias, exp_conv, exp_ssm,
        (HK, DK, HV, DV), meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.seq_slots_cpu,
    )  # fmt: skip
    info = GdnStepInfo.build(meta, torch.device("cuda"))
    got = gdn_prefill_fla(mixed, a, b, weight, A_log, dt_bias, conv_pool, ssm_pool, info, (HK, DK, HV, DV))
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel(got, exp) < tol
    assert _rel(ssm_pool, exp_ssm) < tol
    assert _rel(conv_pool, exp_conv) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@needs_cuda
@pytest.mark.parametrize("bsz", [1, 2, 7, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_matches_reference(bsz, dtype):
    from tqserve.ops.gdn.recurrent_triton import gdn_decode

    num_slots = bsz + 5
    proj, weight, A_log, dt_bias, conv_pool, ssm_pool = _inputs(bsz, num_slots, dtype, bsz)
    mixed, b, a = _split(proj)
    slots = (torch.randperm(num_slots - 1, device="cuda")[:bsz] + 1).to(torch.int32)
    slots[::5] = 0  # padded rows
    seq_lens = torch.randint(1, 100, (bsz,), device="cuda", dtype=torch.int32)
    exp_conv, exp_ssm = conv_pool.clone(), ssm_pool.clone()
    exp = torch.zeros(bsz, HV, DV, device="cuda")
    for i, (s, n) in enumerate(zip(slots.tolist(), seq_lens.tolist())):
        if s == 0:
            continue
        fresh = n == 1
        x, exp_conv[s] = ref.causal_conv1d(
            mixed[i : i + 1].float(),
            weight.float(),
            None,
            None if fresh else conv_pool[s],
        )
        x = x.to(dtype).float()
        q = x[:, : HK * DK].view(1, HK, DK)
        k = x[:, HK * DK : 2 * HK * DK].view(1, HK, DK)
        v = x[:, 2 * HK * DK :].view(1, HV, DV)
        g, beta = ref.gdn_gates(a[i : i + 1], b[i : i + 1], A_log, dt_bias)
        o, exp_ssm[s] = ref.recurrent_gated_delta_rule(q, k, v, g, beta, None if fresh else ssm_pool[s])
        exp[i] = o[0]
    before_null = (conv_pool[0].clone(), ssm_pool[0].clone())
    got = gdn_decode(
        mixed,
        a,
        b,
        weight,
        A_log,
        dt_bias,
        conv_pool,
        ssm_pool,
        slots,
        seq_lens,
        (HK, DK, HV, DV),
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert _rel(got, exp) < tol and _rel(ssm_pool, exp_ssm) < tol and _rel(conv_pool, exp_conv) < tol
    assert torch.equal(conv_pool[0], before_null[0]) and torch.equal(ssm_pool[0], before_null[1])
    assert float(got[slots == 0].abs().max() if (slots == 0).any() else 0.0) == 0.0


@needs_cuda
@needs_fla
def test_tiny_model_cuda_paths_match_cpu(tmp_path):
    import hybrid_factory as hf

    m = hf.make_hf_model("qwen3_next", linear_key_head_dim=16)  # tl.dot in fla needs dims >= 16
    path = hf.write_checkpoint(m, str(tmp_path / "next"))
    cpu, gpu = hf.load_tqserve_model(path), hf.load_tqserve_model(path, device="cuda")
    prompts = [list(range(5, 5 + n)) for n in (3, 70, 21, 9)]
    got_cpu = hf.Driver(cpu).generate(prompts, max_new=16, chunk=16)
    got_gpu = hf.Driver(gpu).generate(prompts, max_new=16, chunk=16)
    assert got_cpu == got_gpu
