"""The Triton GDN decode kernels vs the torch reference (under TRITON_INTERPRET=1 on CPU, tiny shapes):
slot indices in any order, the null slot skipped, fresh requests starting from zero, several batch sizes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before the kernels are decorated
    os.environ["TRITON_INTERPRET"] = "1"

from tqserve.ops.gdn import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(bsz: int, hk: int, dk: int, hv: int, dv: int, k: int, num_slots: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    mk = lambda *s: torch.randn(*s, generator=gen)
    # The in_proj output as the layer sees it: qkv, then z, b, a in one row (strided views).
    proj = mk(bsz, conv_dim + 3 * hv)
    mixed, b, a = (
        proj[:, :conv_dim],
        proj[:, conv_dim : conv_dim + hv],
        proj[:, conv_dim + hv : conv_dim + 2 * hv],
    )
    weight = mk(conv_dim, k) * 0.5
    A_log = torch.empty(hv).uniform_(0.1, 2.0, generator=gen).log()
    dt_bias = 1.0 + 0.2 * mk(hv)
    conv_pool, ssm_pool = mk(num_slots, conv_dim, k), mk(num_slots, hv, dk, dv) * 0.3
    perm = torch.randperm(num_slots - 1, generator=gen)[:bsz] + 1
    slots = perm.to(torch.int32)
    slots[bsz // 3] = 0  # a padded row
    seq_lens = torch.randint(2, 50, (bsz,), generator=gen, dtype=torch.int32)
    seq_lens[-1] = 1  # a request with no context: starts from zero
    return (
        proj,
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
    )


@pytest.mark.parametrize(
    "bsz,hk,dk,hv,dv,k",
    [
        (1, 1, 8, 1, 8, 4),
        (2, 1, 8, 1, 8, 4),
        (3, 2, 8, 4, 16, 4),
        (7, 2, 16, 6, 8, 3),
        (12, 1, 4, 3, 20, 4),
    ],
)
def test_decode_kernel_matches_reference(bsz, hk, dk, hv, dv, k):
    from tqserve.ops.gdn.recurrent_triton import gdn_decode

    case = _case(bsz, hk, dk, hv, dv, k, num_slots=2 * bsz + 3, seed=bsz)
    proj, mixed, a, b, weight, A_log, dt_bias, conv_pool, ssm_pool, slots, seq_lens = case
    exp_conv, exp_ssm = conv_pool.clone(), ssm_pool.clone()
    exp_out = torch.zeros(bsz, hv, dv)
    for i in range(bsz):
        s = int(slots[i])
        if s == 0:
            continue
        fresh = int(seq_lens[i]) == 1
        x, exp_conv[s] = ref.causal_conv1d(mixed[i : i + 1], weight, None, None if fresh else conv_pool[s])
        key = hk * dk
        q, kk, v = (
            x[:, :key].view(1, hk, dk),
            x[:, key : 2 * key].view(1, hk, dk),
            x[:, 2 * key :].view(1, hv, dv),
        )
        g, beta = ref.gdn_gates(a[i : i + 1], b[i : i + 1], A_log, dt_bias)
        o, exp_ssm[s] = ref.recurrent_gated_delta_rule(q, kk, v, g, beta, None if fresh else ssm_pool[s])
        exp_out[i] = o[0]

    dev = [t.to(DEVICE) for t in (proj, weight, A_log, dt_bias, conv_pool, ssm_pool, slots, seq_lens)]
    proj_d, weight_d, A_d, dt_d, conv_d, ssm_d, slots_d, lens_d = dev
    conv_dim = mixed.shape[1]
    out = gdn_decode(
        proj_d[:, :conv_dim], proj_d[:, conv_dim + hv : conv_dim + 2 * hv], proj_d[:, conv_dim : conv_dim + hv],
        weight_d, A_d, dt_d, conv_d, ssm_d, slots_d, lens_d, (hk, dk, hv, dv),
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), exp_out, rtol=1e-4, atol=1e-5)
    # Every slot, touched or not (null slot 0 and unused slots keep their old contents).
    torch.testing.assert_close(conv_d.cpu(), exp_conv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ssm_d.cpu(), exp_ssm, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv_d[0].cpu(), conv_pool[0]) and torch.equal(ssm_d[0].cpu(), ssm_pool[0])
