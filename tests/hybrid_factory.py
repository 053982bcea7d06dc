"""Tiny random-weight hybrid checkpoints in HF layout (config.json + model.safetensors), and a
test-only driver that runs a tqserve hybrid model over multi-request steps without the engine.

Variants: "qwen3_next" (MoE + shared expert, one dense-MLP layer, grouped in_proj_qkvz/ba),
"qwen3_5" (dense), "qwen3_5_moe" (MoE + shared expert). All have several GDN and full-attention
layers, GQA, and more value heads than key heads.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from tqserve.attention.backend import AttentionBackend, AttentionMetadata
from tqserve.layers.attention import ForwardContext
from tqserve.ops.gdn.state_pool import StatePool

LAYER_TYPES = [
    "linear_attention",
    "linear_attention",
    "full_attention",
    "linear_attention",
    "full_attention",
]
VOCAB = 256

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def make_config(variant: str, **overrides):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    }
    if variant == "qwen3_next":
        kw = dict(
            _COMMON,
            **_MOE,
            intermediate_size=96,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        kw["norm_topk_prob"] = True
        cfg = Qwen3NextConfig(**kw, rope_parameters=rope)
        cfg.architectures = ["Qwen3NextForCausalLM"]
    elif variant == "qwen3_5":
        rope["mrope_section"], rope["mrope_interleaved"] = [1, 1, 0], True
        cfg = Qwen3_5TextConfig(**dict(_COMMON, intermediate_size=96), rope_parameters=rope)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif variant == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(**dict(_COMMON, **_MOE), rope_parameters=rope)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    else:
        raise ValueError(variant)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


@torch.no_grad()
def make_hf_model(variant: str, seed: int = 0, **overrides):
    """A transformers model with weights large enough that logits are peaked (no near-ties in top-1)."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(variant, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif "norm" in name:  # zero-centred norms and the (plain-weight) gated norm alike
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def _hf_state_dict(model, per_expert: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if per_expert and name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif per_expert and name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def _mtp_tensors(model, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One MTP layer: a copy of the first full-attention decoder layer plus the fc / pre-norms."""
    h = model.config.hidden_size
    sd = _hf_state_dict(model, per_expert=True)
    full = model.config.layer_types.index("full_attention")
    out = {
        f"mtp.layers.0.{k[len(f'model.layers.{full}.') :]}": v
        for k, v in sd.items()
        if k.startswith(f"model.layers.{full}.")
    }
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = 0.1 * torch.randn(h, generator=gen)
    return out


def write_checkpoint(
    model,
    path: str,
    per_expert: bool = True,
    language_model_prefix: bool = False,
    with_mtp: bool = False,
) -> str:
    """Write config.json + model.safetensors as a HF checkpoint would store them."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = _hf_state_dict(model, per_expert)
    if with_mtp:
        tensors.update(_mtp_tensors(model, torch.Generator().manual_seed(7)))
    cfg = model.config.to_dict()
    if with_mtp:
        cfg["mtp_num_hidden_layers"] = 1
    if language_model_prefix:
        tensors = {
            (f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k): v
            for k, v in tensors.items()
        }
        cfg = {
            "architectures": [cfg["architectures"][0].replace("ForCausalLM", "ForConditionalGeneration")],
            "model_type": "qwen3_5" if cfg["model_type"] == "qwen3_5_text" else "qwen3_5_moe",
            "text_config": cfg,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        }
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # a tied head is not stored
    save_file(
        {k: v.detach().clone().contiguous() for k, v in tensors.items()},
        os.path.join(path, "model.safetensors"),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def load_tqserve_model(path: str, dtype=torch.float32, device="cpu"):
    """Config + weights straight from the directory (no engine, no shared loader needed)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from tqserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    from tqserve.models.qwen3_next import Qwen3NextForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    classes = {
        "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
        "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
        "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
        "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
        "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    }
    model = classes[cfg.architectures[0]](cfg, dtype)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        model.load_weights((k, f.get_tensor(k)) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return model.to(device).eval()


# ---- a test-only driver ---------------------------------------------------------------------------


class SlotKVBackend(AttentionBackend):
    """Contiguous per-request KV ([slot, position]) in torch: writes this step's K/V, then attends over
    the stored sequence. Stands in for the engine's paged backend in model-level tests."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def forward(self, layer_idx, q, k, v, meta, scale):
        if layer_idx not in self.k:
            shape = (self.num_slots, self.max_len, *k.shape[1:])
            self.k[layer_idx] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v[layer_idx] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        out = torch.zeros_like(q)
        groups = q.shape[1] // k.shape[1]
        qsl = meta.query_start_loc_cpu
        for i in range(meta.num_reqs):
            s, e, slot, total = (
                qsl[i],
                qsl[i + 1],
                meta.seq_slots_cpu[i],
                meta.seq_lens_cpu[i],
            )
            if slot == 0 or e == s:
                continue
            start = total - (e - s)
            kc[slot, start:total], vc[slot, start:total] = k[s:e], v[s:e]
            ki = kc[slot, :total].transpose(0, 1).repeat_interleave(groups, 0)
            vi = vc[slot, :total].transpose(0, 1).repeat_interleave(groups, 0)
            qpos = torch.arange(start, total, device=q.device)[:, None]
            mask = torch.arange(total, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), ki, vi, attn_mask=mask, scale=scale)
            out[s:e] = o.transpose(0, 1)
        return out


def build_meta(batch: list[tuple[int, int, int]], device="cpu") -> AttentionMetadata:
    """batch: (seq_slot, num_context_tokens, num_new_tokens) per request, in step order."""
    qsl, seq_lens, positions = [0], [], []
    for _, ctx_len, new in batch:
        qsl.append(qsl[-1] + new)
        seq_lens.append(ctx_len + new)
        positions += list(range(ctx_len, ctx_len + new))
    slots = [s for s, _, _ in batch]
    n, t = len(batch), qsl[-1]

    def dev(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return AttentionMetadata(
        num_reqs=n,
        num_tokens=t,
        max_query_len=max(b[2] for b in batch),
        max_seq_len=max(seq_lens),
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=torch.zeros(n, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
        positions=dev(positions, torch.int64),
        seq_slots=dev(slots, torch.int32),
        sink_slots=torch.zeros(n, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        seq_slots_cpu=slots,
        sink_slots_cpu=[0] * n,
    )


class Driver:
    """Runs steps of several requests through a model: each request owns seq slot i + 1."""

    def __init__(self, model, num_slots: int = 16, max_len: int = 512) -> None:
        self.model = model
        device = next(model.parameters()).device
        self.device = device
        self.pool = StatePool(model.state_specs(), num_slots, device)
        self.backend = SlotKVBackend(num_slots, max_len)

    @torch.no_grad()
    def step(self, batch: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """batch: (slot, new token ids, number of tokens already processed). Returns float32 logits [T, V]."""
        meta = build_meta([(slot, ctx, len(ids)) for slot, ids, ctx in batch], self.device)
        ctx = ForwardContext(self.backend, meta)
        ctx.state_pool = self.pool
        ids = torch.tensor(
            [i for _, toks, _ in batch for i in toks],
            dtype=torch.int64,
            device=self.device,
        )
        hidden = self.model(ids, meta.positions, ctx)
        return self.model.compute_logits(hidden)

    def generate(self, prompts: list[list[int]], max_new: int, chunk: int = 4096) -> list[list[int]]:
        """Greedy continuous batching with chunked prefill (`chunk` prompt tokens per request per step)."""
        done = [0] * len(prompts)  # tokens processed
        seqs = [list(p) for p in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        while any(len(o) < max_new for o in out):
            batch, owners = [], []
            for i, seq in enumerate(seqs):
                if len(out[i]) >= max_new:
                    continue
                todo = seq[done[i] : done[i] + chunk]
                batch.append((i + 1, todo, done[i]))
                owners.append(i)
            logits = self.step(batch)
            end = 0
            for (_, todo, _), i in zip(batch, owners):
                end += len(todo)
                done[i] += len(todo)
                if done[i] == len(seqs[i]):  # the whole sequence is processed: sample the next token
                    tok = int(logits[end - 1].argmax())
                    out[i].append(tok)
                    seqs[i].append(tok)
        return out
