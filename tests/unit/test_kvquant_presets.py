"""Presets: page sizes equal the reported bytes, write/read round trips, null-page redirect."""

from __future__ import annotations

import pytest
import torch

from tqserve.kvquant.base import ExactFormat
from tqserve.kvquant.formats import CodecFormat
from tqserve.kvquant.presets import (
    ALL_PRESETS,
    VLLM_PRESETS,
    describe_preset,
    make_layer_format,
    parse_preset,
    split_layer_choices,
    vllm_boundary_skip_layers,
)

EXTRA = (
    "tq_k4v4_nc",
    "tq_k5v3_ubs_s4_w60",
    "tq_k4v2_ncs_s4",
    "tq_k5v3_plain_s4",
    "tq_k8v4_w16",
    "tq_k2v2_ub_s2_w8",
    "fp8_e4m3",
)

# TURBOQUANT.md, bytes per token per KV head at d = 128 (K and V together)
VLLM_BYTES_128 = {
    "turboquant_k8v4": 196,
    "turboquant_4bit_nc": 134,
    "turboquant_k3v4_nc": 118,
    "turboquant_3bit_nc": 102,
}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _page_bytes(cache: dict[str, torch.Tensor], num_blocks: int, block_size: int) -> int:
    return sum(t.numel() * t.element_size() for t in cache.values()) // (num_blocks * block_size)


@pytest.mark.parametrize("preset", ALL_PRESETS + EXTRA)
@pytest.mark.parametrize("d", [64, 80, 128])
def test_page_bytes_match_report(preset, d):
    hkv = 3
    fmt = make_layer_format(preset, 2, hkv, d, torch.bfloat16)
    cache = fmt.allocate(4, 16, torch.device("cpu"))
    assert _page_bytes(cache, 4, 16) == fmt.page_bytes_per_token()
    for t in cache.values():
        assert t.shape[:3] == (4, hkv, 16)
    info = describe_preset(preset, d)
    assert info["page_bytes_per_token_head"] * hkv == fmt.page_bytes_per_token()
    assert info["bits_per_value_page"] == pytest.approx(8 * fmt.page_bytes_per_token() / (hkv * 2 * d))


def test_vllm_sizes_match_design_doc():
    for name, nbytes in VLLM_BYTES_128.items():
        assert describe_preset(name, 128)["page_bytes_per_token_head"] == nbytes
    assert describe_preset("auto", 128)["page_bytes_per_token_head"] == 512


def test_sink_window_overhead_counted():
    info = describe_preset("tq_k4v3_ub_s4_w128", 64, context_len=4096)
    assert info["sink"] == 4 and info["window"] == 128
    assert info["exact_overhead_bytes_per_token_head"] == pytest.approx(132 * 2 * 64 * 2 / 4096)
    page_bits = info["bits_per_value_page"]
    assert info["bits_per_value_total"] == pytest.approx(page_bits + 132 * 16 / 4096)
    fmt = make_layer_format("tq_k4v3_ub_s4_w128", 0, 3, 64, torch.float32)
    assert (fmt.sink, fmt.window) == (4, 128)


@pytest.mark.parametrize("preset", ALL_PRESETS + EXTRA)
def test_write_read_round_trip(preset):
    hkv, d, bs, nb = 2, 64, 8, 6
    fmt = make_layer_format(preset, 1, hkv, d, torch.float32)
    cache = fmt.allocate(nb, bs, torch.device("cpu"))
    t = 20
    k = torch.randn(t, hkv, d) * 2
    v = torch.randn(t, hkv, d)
    slots = torch.randperm((nb - 1) * bs)[:t] + bs  # never page 0
    fmt.write(cache, k, v, slots)
    kr, vr = fmt.read(cache, slots)
    assert kr.dtype == torch.float32 and kr.shape == k.shape and vr.shape == v.shape
    spec = parse_preset(preset)
    tol = {16: 1e-6, 8: 0.08, 6: 0.06, 5: 0.12, 4: 0.25, 3: 0.45, 2: 0.9}
    if preset == "bfloat16":
        tol[16] = 1e-2
    for x, xr, bits in ((k, kr, spec.key_bits), (v, vr, spec.value_bits)):
        rel = ((xr - x).norm(dim=-1) / x.norm(dim=-1)).mean().item()
        assert rel < tol[bits], (preset, bits, rel)
    # decoding is deterministic and reads only what is stored: a second write of the same
    # tokens elsewhere decodes to the same vectors
    other = slots.flip(0)
    fmt.write(cache, k.flip(0), v.flip(0), other)
    k2, _ = fmt.read(cache, other)
    assert torch.equal(k2.flip(0), kr)


def test_negative_slots_go_to_null_page():
    fmt = make_layer_format("turboquant_4bit_nc", 0, 2, 64, torch.float32)
    cache = fmt.allocate(3, 4, torch.device("cpu"))
    k = torch.randn(3, 2, 64)
    fmt.write(cache, k, k, torch.as_tensor([5, -1, 6]))
    for t in cache.values():
        assert t[1:].flatten(1).any(1).sum() == 1  # only page 1 was written among real pages
        assert t[2].abs().sum() == 0 if t.dtype.is_floating_point else t[2].sum() == 0


