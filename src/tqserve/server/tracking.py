"""Per-request bookkeeping on the engine thread: what was sent, timings, metrics and log lines."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from tqserve.server.metrics import ServerMetrics

logger = logging.getLogger("tqserve.server")


@dataclass
class LiveRequest:
    """Engine-thread bookkeeping for one request: what was already sent, and timings for metrics."""

    request_id: str
    out_queue: asyncio.Queue
    arrival: float
    prompt_len: int
    holdback: int
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generated: int = 0
    num_cached: int = 0
    prompt_logprobs_sent: bool = False


def observe_progress(
    metrics: ServerMetrics, live: LiveRequest, out: Any, new_tokens: int, now: float, log_requests: bool
) -> None:
    """Token counters and latency histograms for one engine output; a log line when it finishes."""
    m = metrics
    if new_tokens:
        if live.first_token_time is None:
            live.first_token_time = now
            m.label(m.time_to_first_token).observe(now - live.arrival)
            m.label(m.prompt_tokens).inc(live.prompt_len)
        else:
            m.label(m.inter_token_latency).observe((now - (live.last_token_time or now)) / new_tokens)
        live.last_token_time = now
        live.num_generated += new_tokens
        m.label(m.generation_tokens).inc(new_tokens)
    if not out.finished:
        return
    e2e = now - live.arrival
    m.label(m.e2e_request_latency).observe(e2e)
    m.label(m.request_prompt_tokens).observe(live.prompt_len)
    m.label(m.request_generation_tokens).observe(live.num_generated)
    first = live.first_token_time or now
    m.label(m.request_decode_time).observe(now - first)
    rm = getattr(out, "metrics", None)
    sched = getattr(rm, "first_scheduled_time", None) if rm is not None else None
    arrival = getattr(rm, "arrival_time", None) if rm is not None else None
    if sched is not None and arrival is not None:
        m.label(m.request_queue_time).observe(max(0.0, sched - arrival))
        ft = getattr(rm, "first_token_time", None)
        if ft is not None:
            m.label(m.request_prefill_time).observe(max(0.0, ft - sched))
    reasons = {c.finish_reason for c in out.outputs if c.finish_reason} or {"stop"}
    for reason in reasons:
        m.count_success(reason)
    if log_requests:
        ttft = first - live.arrival
        decode_s = now - first
        tps = (live.num_generated - 1) / decode_s if decode_s > 0 and live.num_generated > 1 else 0.0
        logger.info(
            "Finished request %s: prompt_tokens=%d output_tokens=%d cached_tokens=%d ttft=%.3fs "
            "e2e=%.3fs decode=%.1f tok/s finish=%s",
            live.request_id,
            live.prompt_len,
            live.num_generated,
            live.num_cached,
            ttft,
            e2e,
            tps,
            ",".join(sorted(reasons)),
        )


def log_startup_summary(engine: Any, load_s: float) -> None:
    """Model, KV preset, pages, token capacity and max concurrency at max_model_len, one block at start."""
    cfg = getattr(engine, "model_config", None)
    args = getattr(engine, "args", None)
    logger.info(
        "Engine ready in %.1fs: model=%s max_model_len=%s kv_cache_dtype=%s device=%s",
        load_s,
        getattr(cfg, "model", None),
        getattr(cfg, "max_model_len", None),
        getattr(args, "kv_cache_dtype", None),
        getattr(cfg, "device", None),
    )
    report = getattr(engine, "capacity_report", None)
    if not callable(report):
        return
    try:
        rep = report()
    except Exception:
        logger.exception("capacity_report() failed")
        return
    lines = rep.lines() if hasattr(rep, "lines") else [str(rep)]
    for line in lines:
        logger.info("%s", line)
