"""Pure-torch Gated DeltaNet: the ground truth every GDN kernel is tested against.

Math (per value head, state S of shape [dk, dv], float32):
    S <- S * exp(g_t)                     g_t <= 0 is a log-space decay
    delta_t = beta_t * (v_t - k_t^T S)    the delta rule: write only what S does not yet predict
    S <- S + k_t delta_t^T
    o_t = q_t^T S
with q and k L2-normalised (eps 1e-6) and q scaled by dk^-0.5. Value head h reads key head
h // (Hv // Hk) (grouped value attention).

Functions here work on ONE sequence ([T, heads, dim], no batch dim); the varlen driver at the bottom
loops over the requests of a step with the host lists of the metadata. This is the CPU path and the
reference, not a fast path: the loop is allowed here (host lists only, never a device read-back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the form fla and transformers use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the raw projections: g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_l2norm: bool):
    """fp32, L2-normalised, q scaled, and key heads repeated so that value head h sees key head h // r."""
    r = num_v_heads // q.shape[1]
    q, k = q.float(), k.float()
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if r > 1:
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    return q, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    use_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv];
    state: [Hv, dk, dv] fp32 or None (zero). Returns (o [T, Hv, dv] fp32, final state fp32)."""
    num_v_heads, dv = v.shape[1], v.shape[2]
    q, k = _prepare_qk(q, k, num_v_heads, use_l2norm)
    v, g, beta = v.float(), g.float(), beta.float()
    s = torch.zeros(num_v_heads, q.shape[-1], dv, dtype=torch.float32, device=v.device) if state is None else state
    s = s.float().clone()
    out = torch.empty(v.shape[0], num_v_heads, dv, dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        delta = beta[t][:, None] * (v[t] - pred)
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    use_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `recurrent_gated_delta_rule`, computed chunk by chunk.

    Inside a chunk with state S0 at its start and cumulative log-decay G_t = sum_{s<=t} g_s, the
    corrections u_t (= delta_t) solve a unit lower-triangular system:
        (I + A) U = beta*V - (beta*exp(G)*K) S0,   A[t,s] = beta_t exp(G_t-G_s) k_t.k_s  (s < t)
    then  O = (exp(G)*Q) S0 + (exp(G_t-G_s) [s<=t] * Q K^T) U
    and   S_end = exp(G_last) S0 + (exp(G_last-G) * K)^T U.
    """
    num_v_heads, dv = v.shape[1], v.shape[2]
    length = v.shape[0]
    q, k = _prepare_qk(q, k, num_v_heads, use_l2norm)
    # Heads first: [H, T, d].
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    dk = q.shape[-1]
    s = torch.zeros(num_v_heads, dk, dv, dtype=torch.float32, device=v.device) if state is None else state
    s = s.float().clone()
    out = torch.empty(num_v_heads, length, dv, dtype=torch.float32, device=v.device)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        n = end - start
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end, None]
        cum = g[:, start:end].cumsum(-1)  # [H, n]
        diff = cum[:, :, None] - cum[:, None, :]  # G_t - G_s
        incl = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        # Mask before exp: entries above the diagonal would be exp(positive) and could overflow.
        decay = torch.where(incl, diff, torch.full_like(diff, float("-inf"))).exp()
        strict = decay * (~torch.eye(n, dtype=torch.bool, device=v.device))
        a_mat = (bc * kc) @ kc.transpose(-1, -2) * strict
        eye = torch.eye(n, dtype=torch.float32, device=v.device).expand_as(a_mat)
        lhs = eye + a_mat
        rhs_v = torch.linalg.solve_triangular(lhs, bc * vc, upper=False, unitriangular=True)
        rhs_k = torch.linalg.solve_triangular(lhs, bc * cum.exp()[..., None] * kc, upper=False, unitriangular=True)
        u = rhs_v - rhs_k @ s
        out[:, start:end] = (cum.exp()[..., None] * qc) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[:, -1:]
        s = last.exp()[..., None] * s + ((last - cum).exp()[..., None] * kc).transpose(-1, -2) @ u
    return out.transpose(0, 1), s


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time with left context. x: [T, D]; weight: [D, K]; state: [D, K]
    (the K previous inputs, most recent last) or None (zeros). Returns (y [T, D] in x's dtype,
    new state [D, K] fp32 = the last K inputs of state ++ x)."""
    d, width = weight.shape
    prev = torch.zeros(d, width, dtype=torch.float32, device=x.device) if state is None else state.float()
    seq = torch.cat([prev, x.float().transpose(0, 1)], dim=1)  # [D, K + T]
    # Output t sees inputs t-K+1..t, i.e. columns t+1..t+K of `seq` (column 0 is never needed).
    windows = seq[:, 1:].unfold(1, width, 1)  # [D, T, K]
    y = (windows * weight.float()[:, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.float()[:, None]
    if activation:
        y = F.silu(y)
    return y.transpose(0, 1).to(x.dtype), seq[:, -width:].clone()


def gdn_varlen_reference(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    dims: tuple[int, int, int, int],
    query_start_loc: list[int],
    seq_lens: list[int],
    seq_slots: list[int],
    chunked: bool = True,
) -> torch.Tensor:
    """Conv + gated delta rule for every request of a step, reading and writing pool slots in place.

    mixed_qkv: [T, conv_dim] (q heads, k heads, v heads); a, b: [T, Hv]; dims = (Hk, dk, Hv, dv).
    Request i owns rows query_start_loc[i]:[i+1]; it starts from zero state when it has no context
    (seq_lens[i] == its query length), else from slot seq_slots[i]. Slot 0 (null) is skipped.
    Returns the core output [T, Hv, dv] fp32 (zeros for rows of skipped requests and padding)."""
    hk, dk, hv, dv = dims
    key_dim = hk * dk
    out = torch.zeros(mixed_qkv.shape[0], hv, dv, dtype=torch.float32, device=mixed_qkv.device)
    for i, slot in enumerate(seq_slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if slot == 0 or end == start:
            continue
        fresh = seq_lens[i] == end - start
        conv_state = None if fresh else conv_pool[slot]
        ssm_state = None if fresh else ssm_pool[slot]
        x, conv_pool[slot] = causal_conv1d(mixed_qkv[start:end], conv_weight, conv_bias, conv_state)
        q = x[:, :key_dim].reshape(-1, hk, dk)
        k = x[:, key_dim : 2 * key_dim].reshape(-1, hk, dk)
        v = x[:, 2 * key_dim :].reshape(-1, hv, dv)
        g, beta = gdn_gates(a[start:end], b[start:end], A_log, dt_bias)
        rule = chunk_gated_delta_rule if chunked else recurrent_gated_delta_rule
        out[start:end], ssm_pool[slot] = rule(q, k, v, g, beta, ssm_state)
    return out