def test_skip_layers_and_presets_parse():
    fmt = make_layer_format("turboquant_3bit_nc", 1, 2, 64, torch.float32, skip_layers=[0, 1])
    assert isinstance(fmt, ExactFormat) and fmt.storage_dtype == torch.float32
    fmt = make_layer_format("turboquant_3bit_nc", 2, 2, 64, torch.float32, skip_layers=[0, 1])
    assert isinstance(fmt, CodecFormat)
    assert vllm_boundary_skip_layers(30) == [0, 1, 28, 29]
    assert make_layer_format("bfloat16", 0, 2, 64, torch.float32).storage_dtype == torch.bfloat16
    with pytest.raises(ValueError):
        parse_preset("turboquant_9bit")
    with pytest.raises(ValueError):
        parse_preset("tq_k7v4")
    for name in VLLM_PRESETS:
        assert parse_preset(name).value_kind == "minmax"


def test_rotation_differs_per_layer_in_formats():
    a = make_layer_format("tq4", 0, 1, 64, torch.float32)
    b = make_layer_format("tq4", 1, 1, 64, torch.float32)
    assert not torch.equal(a.rotation.matrix, b.rotation.matrix)


def test_layer_overrides_and_average_size():
    over = {0: "tq_k8v8", 29: "auto"}
    fmt = make_layer_format("tq3", 0, 1, 64, torch.float32, layer_overrides=over)
    assert fmt.page_bytes_per_token() == describe_preset("fp8", 64)["page_bytes_per_token_head"]
    assert isinstance(make_layer_format("tq3", 29, 1, 64, torch.float32, layer_overrides=over), ExactFormat)
    info = describe_preset("tq3", 64, num_layers=30, layer_overrides=over)
    one = describe_preset("tq3", 64)["bytes_total"]
    expect = (28 * one + describe_preset("tq_k8v8", 64)["bytes_total"] + 256) / 30
    assert info["bytes_total"] == pytest.approx(expect)


def test_per_layer_bits_in_the_name():
    name = "tq_k4v2_ub_s4_w28+v3@0-2.7+k5@2.4"
    base, choices = split_layer_choices(name)
    assert base == "tq_k4v2_ub_s4_w28"
    assert choices == {
        0: "tq_k4v3_ub_s4_w28",
        1: "tq_k4v3_ub_s4_w28",
        2: "tq_k5v3_ub_s4_w28",
        4: "tq_k5v2_ub_s4_w28",
        7: "tq_k4v3_ub_s4_w28",
    }
    assert parse_preset(name).key_bits == 4 and parse_preset(name).window == 28
    for layer, (kb, vb) in {0: (4, 3), 2: (5, 3), 3: (4, 2), 4: (5, 2), 29: (4, 2)}.items():
        fmt = make_layer_format(name, layer, 3, 64, torch.float32)
        assert (fmt.key_codec.bits, fmt.value_codec.bits) == (kb, vb)
        assert (fmt.sink, fmt.window) == (4, 28)  # every layer keeps the base's exact sink and window
        own = describe_preset(choices.get(layer, base), 64)["page_bytes_per_token_head"]
        assert fmt.page_bytes_per_token() == 3 * own
    info = describe_preset(name, 64, num_layers=30)
    pages = [60, 60, 68, 52, 60, 52, 52, 60] + [52] * 22
    assert info["layer_page_bytes"] == pages
    assert info["page_bytes_per_token_head"] == pytest.approx(sum(pages) / 30)
    assert info["bits_per_value_total"] == pytest.approx(8 * (sum(pages) / 30 + 32 * 2 * 64 * 2 / 4096) / 128)
    with pytest.raises(ValueError):
        describe_preset(name, 64)  # the average needs the layer count
    for bad in ("tq_k4v2+v7@1", "tq_k4v2+@1", "tq_k4v2+v3@", "turboquant_4bit_nc+k5@1", "tq_k4v2+v3@3-1"):
        with pytest.raises(ValueError):
            split_layer_choices(bad)


def test_search_modes_share_the_page_format():
    for mode in ("ubs", "ncs"):
        fmt = make_layer_format(f"tq_k5v3_{mode}_s4_w60", 0, 3, 64, torch.float32)
        plain = make_layer_format(f"tq_k5v3_{mode[:-1]}_s4_w60", 0, 3, 64, torch.float32)
        assert fmt.key_codec.search and not plain.key_codec.search
        assert fmt.key_codec.scale_mode == plain.key_codec.scale_mode + "+search"
        assert fmt._specs() == plain._specs()
        assert describe_preset(f"tq_k5v3_{mode}_s4_w60", 64)["bits_per_value_total"] == 4.5
    _, choices = split_layer_choices("tq_k4v2_ubs_s4_w60+v3@2")
    assert choices == {2: "tq_k4v3_ubs_s4_w60"}
