"""Engine arguments with vLLM's names, validated once; everything else derives from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct, GGUF)
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: list[int] = field(default_factory=list)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU: KV pool size (default 256 MiB)
    num_gpu_blocks_override: int | None = None
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | reference | triton
    mamba_checkpoint_interval: int = 512  # hybrid models: tokens between prefill state checkpoints
    num_state_checkpoints: int | None = None  # hybrid models: checkpoint slots (default 2*max_num_seqs)
    # Presets with an exact window W: exact-window snapshots cached with the prefix, each the size of
    # one request's window (default min(2*max_num_seqs, 64); 0: none, prefix hits recompute W tokens).
    num_window_snapshots: int | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    disable_log_stats: bool = True
    # CUDA: compile every attention / GDN kernel shape class at startup (throw-away steps) instead
    # of inside the first requests' steps. Off by default until it has run on the GPU.
    kernel_warmup: bool = False
    # CUDA decode steps replay captured CUDA graphs (engine/cuda_graphs.py): one graph per batch size
    # in cuda_graph_sizes (default: 1, 2, 4, 8, then steps of 8 / 16 / 32 up to min(max_num_seqs,
    # 512)); a step is padded to the next captured size. enforce_eager turns them off (vLLM's flag).
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    # CUDA: a step's outputs (detokenization, stop strings, RequestOutputs) are processed while the
    # next step runs on the device, so step() returns them one step later (vLLM's
    # --disable-async-output-proc turns it off). On CPU there is nothing to overlap: off.
    disable_async_output_proc: bool = False
    # CUDA: schedule and launch step N + 1 before step N's tokens are read back; its decode tokens are
    # written on the device from step N's samples, so the GPU does not wait for the host between
    # steps (vLLM's --async-scheduling). Steps where a request uses penalties run one at a time.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.mamba_checkpoint_interval % self.block_size:
            raise ValueError(
                f"mamba_checkpoint_interval ({self.mamba_checkpoint_interval}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if self.num_window_snapshots is not None and self.num_window_snapshots < 0:
            raise ValueError(f"num_window_snapshots must be >= 0, got {self.num_window_snapshots}")
        if self.cuda_graph_sizes is not None and (
            not self.cuda_graph_sizes or any(int(b) < 1 for b in self.cuda_graph_sizes)
        ):
            raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}")
        if self.attention_backend not in ("auto", "torch", "reference", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch, reference or triton, got {self.attention_backend!r}"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
        return cls(**kwargs)
