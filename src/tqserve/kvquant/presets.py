"""KV-cache presets by name -> one `LayerKVFormat` per attention layer, plus their size report.

Names:
  auto, bfloat16         exact pages (model dtype / bf16)
  fp8                    e4m3 keys and values, fp16 scale per token and KV head
  turboquant_k8v4        vLLM: keys fp8 e4m3 cast (no scale), values 4-bit min-max (fp16 scale + zero)
  turboquant_4bit_nc     vLLM: keys rotated 4-bit codebook + fp16 norm (nc), values 4-bit min-max
  turboquant_k3v4_nc     vLLM: keys 3-bit nc, values 4-bit min-max
  turboquant_3bit_nc     vLLM: keys 3-bit nc, values 3-bit min-max
  tq_k{K}v{V}[_{nc|ub|plain}][_s{S}][_w{W}]
                         tqserve: keys and values both TurboQuant (K, V in 2..6 bits; 8 = fp8 with
                         scale), scale mode `ub` (unbiased, default) / `nc` / `plain`, S exact sink
                         tokens and an exact window of the W most recent positions (default 0 / 0).
  tq4, tq3               tqserve's recommended presets (aliases chosen by measurement, docs/kv-quality.md).
Values of TurboQuant codecs are stored rotated (the attention kernel accumulates in the rotated
space and applies R^T once); `read` returns them unrotated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tqserve.kvquant.base import ExactFormat, LayerKVFormat
from tqserve.kvquant.formats import (
    CodecFormat,
    ExactCodec,
    Fp8CastCodec,
    Fp8ScaledCodec,
    MinMaxCodec,
    TurboQuantCodec,
    VectorCodec,
)
from tqserve.kvquant.rotation import DEFAULT_SEED, Rotation

VLLM_PRESETS = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
# tqserve's recommended presets; chosen by the measurements in docs/kv-quality.md.
ALIASES = {"tq4": "tq_k5v3_ub_s4_w32", "tq3": "tq_k4v2_ub_s4_w48"}
TQSERVE_PRESETS = tuple(ALIASES)
EXACT_PRESETS = ("auto", "bfloat16")
ALL_PRESETS = EXACT_PRESETS + ("fp8",) + VLLM_PRESETS + TQSERVE_PRESETS
DEFAULT_CONTEXT = 4096

_TQ_RE = re.compile(r"^tq_k(\d)v(\d)(?:_(nc|ub|plain))?(?:_s(\d+))?(?:_w(\d+))?$")
_MODE = {"nc": "nc", "ub": "unbiased", "plain": "plain"}


@dataclass(frozen=True)
class PresetSpec:
    """Parsed preset: codec kinds ('tq', 'minmax', 'fp8', 'fp8cast', 'exact'), bits, sink, window."""

    name: str
    key_kind: str
    key_bits: int
    value_kind: str
    value_bits: int
    scale_mode: str = "nc"
    sink: int = 0
    window: int = 0


def parse_preset(name: str) -> PresetSpec:
    canonical = ALIASES.get(name, name)
    if canonical in ("auto", "bfloat16"):
        return PresetSpec(name, "exact", 16, "exact", 16)
    if canonical in ("fp8", "fp8_e4m3"):
        return PresetSpec(name, "fp8", 8, "fp8", 8)
    if canonical == "turboquant_k8v4":
        return PresetSpec(name, "fp8cast", 8, "minmax", 4)
    vllm = {
        "turboquant_4bit_nc": (4, 4),
        "turboquant_k3v4_nc": (3, 4),
        "turboquant_3bit_nc": (3, 3),
    }
    if canonical in vllm:
        kb, vb = vllm[canonical]
        return PresetSpec(name, "tq", kb, "minmax", vb, "nc")
    m = _TQ_RE.match(canonical)
    if m is None:
        raise ValueError(f"unknown kv_cache_dtype preset {name!r}; known: {', '.join(ALL_PRESETS)} or tq_k<K>v<V>...")
    kb, vb = int(m.group(1)), int(m.group(2))
    for b in (kb, vb):
        if not (2 <= b <= 6 or b == 8):
            raise ValueError(f"{name!r}: bits must be 2..6 or 8 (fp8), got {b}")
    kind = {8: "fp8"}
    return PresetSpec(
        name,
        kind.get(kb, "tq"),
        kb,
        kind.get(vb, "tq"),
        vb,
        _MODE[m.group(3) or "ub"],
        int(m.group(4) or 0),
        int(m.group(5) or 0),
    )


def _codec(
    kind: str,
    bits: int,
    head_dim: int,
    rotation: Rotation,
    mode: str,
    dtype: torch.dtype,
) -> VectorCodec:
    if kind == "tq":
        return TurboQuantCodec(head_dim, bits, rotation, mode)
    if kind == "minmax":
        return MinMaxCodec(head_dim, bits)
    if kind == "fp8":
        return Fp8ScaledCodec(head_dim)
    if kind == "fp8cast":
        return Fp8CastCodec(head_dim)
    return ExactCodec(head_dim, dtype)


def make_layer_format(
    preset_name: str,
    layer_idx: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: torch.dtype,
    skip_layers: Sequence[int] = (),
    seed: int = DEFAULT_SEED,
    layer_overrides: dict[int, str] | None = None,
) -> LayerKVFormat:
    """The format of attention layer `layer_idx`. Layers in `skip_layers` (vLLM's
    kv_cache_dtype_skip_layers) keep exact pages in the model dtype; `layer_overrides` maps a layer
    index to another preset name (per-layer bit choices)."""
    if layer_overrides and layer_idx in layer_overrides:
        preset_name = layer_overrides[layer_idx]
    spec = parse_preset(preset_name)
    if spec.key_kind == "exact" or layer_idx in set(skip_layers):
        dtype = torch.bfloat16 if ALIASES.get(preset_name, preset_name) == "bfloat16" else model_dtype
        fmt = ExactFormat(num_kv_heads, head_dim, model_dtype, layer_idx, storage_dtype=dtype)
        fmt.name = preset_name if spec.key_kind == "exact" else "auto"
        return fmt
    rot = Rotation(head_dim, layer_idx, seed)
    return CodecFormat(
        num_kv_heads,
        head_dim,
        model_dtype,
        layer_idx,
        _codec(spec.key_kind, spec.key_bits, head_dim, rot, spec.scale_mode, model_dtype),
        _codec(
            spec.value_kind,
            spec.value_bits,
            head_dim,
            rot,
            spec.scale_mode,
            model_dtype,
        ),
        name=preset_name,
        sink=spec.sink,
        window=spec.window,
    )


def vllm_boundary_skip_layers(num_layers: int, n: int = 2) -> list[int]:
    """vLLM's habit for aggressive presets on dense models: first n and last n layers kept exact."""
    return sorted(set(range(min(n, num_layers))) | set(range(max(0, num_layers - n), num_layers)))


