"""Load a GGUF file: config and tokenizer (with chat template) from its metadata through
transformers, weights dequantized at load and renamed to HF names.

llama.cpp's converter permutes the rows of q and k for the `llama` architecture so that its
rotary kernel can rotate adjacent pairs; the HF layout (and ours) rotates the two halves of each
head, so those rows are permuted back here.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import torch
from gguf import quants as gguf_quants
from tqdm import tqdm

from tqserve.models.gguf_quants import dequantize
from tqserve.models.gguf_reader import GGUFFile

# GGUF general.architecture -> HF architecture name.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Architectures whose q/k rows llama.cpp permuted at conversion.
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF checkpoint name; None for tensors with no HF counterpart."""
    m = _LAYER_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            raise KeyError(f"unknown GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base == "rope_freqs":
        return None  # read separately into the rope config
    if base not in _GLOBAL_NAMES:
        raise KeyError(f"unknown GGUF tensor {name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. Within each head llama.cpp stores the rows as
    interleaved pairs (row 2i, 2i+1 = HF rows i, i + d/2); this restores halves order."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _field(reader: GGUFFile, key: str, default=None):
    return reader.get(key, default)


def _tensor(t, device) -> torch.Tensor:
    shape = tuple(int(x) for x in reversed(t.shape))  # GGML lists ne0 (innermost) first
    return dequantize(t.data, t.tensor_type, shape, device)


def load_gguf_config(path: str, reader: GGUFFile):
    """An HF config built from the GGUF metadata (read from our own reader: transformers' GGUF
    config path parses the whole file again, which costs seconds for a 50k-token vocabulary)."""
    from transformers import AutoConfig

    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")

    def meta(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    names = {t.name for t in reader.tensors}
    embed = reader.tensor("token_embd.weight")
    vocab = int(embed.shape[1])  # ne1 of [hidden, vocab]: may exceed the token list when padded
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        rope.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling_type!r} is not supported")
    freq_factors = reader.tensor("rope_freqs.weight")
    if freq_factors is not None:
        # Llama 3.1+ GGUFs carry llama3 scaling as per-frequency divisors.
        factors = [float(x) for x in gguf_quants.dequantize(freq_factors.data, freq_factors.tensor_type).reshape(-1)]
        rope.update(rope_type="freq_factors", factors=factors)
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    cfg = AutoConfig.for_model(
        model_type,
        architectures=[GGUF_ARCHITECTURES[arch]],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=int(num_heads),
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(meta("context_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    # Set after construction: config validation knows nothing of the GGUF-only "freq_factors" type.
    cfg.rope_parameters = rope
    return cfg


def _tokenizer_cache_dir(path: str) -> str:
    """Where the tokenizer converted from this exact file (path, size, mtime) is kept."""
    import transformers

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    root = os.environ.get("TQSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tqserve")
    return os.path.join(root, "gguf-tokenizers", hashlib.sha256(key.encode()).hexdigest()[:24])


def load_gguf_tokenizer(path: str, reader: GGUFFile):
    """The tokenizer and chat template from the GGUF metadata, converted by transformers.

    Conversion re-parses the whole file and rebuilds the BPE (seconds on a CPU), so the result is
    saved in HF format under ~/.cache/tqserve (or $TQSERVE_CACHE_DIR) and reused while the file is
    unchanged."""
    from tqserve.tokenizer import Tokenizer

    # llama.cpp's end-of-turn tokens (Llama 3's <|eot_id|>, ...) also end a request.
    extra = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    extra = [int(e) for e in extra if e is not None]
    cache = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        try:
            return Tokenizer.from_pretrained(cache, extra_stop_token_ids=extra)
        except (OSError, ValueError):  # a corrupt or incompatible cache entry: convert again
            shutil.rmtree(cache, ignore_errors=True)
    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = Tokenizer.from_pretrained(directory, gguf_file=filename, extra_stop_token_ids=extra)
    tmp = None
    try:  # write to a private folder, then rename: concurrent loaders never see half an entry
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        tokenizer.hf.save_pretrained(tmp)
        os.replace(tmp, cache)
    except OSError:  # read-only home, or another process won the rename: the cache is optional
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def iter_gguf_weights(reader: GGUFFile, hf_config, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of the file, with a progress bar."""
    arch = _field(reader, "general.architecture")
    for t in tqdm(reader.tensors, desc="Loading GGUF weights", unit="tensor", leave=False):
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = _tensor(t, device)
        if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, hf_config.num_attention_heads)
        elif arch in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, hf_config.num_key_value_heads)
        yield name, w
