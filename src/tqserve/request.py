"""A request as the scheduler sees it: token ids, progress counters and status. No torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tqserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        # read for every request of every step: a member attribute (set below), not a string test
        return self._finished


for _s in RequestStatus:
    _s._finished = _s.value.startswith("finished")
del _s

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # already capped by max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens sampled by a launched step whose ids are not read back yet (0 or 1; async scheduling
    # schedules the next step before then, feeding them on the device: `Scheduler.schedule`).
    num_pending_output: int = 0
    # Prefix-cache hit reported to the user (tokens served from cache at first admission).
    num_cached_tokens: int = -1
    # Tokens below this position already sit in shared pages: recomputation skips page writes.
    num_page_tokens_cached: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Set by the engine for n > 1: children share the parent's id prefix.
    parent_id: str | None = None
    index: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a 4K-token request's block
        hashes would otherwise copy its prompt at every page boundary)."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]
