"""Sampling: penalties, min_tokens, greedy / temperature / top-k / top-p / min-p, per-request seeds,
logprobs. The device-to-host read-back of sampled tokens and logprobs happens here and only here
(invariant 2); the batch tensors come from engine/input_batch.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for one step, already on the device."""

    all_greedy: bool
    any_filter: bool  # some row uses top-k / top-p / min-p
    generators: list[torch.Generator | None]  # per row; None uses the engine generator
    # Temperatures and filters; None when every row is greedy (the argmax needs none of them)
    temperature: torch.Tensor | None = None  # [N] float32 (0 = greedy)
    top_k: torch.Tensor | None = None  # [N] int64 (0 = off)
    top_p: torch.Tensor | None = None  # [N] float32
    min_p: torch.Tensor | None = None  # [N] float32
    # Penalties (None when no row uses them)
    presence: torch.Tensor | None = None  # [N]
    frequency: torch.Tensor | None = None  # [N]
    repetition: torch.Tensor | None = None  # [N]
    output_counts: torch.Tensor | None = None  # [N, V] float32 counts of generated tokens
    seen_mask: torch.Tensor | None = None  # [N, V] bool: token in prompt or output
    # Tokens banned this step (EOS / stop ids under min_tokens): [M] rows, [M] token ids
    ban_rows: torch.Tensor | None = None
    ban_tokens: torch.Tensor | None = None
    max_logprobs: int = -1  # -1: no row asked for logprobs


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (chosen logprob, chosen rank, [(token, logprob), ...] top-k) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, b: SamplingBatch, logprob_counts: list[int]) -> SampleResult:
        return read_back(*self.sample(logits, b), logprob_counts)

    def sample(self, logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, tuple | None]:
        """The sampled tokens and logprob tensors, on the device: nothing waits for them here
        (`read_back` does, once per step)."""
        raw = logits
        if b.repetition is not None or b.frequency is not None or b.ban_rows is not None:
            logits = self._apply_penalties(logits.clone(), b)  # `raw` stays for the logprobs
        if b.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, b)
        lp = None
        if b.max_logprobs >= 0:
            lp = _gather_logprobs(torch.log_softmax(raw, dim=-1), tokens, b.max_logprobs)
        return tokens, lp

    def _apply_penalties(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        if b.repetition is not None:
            rp = b.repetition[:, None]
            penalized = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(b.seen_mask, penalized, logits)
        if b.frequency is not None:
            logits = logits - b.frequency[:, None] * b.output_counts
            logits = logits - b.presence[:, None] * (b.output_counts > 0).float()
        if b.ban_rows is not None:
            logits[b.ban_rows, b.ban_tokens] = NEG_INF
        return logits

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        logits = logits / temp[:, None]
        if b.any_filter:
            logits = _filter(logits, b.top_k, b.top_p, b.min_p)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; per-row generators make a
        # seeded request reproducible whatever else shares its batch.
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, gen in enumerate(b.generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(b.temperature > 0, sampled, greedy_tokens)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, NEG_INF), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the token crossing p stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    # min-p: drop tokens below min_p times the top probability.
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    filtered = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(-1, order, filtered)


def _gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int):
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
    return chosen, rank, top_vals, top_ids


def to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    """Start the copy of a sampled tensor to pinned host memory (the caller records an event after it
    and waits on that, not on the whole stream, before `read_back`)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def read_back(tokens: torch.Tensor, lp, counts: list[int]) -> SampleResult:
    """Host lists of `Sampler.sample`'s tensors: the device -> host sync of a step."""
    token_ids = tokens.tolist()
    if lp is None:
        return SampleResult(token_ids, [None] * len(token_ids))
    chosen, rank, top_vals, top_ids = (t.tolist() for t in lp)
    out = []
    for row, k in enumerate(counts):
        if k < 0:
            out.append(None)
        else:
            top = _chosen_first(list(zip(top_ids[row], top_vals[row])), token_ids[row])[:k]
            out.append((chosen[row], rank[row], top))
    return SampleResult(token_ids, out)


def _chosen_first(top: list[tuple[int, float]], chosen: int) -> list[tuple[int, float]]:
    """Order the top-k by logprob, the sampled token first among equal values (bf16 logits tie
    often; rank counts strictly larger logprobs, so a tied chosen token has rank 1)."""
    return sorted(top, key=lambda e: (-e[1], e[0] != chosen))


def prompt_logprobs(
    logits: torch.Tensor, next_tokens: torch.Tensor, k: int, full: bool
) -> tuple[list, torch.Tensor | None]:
    """Logprobs of each prompt position's next token (+ top-k), and optionally the full
    log-softmax (host tensor) for quality evaluation. `logits` may hold rows past the last next
    token (the prompt's final position): they appear only in the full tensor. Read-back lives here
    with the sampler's."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    scored = logprobs[: len(next_tokens)]
    chosen, rank, top_vals, top_ids = (t.tolist() for t in _gather_logprobs(scored, next_tokens, k))
    rows = [(chosen[i], rank[i], list(zip(top_ids[i][:k], top_vals[i][:k]))) for i in range(len(chosen))]
    return rows, (logprobs.cpu() if full else None)
