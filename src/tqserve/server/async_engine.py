"""One thread owns the synchronous engine; asyncio handlers talk to it through commands and queues.

Why a thread and not an asyncio task: `engine.step()` runs the model for tens of milliseconds and
would freeze every HTTP connection. The thread is the only caller of the engine (it is not
thread-safe); handlers send it `add`/`abort` commands through a thread-safe queue, and it hands each
request's progress back on that request's asyncio.Queue via `loop.call_soon_threadsafe`, one hop
per engine step for all requests together.

What crosses the boundary is `GenerationUpdate`: the engine's cumulative outputs turned into deltas
(new text, new token ids, new logprobs) while still on the engine thread, so the handler never
reads lists the engine may still be appending to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tqserve.server.metrics import ServerMetrics
from tqserve.server.tracking import LiveRequest, log_startup_summary, observe_progress

logger = logging.getLogger("tqserve.server")

_IDLE_WAIT_S = 0.5


class RequestAborted(Exception):
    """The request was aborted (client gone, or server shutting down) before it finished."""


class EngineStepError(RuntimeError):
    """engine.step() raised; every request in flight at that moment gets this error."""


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0  # cumulative generated tokens of this choice


@dataclass
class GenerationUpdate:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[ChoiceDelta]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None


def _stop_holdback(params: Any) -> int:
    # A stop string may still be completing in the next tokens; hold back that many characters so a
    # stream never shows text that the engine later cuts off.
    stop = getattr(params, "stop", None)
    if not stop:
        return 0
    stops = [stop] if isinstance(stop, str) else list(stop)
    return max((len(s) for s in stops), default=1) - 1


class RequestStream:
    """Updates of one request, in order, until it finishes; leaving the loop early aborts the request."""

    def __init__(self, owner: AsyncEngine, request_id: str, out_queue: asyncio.Queue):
        self.owner = owner
        self.request_id = request_id
        self._queue = out_queue

    def abort(self) -> None:
        self.owner.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[GenerationUpdate]:
        finished = False
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine thread has already dropped the request
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort()


class AsyncEngine:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        metrics: ServerMetrics,
        *,
        warmup: bool = True,
        log_requests: bool = True,
        on_load_failure: Callable[[BaseException], None] | None = None,
        on_ready: Callable[[], None] | None = None,
    ):
        self._factory = engine_factory
        self.metrics = metrics
        self._warmup = warmup
        self._log_requests = log_requests
        self._on_load_failure = on_load_failure
        self._on_ready = on_ready
        self._cmds: queue.Queue = queue.Queue()
        self._live: dict[str, LiveRequest] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine: Any = None
        self.ready = False
        self.load_error: str | None = None

    # ------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tqserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._cmds.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    def abort(self, request_id: str) -> None:
        """Idempotent; safe for unknown or finished ids."""
        self._cmds.put(("abort", request_id))

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> RequestStream:
        """Add the request; raises ValueError (bad input, from the engine) if the engine rejects it."""
        out_queue: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("add", request_id, list(prompt_token_ids), params, out_queue, added, time.monotonic()))
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may already have gone through
            raise
        return RequestStream(self, request_id, out_queue)

    # ------------------------------------------------------------------ engine-thread side

    def _run(self) -> None:
        try:
            self._load()
        except BaseException as exc:
            logger.exception("engine failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"
            if self._on_load_failure is not None:
                self._on_load_failure(exc)
            return
        self.ready = True
        try:
            self._serve_loop()
        except Exception as exc:  # a bug in the loop itself: fail loudly instead of hanging clients
            logger.exception("engine loop died")
            self.ready = False
            self.load_error = f"engine loop died: {type(exc).__name__}: {exc}"
            self._abort_all(EngineStepError(self.load_error))
            self._fail_pending(EngineStepError(self.load_error))

    def _serve_loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                cmds = [self._cmds.get_nowait() if busy else self._cmds.get(timeout=_IDLE_WAIT_S)]
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd[0] == "stop":
                    self._abort_all(RequestAborted("server shutting down"))
                    self._fail_pending(RequestAborted("server shutting down"))
                    return
                self._handle(cmd)
            stepped = False
            if self.engine.has_unfinished_requests():
                self._step()
                stepped = True
            if cmds or stepped:
                self._update_stats()

    def _fail_pending(self, exc: BaseException) -> None:
        """Adds still queued when the loop ends would wait forever: fail them."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add" and cmd[5].set_running_or_notify_cancel():
                cmd[5].set_exception(exc)

    def _load(self) -> None:
        t0 = time.monotonic()
        self.engine = self._factory()
        if self._on_ready is not None:
            self._on_ready()
        if self._warmup:
            self._run_warmup()
        self._update_stats()
        log_startup_summary(self.engine, time.monotonic() - t0)

    def _run_warmup(self) -> None:
        # One short greedy request so the first client does not pay for lazy initialisation.
        from tqserve.sampling_params import SamplingParams

        ids = self.engine.tokenizer.encode("Hello") or [0]
        self.engine.add_request("warmup-0", ids, SamplingParams(max_tokens=2, temperature=0.0))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt_ids, params, out_queue, added, arrival = cmd
            # After this call the handler can no longer cancel the future, so set_result is safe.
            if not added.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(rid, prompt_ids, params)
            except BaseException as exc:  # noqa: BLE001 - hand every failure to the waiting handler
                added.set_exception(exc)
                return
            self._live[rid] = LiveRequest(rid, out_queue, arrival, len(prompt_ids), _stop_holdback(params))
            added.set_result(None)
        elif cmd[0] == "abort":
            rid = cmd[1]
            live = self._live.pop(rid, None)
            if live is None:
                return
            try:
                self.engine.abort_request([rid])
            except Exception:
                logger.exception("abort_request(%s) failed", rid)
            self.metrics.label(self.metrics.num_requests_aborted).inc()
            if self._log_requests:
                logger.info("Aborted request %s after %d output tokens", rid, live.num_generated)
            self._deliver([(live.out_queue, RequestAborted(f"request {rid} was aborted"))])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine.step() failed; failing %d requests in flight", len(self._live))
            self._abort_all(EngineStepError(f"engine error: {type(exc).__name__}: {exc}"))
            return
        now = time.monotonic()
        batch: list[tuple[asyncio.Queue, Any]] = []
        step_tokens = 0
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # aborted meanwhile, or the warm-up request
            update, new_tokens = self._to_update(live, out)
            step_tokens += new_tokens
            self._observe(live, out, new_tokens, now)
            batch.append((live.out_queue, update))
            if out.finished:
                del self._live[out.request_id]
        if step_tokens:
            self.metrics.label(self.metrics.iteration_tokens).observe(step_tokens)
        self._deliver(batch)

    def _to_update(self, live: LiveRequest, out: Any) -> tuple[GenerationUpdate, int]:
        choices = []
        new_total = 0
        for comp in out.outputs:
            idx = comp.index
            sent_text = live.sent_text.get(idx, 0)
            sent_tok = live.sent_tokens.get(idx, 0)
            text = comp.text or ""
            done = comp.finish_reason is not None or out.finished
            visible = len(text) if done else len(text) - live.holdback
            # An unfinished multi-byte character decodes as U+FFFD until its last byte arrives.
            if not done and text.endswith("\ufffd"):
                visible = min(visible, len(text) - 1)
            visible = max(visible, sent_text)
            token_ids = list(comp.token_ids[sent_tok:])
            logprobs = None
            if comp.logprobs is not None:
                logprobs = list(comp.logprobs[sent_tok : sent_tok + len(token_ids)])
            live.sent_text[idx] = visible
            live.sent_tokens[idx] = sent_tok + len(token_ids)
            new_total += len(token_ids)
            choices.append(
                ChoiceDelta(
                    index=idx,
                    text=text[sent_text:visible],
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=comp.finish_reason,
                    stop_reason=getattr(comp, "stop_reason", None),
                    num_tokens=sent_tok + len(token_ids),
                )
            )
        live.num_cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        prompt_logprobs = None
        plp = getattr(out, "prompt_logprobs", None)
        # Sent once, when complete: chunked prefill fills it over several steps.
        if not live.prompt_logprobs_sent and plp is not None and len(plp) >= live.prompt_len:
            prompt_logprobs = list(plp)
            live.prompt_logprobs_sent = True
        update = GenerationUpdate(
            request_id=out.request_id,
            prompt_token_ids=list(out.prompt_token_ids) if live.first_token_time is None else [],
            choices=choices,
            finished=bool(out.finished),
            num_cached_tokens=live.num_cached,
            prompt_logprobs=prompt_logprobs,
        )
        return update, new_total

    def _observe(self, live: LiveRequest, out: Any, new_tokens: int, now: float) -> None:
        observe_progress(self.metrics, live, out, new_tokens, now, self._log_requests)

    def _abort_all(self, exc: BaseException) -> None:
        batch = []
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort_request([rid])
            except Exception:
                logger.exception("abort_request(%s) failed", rid)
            batch.append((live.out_queue, exc))
        self._live.clear()
        self._deliver(batch)

    def _update_stats(self) -> None:
        try:
            self.metrics.update_from_stats(self.engine.get_stats())
        except Exception:
            logger.exception("engine.get_stats() failed")

    def _deliver(self, batch: list[tuple[asyncio.Queue, Any]]) -> None:
        if not batch or self._loop is None:
            return

        def put_all() -> None:
            for q, item in batch:
                q.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more
