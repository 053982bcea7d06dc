"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tqserve.server.async_engine import EngineStepError, RequestAborted
from tqserve.server.errors import APIError, sse_error_event
from tqserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogprob,
    ChatCompletionLogprobContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from tqserve.server.serving_common import (
    SSE_DONE,
    ServingContext,
    add_requests,
    build_sampling_params,
    make_usage,
    merge_streams,
    resolve_max_tokens,
    sse,
    token_str,
    top_entries,
    watch_disconnect,
)


def _flatten_content(content: Any, i: int) -> Any:
    """OpenAI list content -> the plain string chat templates expect (text parts joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise APIError(
                f"Unsupported content part type {kind!r}: this server accepts text parts only.",
                400,
                f"messages.{i}.content.{j}",
            )
    return "\n".join(texts)


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError("tool_choice other than 'none' or 'auto' is not supported by this server.", 400, "tool_choice")
    fmt = (req.response_format or {}).get("type")
    if fmt not in (None, "text"):
        raise APIError(f"response_format type {fmt!r} is not supported by this server.", 400, "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true.", 400, "top_logprobs")


def chat_prompt_ids(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, msg in enumerate(req.messages):
        d = msg.model_dump(exclude_none=True)
        d["content"] = _flatten_content(msg.content, i)
        if d["content"] is None:
            d["content"] = ""
        messages.append(d)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tools:
        kwargs["tools"] = req.tools
    template = req.chat_template or ctx.chat_template
    if template is not None:
        kwargs["chat_template"] = template
    try:
        # tokenize=True: the rendered template already holds its special tokens, so none are added
        # again (the same ids the offline LLM.chat uses).
        ids = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, **kwargs
        )
    except APIError:
        raise
    except Exception as exc:  # a template that rejects the conversation is a client error
        raise APIError(f"The chat template could not render these messages: {exc}", 400, "messages") from exc
    if isinstance(ids, str):  # a tokenizer whose template only renders text
        ids = ctx.tokenizer.encode(ids, add_special_tokens=False)
    return list(ids)


def _logprob_content(ctx: ServingContext, token_ids: list[int], logprobs: list[dict], k: int) -> list:
    content = []
    for tid, entries in zip(token_ids, logprobs):
        entry = entries.get(tid)
        tok = token_str(ctx.tokenizer, tid, entry)
        tops = [
            ChatCompletionLogprob(
                token=(s := token_str(ctx.tokenizer, t, e)), logprob=float(e.logprob), bytes=list(s.encode())
            )
            for t, e in top_entries(entries, k)
        ]
        lp = float(entry.logprob) if entry is not None else float("-inf")
        content.append(
            ChatCompletionLogprobContent(
                token=tok, logprob=max(lp, -9999.0), bytes=list(tok.encode()), top_logprobs=tops
            )
        )
    return content


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, receive: Any) -> Any:
    """Returns a ChatCompletionResponse or an async iterator of SSE lines (stream=True)."""
    ctx.check_model(req.model)
    _check_unsupported(req)
    prompt_ids = chat_prompt_ids(ctx, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(len(prompt_ids), requested, ctx.max_model_len, "messages")
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, max_tokens, top_k, None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await add_requests(ctx.async_engine, [(request_id, prompt_ids, params)])
    run = _Run(ctx, req, request_id, int(time.time()), streams, top_k, receive)
    if req.stream:
        return run.stream()
    return await run.collect()


class _Run:
    """One chat request in flight: its streams, the disconnect watch, and the two ways to answer."""

    def __init__(self, ctx, req, request_id, created, streams, top_k, receive):
        self.ctx, self.req, self.request_id, self.created = ctx, req, request_id, created
        self.streams, self.top_k, self.receive = streams, top_k, receive

    def _watch(self):
        return watch_disconnect(self.receive, lambda: [s.abort() for s in self.streams])

    async def collect(self) -> ChatCompletionResponse:
        ctx, top_k = self.ctx, self.top_k
        texts: dict[int, list[str]] = {}
        tokens: dict[int, list[int]] = {}
        lps: dict[int, list[dict]] = {}
        finish: dict[int, tuple[str | None, Any]] = {}
        prompt_len = cached = 0
        watcher = self._watch()
        try:
            async for _, upd in merge_streams(self.streams):
                prompt_len = prompt_len or len(upd.prompt_token_ids)
                cached = upd.num_cached_tokens
                for c in upd.choices:
                    texts.setdefault(c.index, []).append(c.text)
                    tokens.setdefault(c.index, []).extend(c.token_ids)
                    lps.setdefault(c.index, []).extend(c.logprobs or [])
                    if c.finish_reason is not None:
                        finish[c.index] = (c.finish_reason, c.stop_reason)
        except RequestAborted as exc:
            raise APIError(str(exc), 499, err_type="client_closed_request") from exc
        except EngineStepError as exc:
            raise APIError(str(exc), 500) from exc
        finally:
            watcher.cancel()
        choices = []
        for idx in sorted(texts):
            logprobs = None
            if top_k is not None:
                logprobs = ChatChoiceLogprobs(content=_logprob_content(ctx, tokens[idx], lps[idx], top_k))
            reason, stop_reason = finish.get(idx, ("length", None))
            choices.append(
                ChatCompletionChoice(
                    index=idx,
                    message=ChatResponseMessage(content="".join(texts[idx])),
                    logprobs=logprobs,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                )
            )
        completion_tokens = sum(len(t) for t in tokens.values())
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=ctx.model_name,
            choices=choices,
            usage=make_usage(prompt_len, completion_tokens, cached),
        )

    async def stream(self) -> AsyncIterator[str]:
        ctx, top_k = self.ctx, self.top_k
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(
                ChatCompletionChunk(id=self.request_id, created=self.created, model=ctx.model_name, choices=[choice])
            )

        prompt_len = cached = completion_tokens = 0
        started: set[int] = set()
        watcher = self._watch()
        try:
            async for _, upd in merge_streams(self.streams):
                prompt_len = prompt_len or len(upd.prompt_token_ids)
                cached = upd.num_cached_tokens
                for c in upd.choices:
                    if c.index not in started:
                        started.add(c.index)
                        yield chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(role="assistant", content="")))
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not (top_k is not None and c.token_ids):
                        continue
                    logprobs = None
                    if top_k is not None and c.token_ids:
                        logprobs = ChatChoiceLogprobs(
                            content=_logprob_content(ctx, c.token_ids, c.logprobs or [], top_k)
                        )
                    yield chunk(
                        ChatStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text),
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if include_usage:
                usage = make_usage(prompt_len, completion_tokens, cached)
                yield sse(
                    ChatCompletionChunk(
                        id=self.request_id, created=self.created, model=ctx.model_name, choices=[], usage=usage
                    )
                )
        except RequestAborted:
            return  # the client is gone (or the server is stopping): nobody to tell
        except EngineStepError as exc:
            yield sse_error_event(APIError(str(exc), 500))
        finally:
            watcher.cancel()
        yield SSE_DONE
