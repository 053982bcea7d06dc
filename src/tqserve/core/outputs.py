"""What the scheduler hands the runner and what comes back: ints and lists only (invariant 6)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_table: list[int]
    seq_slot: int
    sink_slot: int
    num_page_tokens_cached: int  # positions below this skip page writes (shared pages)
    sample: bool  # the step reaches the end of the known tokens: sample the next one
    # token_ids[-1] is the token the previous step samples for this request, not read back yet: a
    # placeholder here, written on the device from that step's sampled tokens (async scheduling)
    deferred: bool = False
    want_prompt_logprobs: bool = False
    # Exact-window snapshots to write this step: (block boundary b, snapshot slot); the slot receives
    # the exact K/V of positions [b - W, b) of every window layer (core/window_snapshots.py).
    ring_snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    num_tokens: int = 0
    # Hybrid models: copy checkpoint slot -> sequence slot before the forward (prefix hit),
    # zero these sequence slots before the forward (fresh start), and copy sequence slot ->
    # checkpoint slot after it.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # Requests resuming after a prefix-cache hit with an exact-window preset: (sequence slot, block
    # table, resume position); the runner fills their ring entries [resume - W, resume) from pages.
    ring_fills: list[tuple[int, list[int], int]] = field(default_factory=list)
    # Requests resuming at a boundary with an exact-window snapshot: (snapshot slot, sequence slot);
    # the runner copies the snapshot into the request's ring before the forward (no recompute).
    ring_restores: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class RunnerOutput:
    # request id -> sampled token (only requests with sample=True)
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, object] = field(default_factory=dict)
    prompt_logprobs: dict[str, object] = field(default_factory=dict)
