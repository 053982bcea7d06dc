"""POST /v1/completions: a string, a list of strings, token ids, or a list of token-id lists."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tqserve.server.async_engine import EngineStepError, RequestAborted
from tqserve.server.errors import APIError, sse_error_event
from tqserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from tqserve.server.serving_common import (
    SSE_DONE,
    ServingContext,
    add_requests,
    build_sampling_params,
    check_token_ids,
    make_usage,
    merge_streams,
    resolve_max_tokens,
    sse,
    token_str,
    top_entries,
    watch_disconnect,
)


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """Each prompt as token ids, plus its text when the client sent text (for echo)."""
    p = req.prompt
    if isinstance(p, str):
        return [(list(ctx.tokenizer.encode(p)), p)]
    if not p:
        raise APIError("prompt must not be empty.", 400, "prompt")
    if all(isinstance(x, str) for x in p):
        return [(list(ctx.tokenizer.encode(x)), x) for x in p]
    if all(isinstance(x, int) for x in p):
        check_token_ids(p, ctx.tokenizer, "prompt")
        return [(list(p), None)]
    out = []
    for i, ids in enumerate(p):
        if not ids:
            raise APIError(f"prompt {i} is empty.", 400, "prompt")
        check_token_ids(ids, ctx.tokenizer, "prompt")
        out.append((list(ids), None))
    return out


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise APIError("suffix is not supported by this server.", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of other than n is not supported by this server.", 400, "best_of")


class _LogprobBuilder:
    """OpenAI's legacy logprobs layout: parallel lists of tokens, logprobs, top alternatives, offsets."""

    def __init__(self, ctx: ServingContext, k: int):
        self.ctx, self.k = ctx, k
        self.out = CompletionLogprobs()
        self.offset = 0

    def add(self, token_ids: list[int], entries_per_token: list[dict | None], start_offset: int | None = None) -> None:
        if start_offset is not None:
            self.offset = start_offset
        tok = self.ctx.tokenizer
        for tid, entries in zip(token_ids, entries_per_token):
            entry = entries.get(tid) if entries else None
            s = token_str(tok, tid, entry)
            self.out.tokens.append(s)
            self.out.text_offset.append(self.offset)
            self.offset += len(s)
            if not entries:
                self.out.token_logprobs.append(None)
                self.out.top_logprobs.append(None)
                continue
            self.out.token_logprobs.append(max(float(entry.logprob), -9999.0) if entry is not None else None)
            tops = {token_str(tok, t, e): float(e.logprob) for t, e in top_entries(entries, self.k)}
            if entry is not None:
                tops.setdefault(s, float(entry.logprob))
            self.out.top_logprobs.append(tops)

    def take(self) -> CompletionLogprobs:
        out, self.out = self.out, CompletionLogprobs()
        return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, receive: Any) -> Any:
    """Returns a CompletionResponse or an async iterator of SSE lines (stream=True)."""
    ctx.check_model(req.model)
    _check_unsupported(req)
    prompts = _prompts(ctx, req)
    jobs = []
    base_id = f"cmpl-{uuid.uuid4().hex}"
    for i, (ids, _) in enumerate(prompts):
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, ctx.max_model_len, "prompt")
        prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = build_sampling_params(req, max_tokens, req.logprobs, prompt_lp)
        jobs.append((base_id if len(prompts) == 1 else f"{base_id}-{i}", ids, params))
    streams = await add_requests(ctx.async_engine, jobs)
    run = _Run(ctx, req, base_id, int(time.time()), streams, prompts, receive)
    if req.stream:
        return run.stream()
    return await run.collect()


