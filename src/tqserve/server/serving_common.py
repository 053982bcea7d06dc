"""What chat and completions share: model check, prompt checks, SamplingParams, logprobs, usage, SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tqserve.server.async_engine import AsyncEngine, EngineStepError, GenerationUpdate, RequestAborted, RequestStream
from tqserve.server.errors import APIError
from tqserve.server.protocol import PromptTokensDetails, UsageInfo

_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
)


@dataclass
class ServingContext:
    """Everything a handler needs: the engine bridge, names clients may use, and limits."""

    async_engine: AsyncEngine
    served_model_names: list[str]
    model_path: str | None
    chat_template: str | None = None

    @property
    def engine(self) -> Any:
        if not self.async_engine.ready:
            msg = self.async_engine.load_error or "Loading model"
            raise APIError(msg, 503)
        return self.async_engine.engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.model_config.max_model_len)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, requested: str | None) -> None:
        # A missing model means "the one you serve", as vLLM allows; a wrong one is a 404.
        if requested is None or requested in self.served_model_names:
            return
        if self.model_path is not None and requested == self.model_path:
            return
        raise APIError(f"The model `{requested}` does not exist.", 404, "model")


def vocab_size(tokenizer: Any) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if size is not None else None


def check_token_ids(ids: list[int], tokenizer: Any, param: str) -> None:
    size = vocab_size(tokenizer)
    for t in ids:
        if t < 0 or (size is not None and t >= size):
            raise APIError(f"Token id {t} is out of vocabulary (valid ids are 0..{(size or 1) - 1}).", 400, param)


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, param: str) -> int:
    """vLLM's rule: the prompt plus max_tokens must fit the context; an unset max_tokens takes what is left."""
    if prompt_len == 0:
        raise APIError("The prompt is empty: it must contain at least one token.", 400, param)
    if prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input.",
            400,
            param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            400,
            "max_tokens",
        )
    return requested


def _sampling_param_names() -> set[str] | None:
    from tqserve.sampling_params import SamplingParams

    if dataclasses.is_dataclass(SamplingParams):
        return {f.name for f in dataclasses.fields(SamplingParams)}
    try:
        return set(inspect.signature(SamplingParams).parameters)
    except (TypeError, ValueError):
        return None


def _param_in_message(message: str, names: list[str]) -> str | None:
    """The request field an engine ValueError names (as a whole word), if any."""
    for name in sorted(names, key=len, reverse=True):
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message):
            return name
    return None


def build_sampling_params(
    request: BaseModel, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> Any:
    """SamplingParams from the request's set fields; the engine's defaults apply to the rest."""
    from tqserve.sampling_params import SamplingParams

    if getattr(request, "logit_bias", None):
        raise APIError("logit_bias is not supported by this server.", 400, "logit_bias")
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    for name in _SAMPLING_FIELDS:
        value = getattr(request, name, None)
        if value is not None:
            kwargs[name] = value
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    known = _sampling_param_names()
    if known is not None:
        # Defaults need not be passed to an engine that lacks the field; set values must not be dropped.
        for name in [k for k in kwargs if k not in known]:
            default = {"min_tokens": 0, "ignore_eos": False, "skip_special_tokens": True}.get(name, object())
            if kwargs[name] == default or kwargs[name] == []:
                del kwargs[name]
            else:
                raise APIError(f"'{name}' is not supported by this engine.", 400, name)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), 400, _param_in_message(str(exc), list(kwargs))) from exc


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def token_str(tokenizer: Any, token_id: int, entry: Any = None) -> str:
    decoded = getattr(entry, "decoded_token", None) if entry is not None else None
    if decoded is not None:
        return decoded
    return tokenizer.decode([token_id])


def top_entries(entries: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    """The top-k alternatives by rank (the sampled token is kept in the dict even when it ranks lower)."""
    items = sorted(entries.items(), key=lambda kv: -float(kv[1].logprob))
    ranked = [(t, e) for t, e in items if getattr(e, "rank", None) is None or e.rank <= k]
    return ranked[:k]


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def add_requests(async_engine: AsyncEngine, jobs: list[tuple[str, list[int], Any]]) -> list[RequestStream]:
    """Add every request or none: a rejected one aborts those already added and becomes a 400."""
    streams: list[RequestStream] = []
    try:
        for rid, ids, params in jobs:
            streams.append(await async_engine.add_request(rid, ids, params))
    except BaseException as exc:
        for s in streams:
            s.abort()
        if isinstance(exc, ValueError):
            raise APIError(str(exc), 400, _param_in_message(str(exc), ["prompt", "max_tokens", "n", "seed"])) from exc
        if isinstance(exc, RequestAborted):
            raise APIError(str(exc), 503) from exc
        if isinstance(exc, EngineStepError):
            raise APIError(str(exc), 500) from exc
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, GenerationUpdate]]:
    """Yield (stream index, update) from several requests as updates arrive.

    Closing the consumer cancels every pump, whose stream then aborts its request.
    """
    if len(streams) == 1:
        async for upd in streams[0]:
            yield 0, upd
        return
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for upd in stream:
                merged.put_nowait((i, upd))
            merged.put_nowait((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - forward to the consumer
            merged.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await merged.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
        await asyncio.gather(*tasks, return_exceptions=True)


def watch_disconnect(receive: Callable[[], Any], on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls on_disconnect when the client goes away; cancel it when the response is done."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                on_disconnect()
                return

    return asyncio.create_task(watch())
