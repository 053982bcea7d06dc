"""SamplingParams with vLLM's field names; every invalid value raises ValueError naming the field."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

_MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    """What `LLMEngine.step` returns for a request (vLLM's names): CUMULATIVE, every step the output so
    far (streaming consumers); FINAL_ONLY, one output when the request finishes (offline `LLM.generate`,
    which then skips building an output per request and step). DELTA is vLLM's third kind and not
    served: the server computes its own deltas from cumulative outputs."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Engine-internal: return the full log-softmax of every prompt position (KV-quality evaluation).
    prompt_logprobs_full: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "must be -1, 0 (off) or a positive integer")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or not 0 <= val <= _MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {_MAX_LOGPROBS}]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "must be an integer")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise bad("output_kind", "must be RequestOutputKind.CUMULATIVE or FINAL_ONLY (DELTA is not served)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        """Presence / frequency / repetition penalties: sampling needs the counts of the output tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def clone_for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n samples: one sequence each, seeds kept distinct."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
