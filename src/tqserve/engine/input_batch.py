"""The host/device boundary (invariant 2): Python lists from the scheduler become device tensors here,
through pinned host buffers and non-blocking copies into persistent device buffers sized at
startup (invariant 3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tqserve.attention.backend import AttentionMetadata, RingSnapshots
from tqserve.core.outputs import SchedulerOutput
from tqserve.engine.sampler import SamplingBatch
from tqserve.request import Request


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # Rows of the hidden states whose logits are sampled, one per request with sample=True.
    sample_indices: torch.Tensor
    sample_request_ids: list[str]
    # Prompt-logprob rows: (request id, first flat row, number of rows, position of the first row).
    prompt_rows: list[tuple[str, int, int, int]]
    # Async scheduling: flat rows whose token the previous step is sampling, and those requests' ids
    # (`ScheduledRequest.deferred`); the runner writes them into input_ids on the device.
    deferred_rows: list[int] | None = None
    deferred_request_ids: list[str] | None = None


class _Buffer:
    """A pinned host tensor and its persistent device twin."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if pin else self.host
        self.pinned = pin

    def upload(self, n: int) -> torch.Tensor:
        if self.pinned:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class InputBatchBuilder:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        gdn_chunk: int = 0,
        window: int = 0,
    ) -> None:
        self.device = device
        # Hybrid models on CUDA: fla's chunk indices, built here so no kernel wrapper syncs.
        self.gdn_chunk = gdn_chunk
        self.block_size = block_size
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = _Buffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_reqs,), torch.int32, device)
        self.seq_slots = _Buffer((max_num_reqs,), torch.int32, device)
        self.sink_slots = _Buffer((max_num_reqs,), torch.int32, device)
        self.block_tables = _Buffer((max_num_reqs, max_blocks_per_seq), torch.int32, device)
        # Per block-table row: the request's page list last written there and how many entries of it
        # were. Page lists only grow while a request runs (a preempted one gets a new list), so a row
        # whose list is the same object needs only its new entries: a 64-request decode step at 4K
        # context otherwise converts 64 lists of 257 ints every step. The reference keeps the list
        # alive, so its identity cannot be reused by another request's list.
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_num_reqs
        self.sample_idx = _Buffer((max_num_reqs,), torch.int64, device)
        # Async scheduling: (row, index into the previous step's sampled tokens) of deferred tokens
        self.deferred = _Buffer((2, max_num_reqs), torch.int64, device)
        # With async scheduling a step is built while the one before may not have consumed its
        # uploads: the pinned buffers are rewritten only after this event (recorded after them).
        self._uploaded: torch.cuda.Event | None = None
        # Exact-window snapshots (presets with a window): at most two per request and step.
        self.window = window
        if window:
            self.snap_pos = _Buffer((2 * max_num_reqs, window), torch.int64, device)
            self.snap_info = _Buffer((4, 2 * max_num_reqs), torch.int64, device)

    def build(self, sched: SchedulerOutput, pad_to: int = 0, max_seq_len: int = 0) -> StepInputs:
        """`pad_to` > number of requests (CUDA-graph decode steps) appends one-token padding requests
        that write nothing (slot -1) and read only the null page, sequence slot and sink slot; the
        metadata then describes the padded batch, with `max_seq_len` the graph's fixed bound so that
        every launch shape is the captured one."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        bs = self.block_size
        t = 0
        qsl = [0]
        deferred_rows, deferred_ids = [], []
        seq_lens, seq_slots, sink_slots, tables, slot_map = [], [], [], [], []
        sample_rows, sample_ids, prompt_rows_host = [], [], []
        snaps = []  # (boundary, start, first token row, sequence slot, snapshot slot)
        ids_np, pos_np, slot_np = self.input_ids.np, self.positions.np, self.slot_mapping.np
        bt_np = self.block_tables.np
        rows = self._rows
        for i, s in enumerate(sched.requests):
            n = len(s.token_ids)
            table, (last, written) = s.block_table, rows[i]
            if last is not table or len(table) < written:
                bt_np[i, : len(table)] = table
                rows[i] = (table, len(table))
            elif len(table) > written:
                bt_np[i, written : len(table)] = table[written:]
                rows[i] = (table, len(table))
            if n == 1:
                # A decode row: scalar arithmetic (numpy's per-call overhead is most of a row's cost).
                p = s.start_pos
                slot = -1 if p < s.num_page_tokens_cached else s.block_table[p // bs] * bs + p % bs
                ids_np[t] = s.token_ids[0]
                pos_np[t] = p
                slot_np[t] = slot
                slot_map.append(slot)
            else:
                pos = np.arange(s.start_pos, s.start_pos + n)
                ids_np[t : t + n] = s.token_ids
                pos_np[t : t + n] = pos
                slots = bt_np[i, pos // bs].astype(np.int64) * bs + pos % bs
                slots[pos < s.num_page_tokens_cached] = -1  # shared pages already hold these tokens
                slot_np[t : t + n] = slots
                slot_map.extend(slots.tolist())
            tables.append(s.block_table)
            seq_lens.append(s.start_pos + n)
            seq_slots.append(s.seq_slot)
            sink_slots.append(s.sink_slot)
            if s.sample:
                sample_rows.append(t + n - 1)
                sample_ids.append(s.request_id)
            if s.want_prompt_logprobs:
                prompt_rows_host.append((s.request_id, t, n, s.start_pos))
            if s.deferred:
                deferred_rows.append(t + n - 1)
                deferred_ids.append(s.request_id)
            snaps.extend((b, s.start_pos, t, s.seq_slot, slot) for b, slot in s.ring_snapshots)
            t += n
            qsl.append(t)
        for i in range(len(sched.requests), pad_to):
            ids_np[t] = 0
            pos_np[t] = 0
            slot_np[t] = -1
            slot_map.append(-1)
            bt_np[i] = 0
            rows[i] = (None, 0)
            tables.append([0])
            seq_lens.append(1)
            seq_slots.append(0)
            sink_slots.append(0)
            t += 1
            qsl.append(t)
        r = len(qsl) - 1
        self.query_start_loc.np[: r + 1] = qsl
        self.seq_lens.np[:r] = seq_lens
        self.seq_slots.np[:r] = seq_slots
        self.sink_slots.np[:r] = sink_slots
        self.sample_idx.np[: len(sample_rows)] = sample_rows
        meta = AttentionMetadata(
            num_reqs=r,
            num_tokens=t,
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(r)),
            max_seq_len=max(max(seq_lens), max_seq_len),
            query_start_loc=self.query_start_loc.upload(r + 1),
            seq_lens=self.seq_lens.upload(r),
            block_tables=self.block_tables.upload(r),
            slot_mapping=self.slot_mapping.upload(t),
            positions=self.positions.upload(t),
            seq_slots=self.seq_slots.upload(r),
            sink_slots=self.sink_slots.upload(r),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            seq_slots_cpu=seq_slots,
            sink_slots_cpu=sink_slots,
            block_tables_cpu=tables,
            slot_mapping_cpu=slot_map,
        )
        if snaps or (pad_to and self.window):
            # a graph step carries pad_to snapshot rows whatever is due (padding rows: slot 0, no write)
            meta.ring_snapshots = self._ring_snapshots(snaps, pad_to)
        if self.gdn_chunk:
            meta.extra["gdn_chunk_indices"] = self._gdn_chunk_indices(qsl)
        inputs = StepInputs(
            input_ids=self.input_ids.upload(t),
            positions=meta.positions,
            meta=meta,
            sample_indices=self.sample_idx.upload(len(sample_rows)),
            sample_request_ids=sample_ids,
            prompt_rows=prompt_rows_host,
        )
        if deferred_rows:
            inputs.deferred_rows, inputs.deferred_request_ids = deferred_rows, deferred_ids
        if self.input_ids.pinned:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return inputs

    def write_deferred(self, inputs: StepInputs, prev_sample_ids: list[str], prev_tokens: torch.Tensor) -> None:
        """Write the deferred tokens of `inputs` (sampled by the previous step, still on the device) into
        its input_ids. Enqueued after the uploads, so the step's forward reads them."""
        order = {rid: i for i, rid in enumerate(prev_sample_ids)}
        n = len(inputs.deferred_rows)
        self.deferred.np[0, :n] = inputs.deferred_rows
        self.deferred.np[1, :n] = [order[rid] for rid in inputs.deferred_request_ids]
        if self.deferred.pinned:
            self.deferred.dev[:, :n].copy_(self.deferred.host[:, :n], non_blocking=True)
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        idx = self.deferred.dev[:, :n]
        inputs.input_ids.index_copy_(0, idx[0], prev_tokens.index_select(0, idx[1]))

    def _ring_snapshots(self, snaps: list[tuple[int, int, int, int, int]], rows: int = 0) -> RingSnapshots:
        """The step's snapshot rows, padded to `rows` with rows of the null slot 0 (positions left as the
        buffer held them: the kernels skip such rows, the reference writes them into the null slot)."""
        k, w = len(snaps), self.window
        n = max(k, rows)
        if k:
            info = np.asarray(snaps, dtype=np.int64)  # [k, 5]
            self.snap_pos.np[:k] = info[:, :1] - w + np.arange(w)[None, :]
            self.snap_info.np[:, :k] = info[:, 1:].T
        self.snap_info.np[:, k:n] = 0
        self.snap_pos.upload(k)
        pos = self.snap_pos.dev[:n]
        if self.snap_info.pinned:
            self.snap_info.dev[:, :n].copy_(self.snap_info.host[:, :n], non_blocking=True)
        info_dev = self.snap_info.dev[:, :n]
        return RingSnapshots(pos, info_dev[0], info_dev[1], info_dev[2], info_dev[3])

    def _gdn_chunk_indices(self, qsl: list[int]) -> torch.Tensor:
        """[num_chunks, 2] (request index, chunk index within the request). A fresh tensor each
        step: fla memoises chunk metadata by tensor identity."""
        counts = -(-np.diff(np.asarray(qsl, dtype=np.int64)) // self.gdn_chunk)
        req = np.repeat(np.arange(len(counts)), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        host = torch.from_numpy(np.stack([req, within], axis=1))
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host


def build_sampling_batch(
    requests: list[Request], generators: list[torch.Generator | None], vocab_size: int, device: torch.device
) -> tuple[SamplingBatch, list[int]]:
    """Per-row sampling tensors for the requests sampled this step, and each row's logprob count
    (-1: none)."""
    params = [r.sampling_params for r in requests]
    temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
    top_k = [p.top_k for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    counts = [-1 if p.logprobs is None else p.logprobs for p in params]

    def dev(values, dtype):
        return torch.as_tensor(np.asarray(values), dtype=dtype).to(device, non_blocking=True)

    all_greedy = all(t == 0.0 for t in temperature)
    b = SamplingBatch(
        all_greedy=all_greedy,
        any_filter=any(k > 0 for k in top_k) or any(p < 1 for p in top_p) or any(m > 0 for m in min_p),
        generators=generators,
        max_logprobs=max(counts),
    )
    if not all_greedy:  # an argmax needs none of them: four host -> device copies fewer per greedy step
        b.temperature = dev(temperature, torch.float32)
        b.top_k = dev(top_k, torch.int64)
        b.top_p = dev(top_p, torch.float32)
        b.min_p = dev(min_p, torch.float32)
    if any(p.uses_penalties for p in params):
        n = len(requests)
        out_counts = np.zeros((n, vocab_size), dtype=np.float32)
        seen = np.zeros((n, vocab_size), dtype=bool)
        for i, r in enumerate(requests):
            np.add.at(out_counts[i], np.asarray(r.output_token_ids, dtype=np.int64), 1.0)
            seen[i, np.asarray(r.prompt_token_ids, dtype=np.int64)] = True
            seen[i, np.asarray(r.output_token_ids, dtype=np.int64)] = True
        b.presence = dev([float(p.presence_penalty) for p in params], torch.float32)
        b.frequency = dev([float(p.frequency_penalty) for p in params], torch.float32)
        b.repetition = dev([float(p.repetition_penalty) for p in params], torch.float32)
        b.output_counts = torch.from_numpy(out_counts).to(device, non_blocking=True)
        b.seen_mask = torch.from_numpy(seen).to(device, non_blocking=True)
    ban_rows, ban_tokens = [], []
    for i, r in enumerate(requests):
        p = r.sampling_params
        # the output index this step samples: with async scheduling the one before may still be on
        # its way back (pending counts this step's sample too once scheduled)
        if r.num_output_tokens + max(r.num_pending_output - 1, 0) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            for tok in sorted(banned):
                ban_rows.append(i)
                ban_tokens.append(tok)
    if ban_rows:
        b.ban_rows = dev(ban_rows, torch.int64)
        b.ban_tokens = dev(ban_tokens, torch.int64)
    return b, counts


def count_deferred_tokens(
    b: SamplingBatch,
    sample_ids: list[str],
    deferred_ids: list[str],
    prev_sample_ids: list[str],
    prev_tokens: torch.Tensor,
) -> None:
    """Add the output tokens still on the device to a penalty batch (async scheduling): request
    `deferred_ids[i]`'s latest token is the previous step's sample of that request, which the host
    lists `build_sampling_batch` counted from do not hold yet. Device work only: no read-back."""
    prev_row = {rid: i for i, rid in enumerate(prev_sample_ids)}
    deferred = set(deferred_ids)
    pairs = [(i, prev_row[rid]) for i, rid in enumerate(sample_ids) if rid in deferred]
    if not pairs:
        return
    idx = torch.as_tensor(np.asarray(pairs, dtype=np.int64).T).to(prev_tokens.device, non_blocking=True)
    rows, tokens = idx[0], prev_tokens.index_select(0, idx[1]).long()
    b.output_counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=b.output_counts.dtype), accumulate=True)
    b.seen_mask.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.bool))
