"""The FastAPI app: routes, lifespan (engine thread), and `run_server` for `tqserve serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

import tqserve
from tqserve.server.args import DEFAULT_MAX_BODY_BYTES, build_engine_args, model_name
from tqserve.server.async_engine import AsyncEngine
from tqserve.server.errors import APIError, error_response, install_error_handlers
from tqserve.server.metrics import ServerMetrics
from tqserve.server.middleware import GuardMiddleware
from tqserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tqserve.server.serving_chat import chat_prompt_ids, create_chat_completion
from tqserve.server.serving_common import ServingContext, check_token_ids
from tqserve.server.serving_completion import create_completion

logger = logging.getLogger("tqserve.server")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerConfig:
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    model_path: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None
    warmup: bool = True
    log_requests: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(
            served_model_names=list(args.served_model_name or []),
            model_path=model_name(args),
            api_key=args.api_key or None,
            max_body_bytes=args.max_request_body_bytes,
            chat_template=None,  # the engine installs --chat-template on its tokenizer
            warmup=not args.no_warmup,
            log_requests=not args.disable_log_requests,
        )


class _Context(ServingContext):
    """ServingContext whose model names come from the engine when no --served-model-name was given."""

    def __init__(self, config: ServerConfig, async_engine: AsyncEngine):
        super().__init__(async_engine, list(config.served_model_names), config.model_path, config.chat_template)

    @property  # type: ignore[override]
    def served_model_names(self) -> list[str]:
        if self._names:
            return self._names
        cfg = getattr(self.async_engine.engine, "model_config", None)
        name = getattr(cfg, "served_model_name", None) or getattr(cfg, "model", None) or self.model_path
        return [str(name or "default")]

    @served_model_names.setter
    def served_model_names(self, names: list[str]) -> None:
        self._names = names


def build_app(
    config: ServerConfig,
    engine_factory: Callable[[], Any],
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    metrics_label = (config.served_model_names or [config.model_path or "default"])[0]
    metrics = ServerMetrics(metrics_label)
    async_engine = AsyncEngine(
        engine_factory,
        metrics,
        warmup=config.warmup,
        log_requests=config.log_requests,
        on_load_failure=on_load_failure,
        on_ready=lambda: metrics.set_model_name(ctx.model_name),
    )
    ctx = _Context(config, async_engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="tqserve", version=tqserve.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    @app.get("/health")
    @app.get("/ping")
    async def health() -> Response:
        if async_engine.ready:
            return JSONResponse({"status": "ok"})
        return error_response(async_engine.load_error or "Loading model", 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tqserve.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        max_len = ctx.max_model_len
        cards = [ModelCard(id=n, root=ctx.model_path or n, max_model_len=max_len) for n in ctx.served_model_names]
        return ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return ModelCard(id=model_id, root=ctx.model_path or model_id, max_model_len=ctx.max_model_len)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        result = await create_chat_completion(ctx, body, raw.receive)
        if body.stream:
            return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)
        return result

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        result = await create_completion(ctx, body, raw.receive)
        if body.stream:
            return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)
        return result

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("Send exactly one of 'prompt' or 'messages'.", 400, "prompt")
        if body.messages is not None:
            chat_req = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            ids = chat_prompt_ids(ctx, chat_req)
        else:
            ids = list(ctx.tokenizer.encode(body.prompt))
        strs = [ctx.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        check_token_ids(body.tokens, ctx.tokenizer, "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))

    return app


def run_server(args: argparse.Namespace) -> None:
    """Serve until interrupted; exits with status 1 if the engine fails to load."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig.from_args(args)
    engine_args = build_engine_args(args)  # bad flag values fail here, before the port is bound

    def factory() -> Any:
        from tqserve.engine.llm_engine import LLMEngine

        return LLMEngine.from_engine_args(engine_args)

    server_box: list[Any] = []

    def stop_on_failure(_: BaseException) -> None:
        if server_box:
            server_box[0].should_exit = True

    app = build_app(config, factory, on_load_failure=stop_on_failure)
    # A bounded graceful shutdown: open streams are cut after 10 s instead of holding Ctrl-C forever.
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(uv_config)
    server_box.append(server)
    logger.info(
        "tqserve %s listening on http://%s:%d (model loads in the background)",
        tqserve.__version__,
        args.host,
        args.port,
    )
    server.run()
    if app.state.async_engine.load_error:
        logger.error("engine failed to load: %s", app.state.async_engine.load_error)
        sys.exit(1)
