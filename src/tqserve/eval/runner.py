"""How the evaluations get next-token log-probabilities and greedy continuations for a preset.

`EngineRunner` goes through the engine (`tqserve.LLM`, prompt attention reading the quantized cache).
`DirectRunner` is the fallback used while the engine entry point is missing: the same model and the
same reference attention backend (`attention/reference.py`) over the same KV formats, driven with
hand-built metadata for one request (one prefill of the whole window, then one token per decode
step). Both read what is stored (invariant 1), so their numbers agree up to float rounding.
"""

from __future__ import annotations

import torch

from tqserve.attention.backend import AttentionMetadata
from tqserve.kvquant.presets import make_layer_format


def make_runner(preset: str, max_model_len: int, backend: str = "auto", skip_layers=(), device: str = "cpu"):
    """`device` "cuda" runs the engine on the GPU in float32 with the reference attention backend
    (the same math as the CPU run; call `strict_fp32()` first so no matmul uses TF32)."""
    if backend in ("auto", "engine"):
        try:
            from tqserve.entrypoints.llm import LLM  # noqa: F401
        except ImportError:
            if backend == "engine":
                raise
        else:
            return EngineRunner(preset, max_model_len, skip_layers=skip_layers, device=device)
    if device != "cpu":
        raise ValueError("the direct runner is CPU only")
    return DirectRunner(preset, max_model_len, skip_layers=skip_layers)


def strict_fp32() -> None:
    """Full float32 matmuls on the GPU (no TF32), so GPU numbers are the CPU math up to rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


class EngineRunner:
    kind = "engine"

    chunk = 1024  # prefill chunk (max_num_batched_tokens): bounds the reference backend's score tensors

    def __init__(self, preset: str, max_model_len: int, skip_layers=(), device: str = "cpu") -> None:
        from tqserve.entrypoints.llm import LLM

        self.preset = preset
        gpu = device != "cpu"
        # One set of weights shared by every preset's engine; room for the prompt plus one token.
        self.llm = LLM(
            loaded=_load_default_model(device),
            dtype="float32",
            device=device,
            # GPU: the torch reference backend (same math as the CPU path), not the Triton kernels
            attention_backend="reference" if gpu else "auto",
            kv_cache_dtype=preset,
            kv_cache_dtype_skip_layers=list(skip_layers),
            max_model_len=min(max_model_len + 16, _model_max(device)),
            enable_prefix_caching=False,
            max_num_batched_tokens=self.chunk,
            # Generous request slots: each sink-preset request holds a sink slot (2 * max_num_seqs + 2
            # of them) and, without prefix caching, the engine does not hand them back (see report).
            max_num_seqs=64,
            kv_cache_memory_bytes=_kv_bytes(max_model_len + 16),
        )
        self.tokenizer = self.llm.get_tokenizer()

    def logprobs(self, token_ids: list[int], last: int | None = None) -> torch.Tensor:
        if last is None:
            return self.llm.prompt_logprobs_full(token_ids).float()
        # Only the rows predicting the last tokens: the final token is never an input, so a case as
        # long as the model's context fits (its prefix and the distribution after it).
        return self.llm.prompt_logprobs_full(token_ids[:-1], include_last=True).float()[-last:]

    def greedy(self, token_ids: list[int], max_tokens: int) -> list[int]:
        from tqserve.sampling_params import SamplingParams

        out = self.llm.generate(
            [{"prompt_token_ids": token_ids}],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        return list(out[0].outputs[0].token_ids)


_SHARED: dict = {}


def _kv_bytes(tokens: int) -> int:
    # Enough for one request at the exact float32 size of the default model (30 layers, 3 KV heads,
    # d = 64) whatever the preset, with slack for the null page and partial blocks.
    return max(64 << 20, int(tokens * 30 * 3 * 64 * 2 * 4 * 1.25))


def _model_max(device: str) -> int:
    hf_config = _load_default_model(device)[1]
    return int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)


def _load_default_model(device: str = "cpu"):
    if device not in _SHARED:
        from tqserve.models.loader import load_model

        if device == "cpu":
            _SHARED[device] = load_model(None, torch.float32, device)
        else:
            # The loader serves GPUs in bfloat16 only; the evaluation wants float32 everywhere, so
            # load on the CPU and move the module (weights and rotary tables are parameters/buffers).
            model, hf_config, tok = load_model(None, torch.float32, "cpu")
            _SHARED[device] = (model.to(device), hf_config, tok)
    return _SHARED[device]


class DirectRunner:
    """One request at a time through model.forward + ReferenceBackend, pages allocated per call."""

    kind = "direct"
    block_size = 16

    def __init__(self, preset: str, max_model_len: int, skip_layers=()) -> None:
        from tqserve.attention.reference import KVCacheStore, ReferenceBackend

        self.model, self.hf_config, self.tokenizer = _load_default_model()
        self.preset = preset
        self.max_model_len = max_model_len
        specs = self.model.kv_layer_specs()
        self.formats = [
            make_layer_format(preset, i, hkv, d, torch.float32, skip_layers=skip_layers)
            for i, (hkv, d) in enumerate(specs)
        ]
        self.num_blocks = max_model_len // self.block_size + 2  # + the null page
        self.store = KVCacheStore(self.formats, self.num_blocks, self.block_size, 2, 2, torch.device("cpu"))
        self.backend = ReferenceBackend(self.store)

    def _meta(self, start: int, n: int) -> AttentionMetadata:
        bs = self.block_size
        pos = torch.arange(start, start + n)
        table = torch.arange(1, self.num_blocks, dtype=torch.int32)  # pages 1.. (page 0 is null)
        slots = table[pos // bs].long() * bs + pos % bs
        return AttentionMetadata(
            num_reqs=1,
            num_tokens=n,
            max_query_len=n,
            max_seq_len=start + n,
            query_start_loc=torch.arange(2, dtype=torch.int32) * n,
            seq_lens=torch.full((1,), start + n, dtype=torch.int32),
            block_tables=table[None],
            slot_mapping=slots,
            positions=pos,
            seq_slots=torch.ones(1, dtype=torch.int32),
            sink_slots=torch.ones(1, dtype=torch.int32),
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[start + n],
            seq_slots_cpu=[1],
            sink_slots_cpu=[1],
            block_tables_cpu=[list(range(1, self.num_blocks))],
            slot_mapping_cpu=[],
        )

    @torch.inference_mode()
    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        from tqserve.layers.attention import ForwardContext

        n = len(ids)
        meta = self._meta(start, n)
        ctx = ForwardContext(self.backend, meta)
        hidden = self.model(torch.as_tensor(ids, dtype=torch.int64), meta.positions, ctx)
        return hidden

    def logprobs(self, token_ids: list[int], last: int | None = None) -> torch.Tensor:
        """Like EngineRunner.logprobs: the rows predicting tokens 1.., or only the `last` of them."""
        with torch.inference_mode():
            hidden = self._forward(token_ids, 0)[:-1]
            if last is not None:
                hidden = hidden[-last:]
            return torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)

    def greedy(self, token_ids: list[int], max_tokens: int) -> list[int]:
        out: list[int] = []
        with torch.inference_mode():
            hidden = self._forward(token_ids, 0)
            nxt = int(self.model.compute_logits(hidden[-1:]).argmax(-1)[0])
            pos = len(token_ids)
            stops = set(self.tokenizer.stop_token_ids)
            for _ in range(max_tokens):
                out.append(nxt)
                if nxt in stops:
                    break
                hidden = self._forward([nxt], pos)
                pos += 1
                nxt = int(self.model.compute_logits(hidden[-1:]).argmax(-1)[0])
        return out
