"""fla-core (flash-linear-attention 0.6) wrappers for GDN prefill / mixed steps on CUDA.

fla is imported lazily: CPU CI has neither fla nor a GPU, and `import fla` probes the driver.

fla memoises `prepare_chunk_indices` / `prepare_chunk_offsets` by tensor identity, so a persistent
cu_seqlens buffer reused with new contents would get stale indices. We therefore pass chunk indices
built on the host from `query_start_loc_cpu`, and hand fla a fresh cu_seqlens tensor every step.
"""

from __future__ import annotations

import torch

from tqserve.attention.backend import AttentionMetadata

CHUNK = 64  # fla's chunk size for both causal_conv1d and chunk_gated_delta_rule


def chunk_indices_host(query_start_loc_cpu: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """[num_chunks, 2] int64 (request index, chunk index within the request) on the host.

    Host-side metadata: this belongs to the input-batch builder (it may precompute it into
    `meta.extra["gdn_chunk_indices"]`); models call it only when the builder did not."""
    pairs = []
    for i in range(len(query_start_loc_cpu) - 1):
        n = query_start_loc_cpu[i + 1] - query_start_loc_cpu[i]
        pairs += [(i, j) for j in range((n + chunk - 1) // chunk)]
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


def step_chunk_metadata(meta: AttentionMetadata, device: torch.device) -> dict:
    n = meta.num_reqs
    idx = meta.extra.get("gdn_chunk_indices")
    if idx is None:
        host = chunk_indices_host(meta.query_start_loc_cpu[: n + 1])
        idx = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    # A fresh tensor each step (copy=True even if already int64): see the module docstring.
    cu = meta.query_start_loc[: n + 1].to(torch.int64, copy=True)
    return {"cu_seqlens": cu, "chunk_indices": idx}


def gdn_prefill_fla(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    info,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """Varlen conv + chunked delta rule over every request of the step; states gathered from and
    scattered back to the pool slots (zero initial state where a request has no context).
    Returns the core output [T, Hv, dv] (zeros past the real tokens)."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    hk, dk, hv, dv = dims
    key_dim = hk * dk
    t_real = info.num_real_tokens
    fla_meta, slots, has = info.fla, info.slots, info.has_context
    x = mixed_qkv[:t_real].unsqueeze(0)
    conv0 = torch.where(has[:, None, None], conv_pool.index_select(0, slots), 0.0).to(x.dtype)
    y, conv_final = causal_conv1d(
        x, weight=conv_weight, bias=None, initial_state=conv0, output_final_state=True, activation="silu",
        cu_seqlens=fla_meta["cu_seqlens"], chunk_indices=fla_meta["chunk_indices"],
    )  # fmt: skip
    conv_pool.index_copy_(0, slots, conv_final.float())
    y = y[0]
    q = y[:, :key_dim].reshape(1, t_real, hk, dk)
    k = y[:, key_dim : 2 * key_dim].reshape(1, t_real, hk, dk)
    v = y[:, 2 * key_dim :].reshape(1, t_real, hv, dv)
    g = -A_log.float().exp() * torch.nn.functional.softplus(a[:t_real].float() + dt_bias.float())
    beta = b[:t_real].sigmoid()
    ssm0 = torch.where(has[:, None, None, None], ssm_pool.index_select(0, slots), 0.0)
    o, ssm_final = chunk_gated_delta_rule(
        q, k, v, g.unsqueeze(0), beta.unsqueeze(0), scale=dk**-0.5, initial_state=ssm0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=fla_meta["cu_seqlens"], chunk_indices=fla_meta["chunk_indices"],
    )  # fmt: skip
    ssm_pool.index_copy_(0, slots, ssm_final.float())
    out = torch.zeros(mixed_qkv.shape[0], hv, dv, dtype=o.dtype, device=o.device)
    out[:t_real] = o[0]
    return out
