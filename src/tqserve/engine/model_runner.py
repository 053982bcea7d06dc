"""Owns the model, the KV pages, the attention backend and the sampler; runs one SchedulerOutput."""

from __future__ import annotations

import logging

import torch

from tqserve.attention.reference import KVCacheStore, ReferenceBackend
from tqserve.core.outputs import RunnerOutput, SchedulerOutput
from tqserve.engine.input_batch import InputBatchBuilder, build_sampling_batch, count_deferred_tokens
from tqserve.engine.memory import plan_num_blocks
from tqserve.engine.sampler import Sampler, prompt_logprobs, read_back, to_pinned_host
from tqserve.kvquant.base import ExactFormat, LayerKVFormat
from tqserve.layers.attention import ForwardContext
from tqserve.request import Request

logger = logging.getLogger(__name__)


def make_formats(model, preset: str, skip_layers: list[int], dtype: torch.dtype) -> list[LayerKVFormat]:
    """One KV format per attention layer; `auto` keeps pages in the model dtype, every other name
    (bfloat16 included: bf16 pages under a float32 model) comes from the preset table."""
    specs = model.kv_layer_specs()
    preset = {"bf16": "bfloat16"}.get(preset, preset)
    formats: list[LayerKVFormat] = []
    for i, (hkv, d) in enumerate(specs):
        name = "auto" if i in skip_layers else preset
        if name == "auto":
            formats.append(ExactFormat(hkv, d, dtype, i))
        else:
            from tqserve.kvquant.presets import make_layer_format

            formats.append(make_layer_format(name, i, hkv, d, dtype))
    return formats


class StepHandle:
    """A launched step: its inputs, hidden states and sampled tensors on the device, and on CUDA their
    copy to pinned host memory with an event after it, so that `collect` waits for this step only
    (with async scheduling the next step is already queued behind it)."""

    def __init__(self, runner: ModelRunner, inputs, hidden: torch.Tensor, sampled, requests: dict) -> None:
        self.runner, self.inputs, self.hidden, self.sampled, self.requests = runner, inputs, hidden, sampled, requests
        self.host: list[torch.Tensor] | None = None
        self.copied: torch.cuda.Event | None = None
        if sampled is not None and sampled[0][0].is_cuda:
            tokens, lp = sampled[0]
            self.host = [to_pinned_host(t) for t in (tokens, *(lp or ()))]
            self.copied = torch.cuda.Event()
            self.copied.record()

    def collect(self) -> RunnerOutput:
        return self.runner._collect(self)


