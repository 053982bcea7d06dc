"""The hybrid decoder shared by Qwen3-Next and Qwen3.5/3.6: Gated DeltaNet layers interleaved with
gated full-attention layers, each followed by a dense MLP or a sparse MoE.

Variants differ in the GDN checkpoint layout, in which layers are MoE, and in checkpoint prefixes;
subclasses set those. Flat token layout as every model: forward takes the tokens of all requests of
a step concatenated, only attention and GDN layers look at request boundaries (through the metadata).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from tqserve.layers.attention import ForwardContext
from tqserve.layers.embedding import LMHead, VocabEmbedding
from tqserve.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm
from tqserve.layers.gated_delta_net import GatedDeltaNet, GdnStepInfo
from tqserve.layers.linear import Linear
from tqserve.layers.moe import GatedMLP, SparseMoE
from tqserve.layers.rotary import RotaryEmbedding, rope_parameters


def text_config(hf_config):
    """The language-model config: multimodal Qwen3.5 configs nest it under `text_config`."""
    return getattr(hf_config, "text_config", None) or hf_config


def layer_types_of(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(cfg, "full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(cfg.num_hidden_layers)]


def _copy_param(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    param = module.get_parameter(name)
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.data.copy_(tensor)


class HybridDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg,
        layer_type: str,
        mixer_idx: int,
        moe: bool,
        rotary: list,
        dtype,
        gdn_layout: str,
    ):
        super().__init__()
        self.layer_type = layer_type
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                h, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, eps, mixer_idx, gdn_layout, dtype,
            )  # fmt: skip
        elif layer_type == "full_attention":
            head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
            self.self_attn = GatedAttention(
                h, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, eps, rotary, mixer_idx,
                bool(getattr(cfg, "attention_bias", False)), dtype,
            )  # fmt: skip
        else:
            raise NotImplementedError(f"layer type {layer_type!r}")
        if moe:
            self.mlp = SparseMoE(
                h, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                bool(getattr(cfg, "norm_topk_prob", True)), dtype,
            )  # fmt: skip
        else:
            self.mlp = GatedMLP(h, cfg.intermediate_size, dtype)
        self.input_layernorm = ZeroCenteredRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(h, eps, dtype)

    def forward(self, positions, x, ctx: ForwardContext, info: GdnStepInfo | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, ctx, info)
        else:
            h = self.self_attn(positions, h, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> None:
        child, _, rest = name.partition(".")
        module = getattr(self, child, None)
        if module is None:
            raise KeyError(f"checkpoint tensor {name!r} has no matching module in this {self.layer_type} layer")
        loader = getattr(module, "load_hf_weight", None)
        if loader is None or not loader(rest, tensor):
            _copy_param(module, rest, tensor)


class MTPHead(nn.Module):
    """Multi-token-prediction weights (`mtp.*`): loaded and kept, not run yet. Its attention layers take
    KV-cache indices after the main model's (`mtp_kv_layer_specs`)."""

    def __init__(self, cfg, num_layers: int, first_attn_idx: int, moe: bool, rotary, dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps, dtype)
        self.fc = Linear(2 * h, h, dtype=dtype)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, "full_attention", first_attn_idx + i, moe, rotary, dtype, "qwen3_5")
            for i in range(num_layers)
        )
        self.norm = ZeroCenteredRMSNorm(h, cfg.rms_norm_eps, dtype)

    def load_hf_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith("layers."):
            idx, _, rest = name[len("layers.") :].partition(".")
            self.layers[int(idx)].load_hf_weight(rest, tensor)
        else:
            _copy_param(self, name, tensor)


