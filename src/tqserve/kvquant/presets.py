"""KV-cache presets by name -> one `LayerKVFormat` per attention layer, plus their size report.

Names:
  auto, bfloat16         exact pages (model dtype / bf16)
  fp8                    e4m3 keys and values, fp16 scale per token and KV head
  turboquant_k8v4        vLLM: keys fp8 e4m3 cast (no scale), values 4-bit min-max (fp16 scale + zero)
  turboquant_4bit_nc     vLLM: keys rotated 4-bit codebook + fp16 norm (nc), values 4-bit min-max
  turboquant_k3v4_nc     vLLM: keys 3-bit nc, values 4-bit min-max
  turboquant_3bit_nc     vLLM: keys 3-bit nc, values 3-bit min-max
  tq_k{K}v{V}[_{nc|ub|plain|ncs|ubs}][_s{S}][_w{W}]
                         tqserve: keys and values both TurboQuant (K, V in 2..6 bits; 8 = fp8 with
                         scale), scale mode `ub` (unbiased, default) / `nc` / `plain`; `ubs` / `ncs`
                         are ub / nc with the gain-search encoder (same page format and decoder,
                         better indices, see reference.py), S exact sink
                         tokens and an exact window of the W most recent positions (default 0 / 0).
  <tq preset>+k{K}v{V}@{layers}[+...]
                         per-layer bits: the listed layers (`.`-separated indices or `a-b` ranges)
                         get K-bit keys and/or V-bit values (either may be left out), same scale
                         mode, sink and window as the base; e.g. `tq_k4v2_ub_s4_w28+v3@0-2.7+k5@4`.
                         Layers past the model's last are ignored.
  tq4, tq3, tq4s, tq3s   tqserve's recommended presets (aliases chosen by measurement, docs/kv-quality.md).
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
# tqserve's recommended presets; chosen by the measurements in docs/kv-quality.md. tq4s / tq3s use the
# gain-search encoder (same pages and decoder as tq4 / tq3's codecs, better indices) and meet the
# issue's quality goals at <= 4.5 / <= 3.5 bits. The Triton store kernel runs the search too, at
# about 1/28 of tq4's store speed (docs/benchmarks.md, store table).
ALIASES = {
    "tq4": "tq_k5v3_ub_s4_w32",
    "tq3": "tq_k4v2_ub_s4_w48",
    "tq4s": "tq_k5v3_ncs_s4_w60",
    "tq3s": "tq_k4v2_ubs_s4_w60",
}
TQSERVE_PRESETS = tuple(ALIASES)
EXACT_PRESETS = ("auto", "bfloat16")
ALL_PRESETS = EXACT_PRESETS + ("fp8",) + VLLM_PRESETS + TQSERVE_PRESETS
DEFAULT_CONTEXT = 4096

_TQ_RE = re.compile(r"^tq_k(\d)v(\d)(?:_(nc|ub|plain|ncs|ubs))?(?:_s(\d+))?(?:_w(\d+))?$")
_LAYER_RE = re.compile(r"^(?:k(\d))?(?:v(\d))?@(\d+(?:-\d+)?(?:\.\d+(?:-\d+)?)*)$")
_MODE = {"nc": "nc", "ub": "unbiased", "plain": "plain", "ncs": "nc+search", "ubs": "unbiased+search"}
_MODE_NAME = {v: k for k, v in _MODE.items()}


def _layer_list(s: str) -> list[int]:
    out: list[int] = []
    for item in s.split("."):
        a, _, b = item.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo:
            raise ValueError(f"bad layer range {item!r}")
        out.extend(range(lo, hi + 1))
    return out


def split_layer_choices(name: str) -> tuple[str, dict[int, str]]:
    """`base+k6@1.3+v4@0-2` -> (base, {layer: per-layer preset name}). Names without `+` map to
    (name, {}). Aliases are resolved first; the base must be a `tq_k{K}v{V}...` preset."""
    canonical = ALIASES.get(name, name)
    base, *groups = canonical.split("+")
    if not groups:
        return canonical, {}
    spec = parse_preset(base)
    if not base.startswith("tq_"):
        raise ValueError(f"{name!r}: per-layer bits need a tq_k<K>v<V> base preset, got {base!r}")
    bits: dict[int, list[int]] = {}
    for g in groups:
        m = _LAYER_RE.match(g)
        if m is None or not (m.group(1) or m.group(2)):
            raise ValueError(f"{name!r}: bad per-layer group {g!r} (expected k<K>v<V>@<layers>)")
        for layer in _layer_list(m.group(3)):
            kv = bits.setdefault(layer, [spec.key_bits, spec.value_bits])
            if m.group(1):
                kv[0] = int(m.group(1))
            if m.group(2):
                kv[1] = int(m.group(2))
    tail = f"_{_MODE_NAME[spec.scale_mode]}_s{spec.sink}_w{spec.window}"
    choices = {layer: f"tq_k{k}v{v}{tail}" for layer, (k, v) in sorted(bits.items())}
    for layer_name in choices.values():
        parse_preset(layer_name)  # validates the bits
    return base, choices


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
    """The base preset (for per-layer names, the part before the first `+`)."""
    canonical = ALIASES.get(name, name).split("+")[0]
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
        base, _, search = mode.partition("+")
        return TurboQuantCodec(head_dim, bits, rotation, base, search == "search")
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
    index to another preset name (per-layer bit choices; `name+k6@...` in the name does the same)."""
    if layer_overrides and layer_idx in layer_overrides:
        preset_name = layer_overrides[layer_idx]
    base, choices = split_layer_choices(preset_name)
    layer_name = choices.get(layer_idx, base)
    spec = parse_preset(layer_name)
    if spec.key_kind == "exact" or layer_idx in set(skip_layers):
        dtype = torch.bfloat16 if layer_name == "bfloat16" else model_dtype
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
    pages, averaged over `num_layers`. Per-layer names (`base+k6@...`) need `num_layers`: their page
    size is the average over the layers, and `layer_page_bytes` lists each layer's."""
    base, choices = split_layer_choices(name)
    if choices and not num_layers:
        raise ValueError(f"{name!r} has per-layer bits: describe_preset needs num_layers")
    spec = parse_preset(base)
    fmt = make_layer_format(base, 0, 1, head_dim, torch.bfloat16)
    page = fmt.page_bytes_per_token()
    bf16 = 2 * head_dim * 2
    exact_tokens = min(spec.sink + spec.window, context_len)
    overhead = exact_tokens * 2 * head_dim * exact_bytes / context_len
    total = page + overhead
    layer_pages = None
    if num_layers and (skip_layers or layer_overrides or choices):
        layer_pages, per_layer = [], []
        for i in range(num_layers):
            other = (layer_overrides or {}).get(i) or choices.get(i)
            if i in set(skip_layers):
                layer_pages.append(bf16)
                per_layer.append(bf16)
            elif other:
                info = describe_preset(other, head_dim, context_len, exact_bytes)
                layer_pages.append(info["page_bytes_per_token_head"])
                per_layer.append(info["bytes_total"])
            else:
                layer_pages.append(page)
                per_layer.append(total)
        total = sum(per_layer) / num_layers
        if choices:
            page = sum(layer_pages) / num_layers
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
        "layer_page_bytes": layer_pages,
        "sink": spec.sink,
        "window": spec.window,
        "context_len": context_len,
        "exact_overhead_bytes_per_token_head": overhead,
        "bits_per_value_page": 8.0 * page / (2 * head_dim),
        "bytes_total": total,
        "bits_per_value_total": 8.0 * total / (2 * head_dim),
        "capacity_vs_bf16": bf16 / total,
    }