class ModelRunner:
    def __init__(self, config, model, hf_config, device: torch.device, dtype: torch.dtype, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.model = model
        self.device = device
        self.dtype = dtype
        self.vocab_size = int(hf_config.vocab_size)
        self.max_num_tokens = config.max_num_batched_tokens
        self.formats = make_formats(model, config.kv_cache_dtype, config.kv_cache_dtype_skip_layers, dtype)
        self.sink = max((f.sink for f in self.formats), default=0)
        self.window = max((f.window for f in self.formats), default=0)
        self.state_specs = model.state_specs() if hasattr(model, "state_specs") else []
        self.num_seq_slots = config.max_num_seqs + 1
        self.num_ckpt_slots = (
            (config.num_state_checkpoints or 2 * config.max_num_seqs)
            if self.state_specs and config.enable_prefix_caching
            else 0
        )
        # Exact-window snapshots cached with the prefix (core/window_snapshots.py): a fixed pool, each
        # slot the size of one request's ring (default min(2 * max_num_seqs, 64)).
        self.num_snapshot_slots = 0
        if self.window and config.enable_prefix_caching:
            n = config.num_window_snapshots
            self.num_snapshot_slots = min(2 * config.max_num_seqs, 64) if n is None else n
        self.state_pool = None
        if self.state_specs:
            from tqserve.ops.gdn.state_pool import StatePool

            self.state_pool = StatePool(self.state_specs, self.num_seq_slots + self.num_ckpt_slots, device)
        state_bytes = self.state_pool.total_bytes() if self.state_pool is not None else 0
        reserved = self._profile_activation_bytes() if device.type == "cuda" else 0
        self.num_blocks = plan_num_blocks(
            self.formats,
            config.block_size,
            device,
            config.gpu_memory_utilization,
            config.kv_cache_memory_bytes,
            config.num_gpu_blocks_override,
            reserved + self._exact_bytes_estimate(),
            max_model_len,
        )
        self.store = KVCacheStore(
            self.formats,
            self.num_blocks,
            config.block_size,
            self.num_seq_slots,
            2 * config.max_num_seqs + 2,
            device,
            self.num_snapshot_slots,
        )
        self.state_bytes = state_bytes
        self.backend = self._make_backend()
        max_blocks = -(-max_model_len // config.block_size)
        gdn_chunk = 64 if self.state_specs and device.type == "cuda" else 0
        self.builder = InputBatchBuilder(
            self.max_num_tokens, config.max_num_seqs, max_blocks, config.block_size, device, gdn_chunk,
            self.window if self.num_snapshot_slots else 0,  # snapshot rows only where a snapshot pool exists
        )  # fmt: skip
        self.sampler = Sampler(device, config.seed)
        self.generators: dict[str, torch.Generator] = {}
        if device.type == "cuda" and config.kernel_warmup:
            self._warmup_kernels()
        self.graphs = self._capture_graphs()

    # ---- setup -------------------------------------------------------------------------------
    def _make_backend(self):
        choice = self.config.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from tqserve.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(self.store)
        if choice == "torch":
            from tqserve.attention.torch_paged import TorchPagedBackend

            return TorchPagedBackend(self.store)
        return ReferenceBackend(self.store)

    def _exact_bytes_estimate(self) -> int:
        total = 0
        for f in self.formats:
            per_tok = 2 * f.num_kv_heads * f.head_dim * torch.finfo(f.model_dtype).bits // 8
            ring_slots = self.num_seq_slots + (self.num_snapshot_slots + 1 if self.num_snapshot_slots else 0)
            total += per_tok * (ring_slots * f.window + (2 * self.config.max_num_seqs + 2) * f.sink)
        return total

    def _profile_activation_bytes(self) -> int:
        """Peak memory of the largest step (max_num_batched_tokens) beyond what is allocated now,
        measured with a throw-away pool of a few pages."""
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        bs = self.config.block_size
        # The largest step: max_num_batched_tokens tokens, as requests no longer than max_model_len
        # (positions must stay inside the model's rotary tables).
        n = min(self.max_num_tokens, (self.max_model_len - 1) * self.config.max_num_seqs)
        lens = [min(self.max_model_len - 1, n - i) for i in range(0, n, self.max_model_len - 1)]
        per_req = -(-max(lens) // bs)
        blocks = per_req * len(lens) + 1
        store = KVCacheStore(
            self.formats, blocks, bs, self.num_seq_slots, 2 * self.config.max_num_seqs + 2, self.device
        )
        saved, self.store = getattr(self, "store", None), store
        backend = self._make_backend()
        from tqserve.core.outputs import ScheduledRequest

        reqs = [
            ScheduledRequest(
                f"profile{i}", [0] * m, 0, list(range(1 + i * per_req, 1 + (i + 1) * per_req)), i + 1, 0, 0, True
            )
            for i, m in enumerate(lens)
        ]
        sched = SchedulerOutput(requests=reqs, num_tokens=n)
        gdn_chunk = 64 if self.state_specs else 0
        builder = InputBatchBuilder(n, len(lens), per_req, bs, self.device, gdn_chunk)
        inputs = builder.build(sched)
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, self._ctx(backend, inputs.meta))
            self.model.compute_logits(hidden[inputs.sample_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.store = saved
        del store, backend, hidden
        torch.cuda.empty_cache()
        return int(peak * 1.1) + (256 << 20)

    def _warmup_kernels(self) -> None:
        """Run one throw-away step of every shape class a real step can fall into, so that Triton
        compiles (and fla autotunes) each kernel specialization now rather than inside a request's
        step: decode, spec-verify widths 2..16 (the attention kernel's query-tile classes), split-K
        decode of one long request, and an extend chunk. Dummy requests write into pages, sequence
        and sink slots that no request owns yet; nothing is cached, and every real request starts
        from positions it writes itself (fresh recurrent state, its own ring and sink entries)."""
        from tqserve.core.outputs import ScheduledRequest

        bs, cfg = self.config.block_size, self.config
        usable_blocks = self.num_blocks - 1
        limit = min(self.max_model_len - 1, usable_blocks * bs)
        long_ctx = min(limit - 1, 8192)
        shapes = [(q, min(cfg.max_num_seqs, self.max_num_tokens // q), min(256, limit - q)) for q in (1, 2, 4, 8, 16)]
        # Split-K (one long request) and not (many requests) for decode and for extend chunks: the
        # kernels compile each variant separately.
        shapes += [(1, 1, long_ctx), (min(self.max_num_tokens, limit, 1024), 1, 0)]
        shapes += [(64, min(cfg.max_num_seqs, self.max_num_tokens // 64), min(256, limit - 64))]
        with torch.inference_mode():
            for qlen, nreq, ctx in shapes:
                if nreq < 1 or ctx < 0 or qlen > limit:
                    continue
                nblk = min(usable_blocks, -(-(ctx + qlen) // bs))
                reqs = [
                    ScheduledRequest(f"warmup{i}", [0] * qlen, ctx, list(range(1, nblk + 1)), i + 1, i + 1, 0, True)
                    for i in range(nreq)
                ]
                if self.builder.window:  # an exact-window snapshot row of the null slot: launched, writes nothing
                    reqs[0].ring_snapshots = [(ctx + qlen, 0)]
                inputs = self.builder.build(SchedulerOutput(requests=reqs, num_tokens=qlen * nreq))
                hidden = self.model(inputs.input_ids, inputs.positions, self._ctx(self.backend, inputs.meta))
                self.model.compute_logits(hidden[inputs.sample_indices])
            warm_up = getattr(self.backend, "warm_up", None)
            if warm_up is not None:
                warm_up()
        if self.state_pool is not None:
            for t in self.state_pool.conv + self.state_pool.ssm:
                t.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture_graphs(self):
        """Decode CUDA graphs (engine/cuda_graphs.py) where they apply: CUDA, the Triton backend
        (the torch backends loop over host lists), and not `enforce_eager`. Hybrid models' GDN
        layers decode through `gdn_decode`, which reads the state slots from the same metadata;
        padding rows use the null state slot 0."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            return None
        from tqserve.attention.triton_backend import TritonAttentionBackend

        if not isinstance(self.backend, TritonAttentionBackend):
            return None
        from tqserve.engine.cuda_graphs import DecodeGraphs, default_sizes

        sizes = cfg.cuda_graph_sizes or default_sizes(cfg.max_num_seqs)
        sizes = [b for b in sizes if b <= min(cfg.max_num_seqs, self.max_num_tokens)]
        if not sizes:
            return None
        graphs = DecodeGraphs(sizes, self.max_model_len)

        def forward(inputs):
            return self.model(inputs.input_ids, inputs.positions, self._ctx(self.backend, inputs.meta))

        graphs.capture(forward, self.builder, self.device)
        return graphs

    def _ctx(self, backend, meta) -> ForwardContext:
        ctx = ForwardContext(backend, meta)
        ctx.state_pool = self.state_pool
        return ctx

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(
        self, sched: SchedulerOutput, requests: dict[str, Request], prev: StepHandle | None = None
    ) -> StepHandle:
        """Enqueue one step's device work (inputs, forward, logits, sampling, the copy of the sampled
        tokens to the host) without waiting for it; `StepHandle.collect` waits for this step alone.
        `prev`: the step launched before, not collected yet (async scheduling): this step's deferred
        tokens are that step's samples, copied on the device. Every step's results are collected, in
        launch order, before the step after the next is launched."""
        size = self.graphs.size_for(sched) if self.graphs is not None else 0
        inputs = self.graphs.build(self.builder, sched, size) if size else self.builder.build(sched)
        if inputs.deferred_rows:
            if prev is None or prev.sampled is None:
                raise RuntimeError("a step with deferred tokens needs the step that samples them")
            self.builder.write_deferred(inputs, prev.inputs.sample_request_ids, prev.sampled[0][0])
        bs = self.config.block_size
        for slot, table, start in sched.ring_fills:
            pos = range(max(0, start - self.window), start)
            self.store.fill_ring_from_pages(slot, self._ids(pos), self._ids(table[p // bs] * bs + p % bs for p in pos))
        if sched.ring_restores:
            src, dst = zip(*sched.ring_restores)
            self.store.restore_ring(self._ids(src), self._ids(dst))
        if self.state_pool is not None and sched.state_restores:
            src, dst = zip(*sched.state_restores)
            self.state_pool.copy_slots(self._ids(src), self._ids(dst))
        if size:
            hidden = self.graphs.run(size, inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self._ctx(self.backend, inputs.meta))
        if self.state_pool is not None and sched.state_saves:
            src, dst = zip(*sched.state_saves)
            self.state_pool.copy_slots(self._ids(src), self._ids(dst))
        sampled = None
        if inputs.sample_request_ids:
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            reqs = [requests[r] for r in inputs.sample_request_ids]
            gens = [self._generator(r) for r in reqs]
            batch, counts = build_sampling_batch(reqs, gens, self.vocab_size, self.device)
            if batch.output_counts is not None and inputs.deferred_rows:
                # penalties count every output token: the previous step's samples are still on the device
                count_deferred_tokens(
                    batch, inputs.sample_request_ids, inputs.deferred_request_ids, prev.inputs.sample_request_ids,
                    prev.sampled[0][0],
                )  # fmt: skip
            sampled = (self.sampler.sample(logits, batch), counts)
        return StepHandle(self, inputs, hidden, sampled, requests)

    @torch.inference_mode()
    def _collect(self, h: StepHandle) -> RunnerOutput:
        inputs, hidden, requests = h.inputs, h.hidden, h.requests
        out = RunnerOutput()
        if h.sampled is not None:
            (tokens, lp), counts = h.sampled
            if h.host is not None:
                h.copied.synchronize()
                tokens, lp = h.host[0], (tuple(h.host[1:]) if lp is not None else None)
            result = read_back(tokens, lp, counts)
            for rid, tok, lp_row in zip(inputs.sample_request_ids, result.token_ids, result.logprobs):
                out.sampled[rid] = tok
                if lp_row is not None:
                    out.logprobs[rid] = lp_row
        for rid, row, n, start_pos in inputs.prompt_rows:
            req = requests[rid]
            sp = req.sampling_params
            # Rows whose next token is a prompt token. The full log-softmax (KV-quality evaluation)
            # also keeps the last prompt position's row, the distribution after the prompt, so a
            # case as long as the model's context is scored without a position beyond it.
            n_rows = min(n, req.num_prompt_tokens - start_pos) if sp.prompt_logprobs_full else 0
            n = min(n, req.num_prompt_tokens - 1 - start_pos)
            if max(n, n_rows) <= 0:
                continue
            nxt = torch.as_tensor(req.prompt_token_ids[start_pos + 1 : start_pos + 1 + max(n, 0)]).to(self.device)
            logits = self.model.compute_logits(hidden[row : row + max(n, n_rows)])
            out.prompt_logprobs[rid] = prompt_logprobs(logits, nxt, sp.prompt_logprobs or 0, sp.prompt_logprobs_full)
        return out

    def _ids(self, values) -> torch.Tensor:
        return torch.as_tensor(list(values), dtype=torch.int64).to(self.device, non_blocking=True)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.greedy:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[req.request_id] = gen
        return gen

    def free(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
