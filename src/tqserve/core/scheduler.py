"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

No torch (invariant 6). Each step spends a token budget: running requests first (decodes and
continuing prefill chunks, oldest first), then waiting requests in arrival order. When pages run
out, the newest running request is preempted: its pages are freed and it later recomputes from
whatever the prefix cache still holds. No request is ever lost or duplicated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tqserve.core.kv_cache_manager import KVCacheManager
from tqserve.core.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from tqserve.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- request lifecycle ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.begin_step()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_output and req.num_output_tokens + req.num_pending_output >= req.max_tokens:
                i += 1  # its last token is being sampled: the update finishes it
                continue
            n = self._chunk(req, req.num_computed_tokens, budget)
            if n <= 0 or req.num_pending_output and self.kv.needs_known_tokens(req, req.num_computed_tokens + n):
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                self._emit(req, n, out)
                budget -= n
                i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending_output:
                break  # preempted while its token was being sampled: admitted once it is known
            pages, hit, resume, ckpt, snap = self.kv.lookup_prefix(req)
            n = self._chunk(req, resume, budget)
            if n <= 0:
                break
            # Hits count the tokens whose computation is skipped (a window or a state checkpoint
            # may resume earlier than the shared pages reach).
            if not self.kv.admit(req, pages, resume):
                break
            req.num_computed_tokens = resume
            if not self.kv.allocate_slots(req, n):
                self.kv.free(req)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = resume
            req.num_page_tokens_cached = hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if ckpt is not None:
                out.state_restores.append((ckpt, self.kv.seq_slot[req.request_id]))
            if resume > 0 and self.kv.layout.window:
                rid = req.request_id
                if snap is not None:
                    out.ring_restores.append((snap, self.kv.seq_slot[rid]))
                    self.kv.snapshot_hits += 1
                else:
                    out.ring_fills.append((self.kv.seq_slot[rid], list(self.kv.block_tables[rid]), resume))
                    self.kv.snapshot_floor[rid] = hit + self.kv.layout.window
            self._emit(req, n, out)
            budget -= n
        return out

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens to compute for `req` from `start` within `budget` (0: wait for the next step)."""
        n = req.num_tokens + req.num_pending_output - start
        if n > budget:
            if not self.config.enable_chunked_prefill:
                return 0
            n = budget
        lay = self.kv.layout
        if lay.has_state and lay.enable_prefix_caching and n > 1:
            # End prefill chunks where a state checkpoint is wanted: every checkpoint_interval
            # tokens and at the prompt's last full block.
            end = start + n
            bs, iv = lay.block_size, lay.checkpoint_interval
            cuts = [(end - 1) // iv * iv, (req.num_tokens - 1) // bs * bs]
            cuts = [c for c in cuts if start < c < end]
            if cuts:
                n = min(cuts) - start
        return n

    def _emit(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """Schedule tokens [start, start + n) of `req` and count them computed: the step's update only
        fills in the tokens it samples (so the next step can be scheduled before that, `deferred`)."""
        start = req.num_computed_tokens
        rid = req.request_id
        known = req.num_tokens
        sample = start + n == known + req.num_pending_output
        deferred = start + n > known  # the last token is the one being sampled (0: a placeholder)
        req.num_computed_tokens = start + n
        req.num_pending_output += sample
        out.requests.append(
            ScheduledRequest(
                request_id=rid,
                token_ids=[req.token_at(p) if p < known else 0 for p in range(start, start + n)],
                start_pos=start,
                block_table=self.kv.block_tables[rid],
                seq_slot=self.kv.seq_slot[rid],
                sink_slot=self.kv.sink_slot(rid),
                num_page_tokens_cached=req.num_page_tokens_cached,
                sample=sample,
                want_prompt_logprobs=start < req.num_prompt_tokens
                and (req.sampling_params.prompt_logprobs is not None or req.sampling_params.prompt_logprobs_full),
                ring_snapshots=self.kv.snapshot_captures(req, start, start + n),
                deferred=deferred,
            )
        )
        out.num_tokens += n
        ckpt = self.kv.checkpoint_slot_for(req, start + n, prefill=not sample or n > 1)
        if ckpt is not None:
            out.state_saves.append((self.kv.seq_slot[rid], ckpt))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_page_tokens_cached = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted_ids.append(req.request_id)

    # ---- after the runner -------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Append the step's sampled tokens, register newly full blocks, stop requests. Returns the
        requests that changed. A request may have been preempted since it was scheduled (async
        scheduling): its token still counts, its pages are gone."""
        changed = []
        for s in sched.requests:
            req = self.requests.get(s.request_id)
            if req is None:  # finished or aborted meanwhile
                continue
            token = result.sampled.get(s.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                req.num_pending_output -= 1
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)
            if token is not None:
                self._check_stop(req, token)
            changed.append(req)
        return changed

    def _check_stop(self, req: Request, token: int) -> None:
        sp = req.sampling_params
        n_out = req.num_output_tokens
        status = None
        if n_out >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in sp.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
        if status is not None:
            self.finish_request(req.request_id, status)
