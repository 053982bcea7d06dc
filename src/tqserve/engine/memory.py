"""Size the KV page pool from the configuration at startup, and report what fits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tqserve.kvquant.base import LayerKVFormat

_DEFAULT_CPU_KV_BYTES = 256 << 20


@dataclass
class CapacityReport:
    num_blocks: int
    block_size: int
    page_bytes_per_token: int
    exact_buffer_bytes: int
    state_bytes: int
    token_capacity: int
    max_model_len: int
    max_concurrency: float

    def lines(self) -> list[str]:
        return [
            f"KV pages: {self.num_blocks - 1} x {self.block_size} tokens "
            f"({self.page_bytes_per_token} B/token, {self.token_capacity:,} tokens)",
            f"exact window/sink buffers: {self.exact_buffer_bytes / 2**20:.1f} MiB; "
            f"recurrent state: {self.state_bytes / 2**20:.1f} MiB",
            f"max concurrency at max_model_len={self.max_model_len}: {self.max_concurrency:.2f}x",
        ]


def page_bytes_per_token(formats: list[LayerKVFormat]) -> int:
    return sum(f.page_bytes_per_token() for f in formats)


def plan_num_blocks(
    formats: list[LayerKVFormat],
    block_size: int,
    device: torch.device,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None,
    override: int | None,
    reserved_bytes: int,
    max_model_len: int = 0,
) -> int:
    """Pages that fit: an explicit override, else the CPU budget (at least one max_model_len request's
    pages, so the defaults serve a whole context), else the GPU's share left after weights, the profiled
    activation peak and the fixed buffers (`reserved_bytes`)."""
    if override is not None:
        return override
    per_block = max(1, page_bytes_per_token(formats) * block_size)
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    elif device.type == "cuda":
        # Memory cached by torch's allocator but unused (an engine freed earlier in this process)
        # would otherwise count as taken.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * gpu_memory_utilization) - (total - free) - reserved_bytes
    else:
        budget = max(_DEFAULT_CPU_KV_BYTES, per_block * (-(-max_model_len // block_size) + 1))
    num = budget // per_block
    if num < 2:
        raise ValueError(
            f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB): raise "
            "gpu_memory_utilization / kv_cache_memory_bytes or lower max_num_batched_tokens"
        )
    return int(num)