class _Run:
    def __init__(self, ctx, req, request_id, created, streams, prompts, receive):
        self.ctx, self.req, self.request_id, self.created = ctx, req, request_id, created
        self.streams, self.prompts, self.receive = streams, prompts, receive
        self.n = req.n

    def _watch(self):
        return watch_disconnect(self.receive, lambda: [s.abort() for s in self.streams])

    def _echo_text(self, i: int) -> str:
        ids, text = self.prompts[i]
        return text if text is not None else self.ctx.tokenizer.decode(ids)

    def _echo_logprobs(self, builder: _LogprobBuilder, i: int, prompt_logprobs: list | None) -> None:
        ids = self.prompts[i][0]
        entries = list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(ids)
        builder.add(ids, entries, start_offset=0)

    async def collect(self) -> CompletionResponse:
        req = self.req
        texts: dict[int, list[str]] = {}
        tokens: dict[int, list[int]] = {}
        lps: dict[int, list] = {}
        finish: dict[int, tuple[str | None, Any]] = {}
        prompt_lps: dict[int, list] = {}
        cached: dict[int, int] = {}
        watcher = self._watch()
        try:
            async for i, upd in merge_streams(self.streams):
                cached[i] = upd.num_cached_tokens
                if upd.prompt_logprobs is not None:
                    prompt_lps[i] = upd.prompt_logprobs
                for c in upd.choices:
                    idx = i * self.n + c.index
                    texts.setdefault(idx, []).append(c.text)
                    tokens.setdefault(idx, []).extend(c.token_ids)
                    lps.setdefault(idx, []).extend(c.logprobs or [None] * len(c.token_ids))
                    if c.finish_reason is not None:
                        finish[idx] = (c.finish_reason, c.stop_reason)
        except RequestAborted as exc:
            raise APIError(str(exc), 499, err_type="client_closed_request") from exc
        except EngineStepError as exc:
            raise APIError(str(exc), 500) from exc
        finally:
            watcher.cancel()
        choices = []
        for idx in sorted(texts):
            i = idx // self.n
            logprobs = None
            if req.logprobs is not None:
                builder = _LogprobBuilder(self.ctx, req.logprobs)
                if req.echo:
                    self._echo_logprobs(builder, i, prompt_lps.get(i))
                builder.add(tokens[idx], lps[idx])
                logprobs = builder.take()
            reason, stop_reason = finish.get(idx, ("length", None))
            echo = self._echo_text(i) if req.echo else ""
            choices.append(
                CompletionChoice(
                    index=idx,
                    text=echo + "".join(texts[idx]),
                    logprobs=logprobs,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                )
            )
        prompt_tokens = sum(len(ids) for ids, _ in self.prompts)
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=make_usage(prompt_tokens, sum(len(t) for t in tokens.values()), sum(cached.values())),
        )

    async def stream(self) -> AsyncIterator[str]:
        req = self.req
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prompt_tokens = sum(len(ids) for ids, _ in self.prompts)
        completion_tokens = 0
        cached: dict[int, int] = {}
        builders: dict[int, _LogprobBuilder] = {}
        prompt_lps: dict[int, list] = {}
        started: set[int] = set()

        def chunk(choice: CompletionChoice) -> str:
            return sse(
                CompletionStreamResponse(
                    id=self.request_id, created=self.created, model=self.ctx.model_name, choices=[choice]
                )
            )

        watcher = self._watch()
        try:
            async for i, upd in merge_streams(self.streams):
                cached[i] = upd.num_cached_tokens
                if upd.prompt_logprobs is not None:
                    prompt_lps[i] = upd.prompt_logprobs
                for c in upd.choices:
                    idx = i * self.n + c.index
                    completion_tokens += len(c.token_ids)
                    prefix = ""
                    # The echo goes out with the first token, when the prompt's logprobs are complete.
                    if idx not in started and (c.token_ids or c.finish_reason is not None):
                        started.add(idx)
                        if req.logprobs is not None:
                            builders[idx] = _LogprobBuilder(self.ctx, req.logprobs)
                        if req.echo:
                            prefix = self._echo_text(i)
                            if idx in builders:
                                self._echo_logprobs(builders[idx], i, prompt_lps.get(i))
                    if idx in builders:
                        builders[idx].add(c.token_ids, c.logprobs or [None] * len(c.token_ids))
                    text = prefix + c.text
                    if not text and c.finish_reason is None and not (idx in builders and c.token_ids):
                        continue
                    yield chunk(
                        CompletionChoice(
                            index=idx,
                            text=text,
                            logprobs=builders[idx].take() if idx in builders else None,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if include_usage:
                usage = make_usage(prompt_tokens, completion_tokens, sum(cached.values()))
                yield sse(
                    CompletionStreamResponse(
                        id=self.request_id, created=self.created, model=self.ctx.model_name, choices=[], usage=usage
                    )
                )
        except RequestAborted:
            return
        except EngineStepError as exc:
            yield sse_error_event(APIError(str(exc), 500))
        finally:
            watcher.cancel()
        yield SSE_DONE
