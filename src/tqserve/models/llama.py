"""Llama-family decoder (Llama 2/3.x, SmolLM2), also the base of Qwen2 and Qwen3 dense.

Flat token layout: forward takes the tokens of every request of a step concatenated ([T]), and
attention (through `ForwardContext`) is the only place where request boundaries matter.
Variants differ by two flags: `qkv_bias` (Qwen2) and `qk_norm` (Qwen3: per-head RMSNorm on q and k
before RoPE).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tqserve.layers.attention import Attention, ForwardContext
from tqserve.layers.embedding import LMHead, VocabEmbedding
from tqserve.layers.linear import Linear, MergedLinear
from tqserve.layers.norm import RMSNorm
from tqserve.layers.rotary import RotaryEmbedding, rope_parameters
from tqserve.ops import fused

# Checkpoint projection name -> (fused module name, shard index).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttentionBlock(nn.Module):
    """Projections, optional q/k norm and RoPE around the shared `Attention` layer."""

    def __init__(self, cfg, layer_idx: int, rotary: list, dtype, biases: tuple[bool, bool], qk_norm: bool):
        super().__init__()
        qkv_bias, o_bias = biases
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias, dtype=dtype)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=o_bias, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # shared by all layers; not registered as a child of each
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.shards(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](rope, q, k)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, ctx)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg, dtype, bias: bool = False):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter, inter], bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused(x):
            from tqserve.ops.silu_mul import silu_mul  # Triton: imported on the CUDA path only

            return self.down_proj(silu_mul(self.gate_up_proj(x)))  # one launch (ops/silu_mul.py)
        gate, up = self.gate_up_proj.shards(x)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, rotary: list, dtype, biases: tuple[bool, bool], qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttentionBlock(cfg, layer_idx, rotary, dtype, biases, qk_norm)
        self.mlp = LlamaMLP(cfg, dtype, bias=getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    qk_norm = False

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        cfg = self.config = hf_config
        self.dtype = dtype
        self._check_config(cfg)
        theta, scaling = rope_parameters(cfg)
        head_dim = head_dim_of(cfg)
        rotary_dim = int(head_dim * scaling.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        # Kept in a plain list so the shared module is not registered once per layer.
        self.rotary = [RotaryEmbedding(head_dim, cfg.max_position_embeddings, theta, scaling, rotary_dim)]
        self.rotary_emb = self.rotary[0]  # registered once here, so .to(device) moves its table
        biases = self._attention_biases(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary, dtype, biases, self.qk_norm) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        tied = self.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, tied=tied)

    def _attention_biases(self, cfg) -> tuple[bool, bool]:
        """(q/k/v bias, o bias). Llama and Qwen3 put both under `attention_bias`."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def _check_config(self, cfg) -> None:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported (silu only)")
        # Released Qwen2/2.5/3 checkpoints ship use_sliding_window=false; a windowed variant would
        # need per-layer windows in the attention backend.
        if getattr(cfg, "use_sliding_window", False):
            raise NotImplementedError("use_sliding_window=true is not supported")

    # ---- the model contract -------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        rope = self.rotary[0].table(positions)  # shared by every layer of the step
        for layer in self.layers:
            x, residual = layer(rope, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        return [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names loaded.

        Raises if a parameter was left unloaded, since uninitialized memory would otherwise
        silently produce garbage."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._map_name(name)
            if target is None:
                continue
            module_name, param_name, shard = target
            if shard is None:
                full = f"{module_name}.{param_name}"
                if full not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no matching parameter ({full})")
                param = params[full]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(full)
            else:
                self.get_submodule(module_name).load_shard(param_name, shard, tensor)
                loaded.add(f"{module_name}.{param_name}#{shard}")
        self._check_all_loaded(params, loaded)
        return loaded

    def _map_name(self, name: str) -> tuple[str, str, int | None] | None:
        """HF checkpoint name -> (module path in this model, param name, fused shard or None)."""
        if "rotary_emb." in name:
            return None  # precomputed inv_freq buffers in old checkpoints
        if name.startswith("lm_head.") and self.tie_word_embeddings:
            return None  # tied: the embedding is the head
        name = name.removeprefix("model.")
        module_name, _, param_name = name.rpartition(".")
        prefix, _, proj = module_name.rpartition(".")
        if proj in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[proj]
            return f"{prefix}.{fused}", param_name, shard
        return module_name, param_name, None

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for full in params:
            module = self.get_submodule(full.rpartition(".")[0])
            if isinstance(module, MergedLinear):
                needed = [f"{full}#{i}" for i in range(len(module.out_sizes))]
                missing += [n for n in needed if n not in loaded]
            elif full not in loaded:
                missing.append(full)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
