"""Codec distortion: random unit vectors against Lloyd-Max theory, and keys / values captured from
the model against each preset (relative MSE and attention-output error per layer)."""

from __future__ import annotations

import torch

from tqserve.kvquant import reference as ref
from tqserve.kvquant.codebooks import expected_sphere_distortion, gaussian_codebook
from tqserve.kvquant.presets import make_layer_format
from tqserve.kvquant.rotation import Rotation


def random_unit_distortion(dims=(64, 128), bits=(1, 2, 3, 4, 5), n: int = 8192, seed: int = 0) -> list[dict]:
    """Per (d, bits, scale mode): E||u - u_hat||^2, mean <u, u_hat>, and the inner-product error with
    an independent random unit query, d * E(<q, u_hat> - <q, u>)^2, next to the theory."""
    rows = []
    g = torch.Generator().manual_seed(seed)
    for d in dims:
        x = torch.randn(n, d, generator=g)
        x = x / x.norm(dim=-1, keepdim=True)
        q = torch.randn(n, d, generator=g)
        q = q / q.norm(dim=-1, keepdim=True)
        rot = Rotation(d, layer_idx=0)
        for b in bits:
            for mode in ref.SCALE_MODES:
                packed, scale = ref.tq_encode(x, rot, b, mode)
                xh = ref.tq_decode(packed, scale, rot, b, d)
                ip_err = ((q * xh).sum(-1) - (q * x).sum(-1)).pow(2).mean().item() * d
                dist = gaussian_codebook(b).distortion
                rows.append(
                    {
                        "d": d,
                        "bits": b,
                        "scale_mode": mode,
                        "mse": ((x - xh) ** 2).sum(-1).mean().item(),
                        "mse_theory_table": dist,
                        "mse_theory_d": expected_sphere_distortion(b, d),
                        "ip_ratio": (x * xh).sum(-1).mean().item(),
                        "ip_ratio_theory": ref.theory_inner_product_ratio(dist, mode),
                        "ip_err_x_d": ip_err,
                    }
                )
    return rows


class CaptureBackend:
    """Wraps an attention backend and keeps each layer's q, k, v of the last forward."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forward(self, layer_idx, q, k, v, meta, scale):
        self.captured[layer_idx] = (q.detach().clone(), k.detach().clone(), v.detach().clone())
        return self.inner.forward(layer_idx, q, k, v, meta, scale)


def capture_qkv(token_ids: list[int]) -> tuple[dict, float]:
    """q, k, v [T, H, d] of every attention layer for one exact prefill, and the softmax scale."""
    from tqserve.eval.runner import DirectRunner

    runner = DirectRunner("auto", len(token_ids) + 16)
    cap = CaptureBackend(runner.backend)
    runner.backend = cap
    runner.chunk = len(token_ids)
    runner._forward(token_ids, 0)
    d = runner.formats[0].head_dim
    return cap.captured, d**-0.5


def _attention(q, k, v, scale):
    t, hq, _ = q.shape
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v)


def model_kv_distortion(captured: dict, scale: float, presets: list[str]) -> dict[str, dict]:
    """Per preset: mean over layers of key / value relative MSE and of the relative error of the
    causal attention output when every key and value is read quantized (no sink / window)."""
    out = {}
    for name in presets:
        kerr, verr, aerr, per_layer = [], [], [], []
        for layer, (q, k, v) in sorted(captured.items()):
            t, hkv, d = k.shape
            fmt = make_layer_format(name, layer, hkv, d, torch.float32)
            cache = fmt.allocate(t // 16 + 2, 16, torch.device("cpu"))
            slots = torch.arange(t) + 16
            fmt.write(cache, k, v, slots)
            kq, vq = fmt.read(cache, slots)
            ke = ((kq - k).pow(2).sum(-1) / k.pow(2).sum(-1).clamp_min(1e-30)).mean().item()
            ve = ((vq - v).pow(2).sum(-1) / v.pow(2).sum(-1).clamp_min(1e-30)).mean().item()
            o = _attention(q.float(), k.float(), v.float(), scale)
            oq = _attention(q.float(), kq, vq, scale)
            ae = ((oq - o).pow(2).sum(-1) / o.pow(2).sum(-1).clamp_min(1e-30)).mean().item()
            kerr.append(ke)
            verr.append(ve)
            aerr.append(ae)
            per_layer.append({"layer": layer, "key_rel_mse": ke, "value_rel_mse": ve, "attn_rel_mse": ae})
        n = len(per_layer)
        out[name] = {
            "key_rel_mse": sum(kerr) / n,
            "value_rel_mse": sum(verr) / n,
            "attn_rel_mse": sum(aerr) / n,
            "per_layer": per_layer,
        }
    return out