def describe_preset(
    name: str,
    head_dim: int,
    context_len: int = DEFAULT_CONTEXT,
    exact_bytes: int = 2,
    num_layers: int | None = None,
    skip_layers: Sequence[int] = (),
    layer_overrides: dict[int, str] | None = None,
) -> dict:
    """Sizes per token and KV head (K and V together). Exact sink/window copies are counted at
    `exact_bytes` per value (bf16) and spread over `context_len` tokens; skipped layers count as bf16
    pages, averaged over `num_layers`."""
    spec = parse_preset(name)
    fmt = make_layer_format(name, 0, 1, head_dim, torch.bfloat16)
    page = fmt.page_bytes_per_token()
    bf16 = 2 * head_dim * 2
    exact_tokens = min(spec.sink + spec.window, context_len)
    overhead = exact_tokens * 2 * head_dim * exact_bytes / context_len
    total = page + overhead
    if num_layers and (skip_layers or layer_overrides):
        per_layer = []
        for i in range(num_layers):
            if i in set(skip_layers):
                per_layer.append(bf16)
            elif layer_overrides and i in layer_overrides:
                per_layer.append(describe_preset(layer_overrides[i], head_dim, context_len, exact_bytes)["bytes_total"])
            else:
                per_layer.append(total)
        total = sum(per_layer) / num_layers
    kc = getattr(fmt, "key_codec", None)
    vc = getattr(fmt, "value_codec", None)
    return {
        "preset": name,
        "canonical": ALIASES.get(name, name),
        "head_dim": head_dim,
        "keys": kc.label if kc else "exact",
        "values": vc.label if vc else "exact",
        "values_rotated": bool(vc and vc.rotated),
        "key_bytes": kc.bytes_per_vector() if kc else page // 2,
        "value_bytes": vc.bytes_per_vector() if vc else page // 2,
        "page_bytes_per_token_head": page,
        "sink": spec.sink,
        "window": spec.window,
        "context_len": context_len,
        "exact_overhead_bytes_per_token_head": overhead,
        "bits_per_value_page": 8.0 * page / (2 * head_dim),
        "bytes_total": total,
        "bits_per_value_total": 8.0 * total / (2 * head_dim),
        "capacity_vs_bf16": bf16 / total,
    }