class HybridForCausalLM(nn.Module):
    gdn_layout = "qwen3_5"

    def __init__(self, hf_config, dtype: torch.dtype):
        super().__init__()
        cfg = self.config = text_config(hf_config)
        self.dtype = dtype
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported (silu only)")
        self.layer_types = layer_types_of(cfg)
        theta, scaling = rope_parameters(cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        factor = scaling.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        # Text-only MRoPE (Qwen3.5) has three equal position rows: it is plain partial NeoX RoPE.
        scaling = {k: v for k, v in scaling.items() if k not in ("mrope_section", "mrope_interleaved")}
        self.rotary = [
            RotaryEmbedding(
                head_dim,
                cfg.max_position_embeddings,
                theta,
                scaling,
                int(head_dim * factor),
            )
        ]
        self.rotary_emb = self.rotary[0]
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        layers, n_attn, n_gdn = [], 0, 0
        for i, kind in enumerate(self.layer_types):
            idx = n_gdn if kind == "linear_attention" else n_attn
            layers.append(
                HybridDecoderLayer(
                    cfg,
                    kind,
                    idx,
                    self.is_moe_layer(cfg, i),
                    self.rotary,
                    dtype,
                    self.gdn_layout,
                )
            )
            n_gdn += kind == "linear_attention"
            n_attn += kind == "full_attention"
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            tied=self.embed_tokens if self.tie_word_embeddings else None,
        )
        n_mtp = getattr(cfg, "mtp_num_hidden_layers", None) or getattr(cfg, "num_nextn_predict_layers", None) or 0
        self.mtp = MTPHead(cfg, n_mtp, n_attn, self.is_moe_layer(cfg, 0), self.rotary, dtype) if n_mtp else None
        # Poison every parameter: load_weights checks that none is left unwritten.
        for p in self.parameters():
            p.data.fill_(math.nan)

    @staticmethod
    def is_moe_layer(cfg, idx: int) -> bool:
        return False

    # ---- the model contract -------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        info = GdnStepInfo.build(ctx.meta, input_ids.device)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, ctx, info)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        return [
            (layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
            for layer in self.layers
            if layer.layer_type == "full_attention"
        ]

    def mtp_kv_layer_specs(self) -> list[tuple[int, int]]:
        """KV layers of the MTP head, indexed after `kv_layer_specs()` (not allocated by the engine yet)."""
        if self.mtp is None:
            return []
        return [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.mtp.layers]

    def state_specs(self) -> list[tuple[tuple[int, int], tuple[int, int, int]]]:
        """Per GDN layer: conv state (conv_dim, K) and recurrent state (Hv, dk, dv), both fp32."""
        return [layer.linear_attn.state_spec() for layer in self.layers if layer.layer_type == "linear_attention"]

    # ---- loading ------------------------------------------------------------------------------

    @staticmethod
    def _strip_prefix(name: str) -> str | None:
        """HF name -> name inside this model (None = not ours: vision tower, rotary buffers)."""
        for prefix in (
            "model.language_model.",
            "language_model.model.",
            "language_model.",
            "model.",
        ):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if name.startswith(("visual.", "model.visual.", "vision_tower.")) or "rotary_emb." in name:
            return None
        return name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names used. Raises if
        a parameter was left unwritten (they are NaN-poisoned at construction)."""
        used: set[str] = set()
        for hf_name, tensor in weights:
            name = self._strip_prefix(hf_name)
            if name is None or (name.startswith("lm_head.") and self.tie_word_embeddings):
                continue
            if name.startswith("mtp."):
                if self.mtp is None:
                    continue  # config declares no MTP layers: nothing to keep them in
                self.mtp.load_hf_weight(name[4:], tensor)
            elif name.startswith("layers."):
                idx, _, rest = name[len("layers.") :].partition(".")
                self.layers[int(idx)].load_hf_weight(rest, tensor)
            else:
                _copy_param(self, name, tensor)
            used.add(hf_name)
        if self.mtp is not None and not any(n.split(".", 1)[0] == "mtp" for n in map(self._strip_prefix, used) if n):
            self.mtp = None  # the checkpoint carries no MTP weights
        missing = [n for n, p in self.named_parameters() if torch.isnan(p).any()]
        if missing:
            raise ValueError(f"checkpoint left {len(missing)} parameters unwritten, e.g. {missing[:5]}")
        return used
