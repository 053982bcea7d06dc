"""Our torch GGUF dequantization vs gguf-py's reference, and llama.cpp's q/k permutation undone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from tqserve.layers.rotary import RotaryEmbedding
from tqserve.models.gguf_loader import gguf_to_hf_name, unpermute_qk
from tqserve.models.gguf_quants import dequantize

Q = GGMLQuantizationType


def _f16_bytes(value: float, n: int) -> np.ndarray:
    return np.tile(np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8), (n, 1))


def random_quantized(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of a [rows, cols] tensor: gguf's quantizer where it has one, else random blocks
    with finite scales (the K-quants have no quantizer in gguf-py)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return quants.quantize(x, qtype)
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    n = raw.shape[0]
    if qtype == Q.Q4_K:  # d, dmin at bytes 0..3
        raw[:, 0:2] = _f16_bytes(0.011, n)
        raw[:, 2:4] = _f16_bytes(0.004, n)
    elif qtype == Q.Q6_K:  # d at bytes 208..209
        raw[:, 208:210] = _f16_bytes(0.02, n)
    elif qtype == Q.Q5_0:
        raw[:, 0:2] = _f16_bytes(0.05, n)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q5_0])
def test_dequantize_matches_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 5, 768
    raw = random_quantized(qtype, rows, cols, rng)
    ref = quants.dequantize(raw, qtype).astype(np.float32)
    ours = dequantize(raw, qtype, (rows, cols))
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    np.testing.assert_array_equal(ours.numpy(), ref)


def test_quantized_round_trip_is_close():
    """Independent of gguf's dequantizer: quantize with gguf, dequantize with ours."""
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    for qtype, tol in [(Q.Q8_0, 0.02), (Q.Q4_0, 0.3), (Q.Q4_1, 0.3)]:
        ours = dequantize(quants.quantize(x, qtype), qtype, x.shape).numpy()
        assert np.abs(ours - x).max() < tol, qtype.name


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's HF->GGUF converter does to q/k rows: within each head, row i of the first
    half and row i of the second half become adjacent rows 2i, 2i+1."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's normal (non-NeoX) RoPE: rotates (x[2i], x[2i+1]) by position * theta^(-2i/d)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[:, None, None] * inv_freq
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = b * ang.cos() + a * ang.sin()
    return out


def test_unpermute_undoes_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 16
    w = torch.randn(heads * head_dim, hidden)
    permuted = llama_cpp_permute(w, heads)
    assert not torch.equal(permuted, w)
    torch.testing.assert_close(unpermute_qk(permuted, heads), w, rtol=0, atol=0)
    bias = torch.randn(heads * head_dim)
    torch.testing.assert_close(unpermute_qk(llama_cpp_permute(bias, heads), heads), bias, rtol=0, atol=0)


def test_unpermuted_weights_give_llama_cpp_attention_scores():
    """Scores q.k from (GGUF weights, adjacent-pair RoPE) equal (un-permuted weights, our RoPE)."""
    heads, head_dim, hidden, t = 2, 16, 12, 7
    wq, wk = torch.randn(heads * head_dim, hidden), torch.randn(heads * head_dim, hidden)
    x = torch.randn(t, hidden)
    pos = torch.arange(t) * 3
    theta = 10000.0
    gq, gk = llama_cpp_permute(wq, heads), llama_cpp_permute(wk, heads)
    q_cpp = rope_adjacent_pairs((x @ gq.T).view(t, heads, head_dim), pos, theta)
    k_cpp = rope_adjacent_pairs((x @ gk.T).view(t, heads, head_dim), pos, theta)
    rope = RotaryEmbedding(head_dim, 64, theta)
    uq, uk = unpermute_qk(gq, heads), unpermute_qk(gk, heads)
    q, k = rope(pos, (x @ uq.T).view(t, heads, head_dim), (x @ uk.T).view(t, heads, head_dim))
    scores_cpp = torch.einsum("thd,shd->hts", q_cpp, k_cpp)
    scores = torch.einsum("thd,shd->hts", q, k)
    torch.testing.assert_close(scores, scores_cpp, rtol=1e-4, atol=1e-4)
    # Without un-permuting, our RoPE gives different scores.
    q_bad, k_bad = rope(pos, (x @ gq.T).view(t, heads, head_dim), (x @ gk.T).view(t, heads, head_dim))
    assert not torch.allclose(torch.einsum("thd,shd->hts", q_bad, k_bad), scores_cpp, atol=1e-2)


def test_tensor_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.7.attn_k.bias") == "model.layers.7.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(KeyError):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")
