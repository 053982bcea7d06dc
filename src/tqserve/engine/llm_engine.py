"""add_request / step / abort: the synchronous engine every front end (offline LLM, server) drives."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tqserve.config import EngineArgs
from tqserve.core.kv_cache_manager import CacheLayout, KVCacheManager
from tqserve.core.outputs import RunnerOutput, SchedulerOutput
from tqserve.core.scheduler import Scheduler, SchedulerConfig
from tqserve.engine.memory import CapacityReport, page_bytes_per_token
from tqserve.engine.model_runner import ModelRunner, StepHandle
from tqserve.engine.output_processor import OutputProcessor, ParentState, SampleState
from tqserve.outputs import CompletionOutput, RequestOutput
from tqserve.request import Request, RequestStatus
from tqserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    max_model_len: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device


def _read_template(value: str) -> str:
    """--chat-template takes a file path or the Jinja text itself, as in vLLM."""
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: tuple | None = None) -> None:
        """`loaded`: an already loaded (model, hf_config, tokenizer) to share weights between
        engines (tests and evaluations compare configurations on one model); the caller vouches
        that it matches args.model, dtype and device."""
        from tqserve.models.loader import load_model

        self.args = args
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        torch.manual_seed(args.seed)
        t0 = time.monotonic()
        model, hf_config, tokenizer = loaded or load_model(args.model, dtype, device)
        self.tokenizer = tokenizer
        if args.chat_template is not None:
            tokenizer.hf.chat_template = _read_template(args.chat_template)
        model_max = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
        max_model_len = args.max_model_len or model_max
        if max_model_len > model_max:
            # Positions past the model's rotary table would fail inside a step (vLLM refuses too).
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's max_position_embeddings ({model_max})"
            )
        if args.max_num_batched_tokens is None:
            default = 8192 if device.type == "cuda" else 2048
            args.max_num_batched_tokens = default if args.enable_chunked_prefill else max(default, max_model_len)
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({args.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) when chunked prefill is disabled"
            )
        self.model_config = ModelConfig(
            model=args.model or "SmolLM2-135M-Instruct",
            max_model_len=max_model_len,
            vocab_size=int(hf_config.vocab_size),
            dtype=dtype,
            device=device,
        )
        self.runner = ModelRunner(args, model, hf_config, device, dtype, max_model_len)
        r = self.runner
        layout = CacheLayout(
            num_blocks=r.num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=args.enable_prefix_caching,
            sink=r.sink,
            window=r.window,
            has_state=bool(r.state_specs),
            num_checkpoint_slots=r.num_ckpt_slots,
            checkpoint_interval=args.mamba_checkpoint_interval,
            num_snapshot_slots=r.num_snapshot_slots,
            cache_salt=hash(
                (self.model_config.model, args.kv_cache_dtype, str(dtype), tuple(args.kv_cache_dtype_skip_layers))
            ),
        )
        self.kv = KVCacheManager(layout)
        # The longest request the pages can hold: one that outgrew them alone would be preempted and
        # recomputed forever, so prompts past it are refused and max_tokens is clamped to it.
        self.max_request_len = min(max_model_len, (r.num_blocks - 1) * args.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_model_len, args.enable_chunked_prefill),
            self.kv,
        )
        self.processor = OutputProcessor(tokenizer)
        # Process step N's outputs while step N + 1 runs on the device (`step`); tests switch it on CPU.
        self.async_output_proc = device.type == "cuda" and not args.disable_async_output_proc
        self._pending: tuple[list[Request], RunnerOutput] | None = None
        # Launch step N + 1 before step N is read back (`step`); tests switch it on CPU.
        self.async_scheduling = device.type == "cuda" and args.async_scheduling
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        self.eos_ids = frozenset(tokenizer.stop_token_ids)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.load_seconds = time.monotonic() - t0
        for line in self.capacity_report().lines():
            logger.info(line)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> None:
        ids = list(prompt_token_ids)
        self._validate(request_id, ids, params)
        max_len = self.max_request_len
        max_tokens = min(params.max_tokens or max_len, max_len - len(ids))
        samples = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params if params.n == 1 else params.clone_for_child(i)
            req = Request(child_id, ids, child_params, max_tokens, self.eos_ids, parent_id=request_id, index=i)
            detok = self.tokenizer.detokenizer(ids, skip_special_tokens=params.skip_special_tokens)
            samples.append(SampleState(req, detok, CompletionOutput(index=i)))
        self.processor.add(ParentState(request_id, prompt, ids, samples))
        for s in samples:
            self.scheduler.add_request(s.request)

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self.processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of the vocabulary [0, {vocab})")
        if len(ids) >= self.model_config.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within max_model_len "
                f"({self.model_config.max_model_len})"
            )
        if len(ids) >= self.max_request_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, which leaves no room to generate within the KV cache's "
                f"{self.max_request_len} tokens ({self.runner.num_blocks - 1} pages of {self.args.block_size}): "
                "raise kv_cache_memory_bytes / gpu_memory_utilization or shorten the prompt"
            )
        if params.n > self.args.max_num_seqs:
            raise ValueError(f"n ({params.n}) must be <= max_num_seqs ({self.args.max_num_seqs})")

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outs = []
        for pid in request_ids:
            parent = self.processor.parents.get(pid)
            if parent is None:
                continue
            for s in parent.samples:
                self.scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_ABORTED)
                self.runner.free(s.request.request_id)
            out = self.processor.abort(pid)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None or self._inflight is not None

    @property
    def num_samples_in_flight(self) -> int:
        """Tokens the launched, not yet collected step samples (async scheduling)."""
        return sum(s.sample for s in self._inflight[0].requests) if self._inflight is not None else 0

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step: collect the step on the device, update the scheduler with its tokens.

        - `async_output_proc`: the outputs of the step before are processed while this one runs on the
          device and returned now; this step's come with the next call. A request that a stop string
          ends there has been scheduled once more meanwhile: that token is dropped (`Scheduler.update`
          skips finished requests).
        - `async_scheduling`: the step after this one is scheduled and launched before this one is
          read back, its decode tokens written on the device from this step's samples
          (`ScheduledRequest.deferred`), so the device goes from step to step without waiting for the
          host. A request that this step finishes (EOS, stop id) is then in the next step too: its
          token is dropped the same way.

        Pages and slots freed while a step is in flight are reused only by work enqueued after it, on
        the same stream."""
        if self._inflight is None:
            sched = self._schedule()
            if sched is None:
                return self._process_pending()
            self._inflight = (sched, self.runner.launch(sched, self.scheduler.requests))
        sched, handle = self._inflight
        self._inflight = None
        outs = self._process_pending()  # overlaps the device work in flight
        if self.async_scheduling and self._can_schedule_ahead(sched):
            nxt = self._schedule()
            if nxt is not None:
                self._inflight = (nxt, self.runner.launch(nxt, self.scheduler.requests, prev=handle))
        result = handle.collect()
        changed = self.scheduler.update(sched, result)
        now = time.monotonic()
        for req in changed:
            if req.request_id in result.sampled:
                self.num_generation_tokens += 1
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.metrics.last_token_time = now
        self._pending = (changed, result)
        if not self.async_output_proc:
            outs += self._process_pending()
        return outs

    def _schedule(self) -> SchedulerOutput | None:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        now = time.monotonic()
        for s in sched.requests:
            req = self.scheduler.requests[s.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if s.start_pos < req.num_prompt_tokens:
                self.num_prompt_tokens += min(len(s.token_ids), req.num_prompt_tokens - s.start_pos)
        return sched

    def _can_schedule_ahead(self, inflight: SchedulerOutput) -> bool:
        """Whether the next step can be launched before `inflight` is read back: not after a step with
        prompt-logprob rows (reading those back waits for the whole stream anyway). Penalties count
        the samples still on the device there (`count_deferred_tokens`)."""
        return not any(s.want_prompt_logprobs for s in inflight.requests)

    def _process_pending(self) -> list[RequestOutput]:
        """Outputs of the last updated step: detokenize, apply stop strings, build RequestOutputs."""
        if self._pending is None:
            return []
        changed, result = self._pending
        self._pending = None
        outs, stop_now = self.processor.process(changed, result.logprobs, result.prompt_logprobs)
        for rid in stop_now:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        for req in changed:
            if req.status.finished or req.request_id in stop_now:
                self.runner.free(req.request_id)
        return outs

    # ---- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "window_snapshot_hits": self.kv.snapshot_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": self.kv.pool.num_free,
            "num_total_blocks": self.kv.pool.num_blocks - 1,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "cuda_graph_replays": self.runner.graphs.replays if self.runner.graphs is not None else 0,
        }

    def capacity_report(self) -> CapacityReport:
        r = self.runner
        cap = (r.num_blocks - 1) * self.args.block_size
        return CapacityReport(
            num_blocks=r.num_blocks,
            block_size=self.args.block_size,
            page_bytes_per_token=page_bytes_per_token(r.formats),
            exact_buffer_bytes=r.store.exact_bytes(),
            state_bytes=r.state_bytes,
            token_capacity=cap,
            max_model_len=self.model_config.max_model_len,
            max_concurrency=cap / self.model_config.max_model_len,
        )
