"""CUDA graphs for decode steps: capture the model forward once per batch size, replay it per step.

A decode step of a small model is launch-bound: ~30 layers x tens of kernels, each launched from
Python, cost far more host time than the GPU spends on them. Replaying a captured graph issues the
whole forward at once.

How a step fits a captured graph: the input-batch builder writes every step into the same
persistent device buffers (invariant 3), so a graph captured on views of those buffers reads each
step's inputs in place. A step of n one-token requests is padded to the next captured size B with
requests that write nothing (slot -1) and read only the null page / sequence slot / sink slot, and
its metadata carries the graph's fixed `max_seq_len` (max_model_len), so every launch grid and
split count is the captured one. Exact-window snapshots due this step ride along: a graph step
carries one snapshot row per request, the rows of requests without one name the null slot and write
nothing (`attention/exact_refresh.py`). Steps a graph cannot serve run eagerly: prefill or verify
tokens, prompt logprobs, more requests than the largest size.

Warmup is capture (invariant 4): each size runs the same padded step eagerly first, which compiles
every Triton specialization it reaches, then the same step is captured; a host sync inside the
capture fails it loudly (CUDA refuses it during capture).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tqserve.core.outputs import SchedulerOutput
from tqserve.engine.input_batch import InputBatchBuilder, StepInputs

logger = logging.getLogger(__name__)


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, every 32 to 512 (a step pads at most 8
    requests or a quarter of its size), capped at max_num_seqs, which is always included."""
    cap = min(max_num_seqs, 512)
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16), *range(288, 513, 32)]
    return sorted({b for b in sizes if b < cap} | {cap})


class DecodeGraphs:
    """One captured forward per decode batch size, sharing one memory pool."""

    def __init__(self, sizes: list[int], max_seq_len: int) -> None:
        self.sizes = sorted(set(sizes))
        self.max_seq_len = max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def size_for(self, sched: SchedulerOutput) -> int:
        """The captured size a step pads to, or 0 when it must run eagerly."""
        reqs = sched.requests
        if not reqs or len(reqs) > self.sizes[-1]:
            return 0
        for s in reqs:
            if len(s.token_ids) != 1 or len(s.ring_snapshots) > 1 or s.want_prompt_logprobs:
                return 0
        return self.sizes[bisect.bisect_left(self.sizes, len(reqs))]

    def build(self, builder: InputBatchBuilder, sched: SchedulerOutput, size: int) -> StepInputs:
        return builder.build(sched, pad_to=size, max_seq_len=self.max_seq_len)

    def capture(self, forward, builder: InputBatchBuilder, device: torch.device) -> None:
        """Warm up, then capture, every size (largest first: later graphs reuse its pool blocks).
        `forward(inputs)` runs the model and returns the hidden states."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                empty = SchedulerOutput(requests=[], num_tokens=0)
                # compiles every kernel specialization of this shape, outside the capture
                forward(self.build(builder, empty, size))
                torch.cuda.synchronize(device)
                # Fresh metadata: what the forward caches on it (e.g. each token's request index)
                # must be computed inside the graph, not taken from the eager run.
                inputs = self.build(builder, empty, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = forward(inputs)
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (sizes %s) in %.1f s", len(self.sizes), self.sizes,
                    time.perf_counter() - t0)  # fmt: skip

    def run(self, size: int, inputs: StepInputs) -> torch.Tensor:
        """Run the captured forward of `size` on `inputs`, which the builder just wrote into the
        buffers the graph reads; returns its hidden states [size, hidden] (padding rows included)."""
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size]
