"""Helpers that write tiny random-weight Hugging Face checkpoints for tests (no downloads).

`write_tiny_checkpoint(dir, "llama" | "qwen2" | "qwen3")` writes config.json, model.safetensors and a
byte-level tokenizer with a chat template, and returns the transformers model it saved (float32,
eval mode) so a test can compare against it.
"""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tiny_tokenizer():
    """A byte-level tokenizer: one token per byte (so every non-ASCII character spans several
    tokens, which is what incremental detokenization has to handle) plus a few merges and the
    chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(arch: str, vocab_size: int, **overrides):
    """A small config of the given family. Llama uses llama3 rope scaling and untied embeddings;
    Qwen2 and Qwen3 tie them; Qwen3 has head_dim != hidden_size / heads."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "bos_token_id": vocab_size - 2,
        "eos_token_id": vocab_size - 1,
    }
    if arch == "llama":
        cfg = dict(
            common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = LlamaConfig
    elif arch == "qwen2":
        cfg = dict(common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = Qwen2Config
    elif arch == "qwen3":
        cfg = dict(
            common, head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
        cls = Qwen3Config
    else:
        raise ValueError(arch)
    cfg.update(overrides)
    return cls(**cfg)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Replace HF's init (zero biases, unit norms, tiny matrices) with values large enough that
    every parameter matters and top-1 tokens are well separated."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)


def write_tiny_checkpoint(directory, arch: str, seed: int = 0, **overrides):
    """Write an HF checkpoint of a tiny random model into `directory`; returns the HF model."""
    from transformers import AutoModelForCausalLM

    tokenizer = make_tiny_tokenizer()
    cfg = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    model.eval()
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return model
