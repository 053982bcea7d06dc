"""Tiny Llama / Qwen2 / Qwen3 written to GGUF files as llama.cpp lays them out (quantized, Llama
q/k rows permuted, llama3 scaling as rope_freqs), loaded by tqserve and compared with transformers
running the same dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from model_factory import write_tiny_checkpoint
from test_gguf_quants import llama_cpp_permute
from test_hf_models import assert_logits_match, tqserve_logits

from tqserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
from tqserve.models.gguf_reader import GGUFFile
from tqserve.models.llama import head_dim_of
from tqserve.models.loader import build_model

Q = GGMLQuantizationType
# HF -> llama.cpp names, written out here independently of the loader's table.
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# A mix of storage types across tensors (matrices only; norms and biases stay F32 as in llama.cpp).
MATRIX_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16]


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in GLOBAL:
        return f"{GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}.{kind}"


def write_gguf(path, hf_model, arch: str) -> dict[str, torch.Tensor]:
    """Write `hf_model` as a GGUF file; returns the HF state dict as llama.cpp would reproduce it
    (each quantized matrix replaced by gguf-py's dequantization of what was written)."""
    cfg = hf_model.config
    head_dim = head_dim_of(cfg)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.rope_parameters["rope_type"] == "llama3":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        base = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    reference = {}
    for i, (name, t) in enumerate(hf_model.state_dict().items()):
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        x = t.float().numpy()
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            x = llama_cpp_permute(t.float(), heads).numpy()
        qtype = MATRIX_TYPES[i % len(MATRIX_TYPES)] if x.ndim == 2 else Q.F32
        raw = quants.quantize(x, qtype)
        w.add_tensor(gguf_name(name), raw, raw_dtype=qtype if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16) else None)
        # Row permutations commute with row-wise block quantization: dequantize the unpermuted rows.
        reference[name] = torch.from_numpy(quants.dequantize(quants.quantize(t.float().numpy(), qtype), qtype).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(tmp_path, arch):
    hf_model = write_tiny_checkpoint(tmp_path / "hf", arch)
    path = tmp_path / "tiny.gguf"
    reference = write_gguf(path, hf_model, arch)
    hf_model.load_state_dict(reference, strict=False)

    reader = GGUFFile(str(path))
    cfg = load_gguf_config(str(path), reader)
    assert cfg.architectures == [type(hf_model).__name__]
    assert cfg.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert cfg.head_dim == head_dim_of(hf_model.config)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    model.load_weights(iter_gguf_weights(reader, cfg))

    ids = torch.arange(3, 60, dtype=torch.int64) * 5 % cfg.vocab_size
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0].float()
    assert_logits_match(tqserve_logits(model, ids), ref)


def test_reader_matches_gguf_py(tmp_path):
    """Our header parser sees the same metadata and tensor bytes as gguf-py's GGUFReader."""
    hf_model = write_tiny_checkpoint(tmp_path / "hf", "qwen2")
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, hf_model, "qwen2")
    ours, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue  # header values gguf-py exposes as fields
        value, expected = ours.get(key), field.contents()
        value = value.tolist() if isinstance(value, np.ndarray) else value
        assert value == pytest.approx(expected) if isinstance(expected, float) else value == expected, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert tuple(mine.shape) == tuple(int(x) for x in theirs.shape)
        assert mine.tensor_type == theirs.tensor_type
        assert np.array_equal(mine.data, np.asarray(theirs.data).reshape(-1).view(np.uint8))
