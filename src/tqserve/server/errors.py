"""OpenAI-style error envelope and the exception handlers that produce it.

Every error the server returns has the shape ``{"error": {"message", "type", "param", "code"}}``.
``code`` is the HTTP status as an int (vLLM's convention); ``type`` follows OpenAI's names so SDKs
and humans can tell a bad request from an auth or availability problem.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tqserve.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error that maps to one HTTP status and one envelope; raise it anywhere in a handler."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or _TYPE_BY_STATUS.get(status, "internal_server_error")


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPE_BY_STATUS.get(status, "internal_server_error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def api_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.err_type), status_code=err.status)


def sse_error_event(err: APIError) -> str:
    """A mid-stream error: the envelope inside one SSE data line (vLLM's convention)."""
    return f"data: {json.dumps(error_body(err.message, err.status, err.param, err.err_type))}\n\n"


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|dict|list|tuple|none)$|[\[\]]")


def _param_from_loc(loc: tuple[Any, ...] | list[Any]) -> str | None:
    # FastAPI locations look like ("body", "messages", 0, "role"); for a union-typed field pydantic
    # appends the member it tried ("stop", "str" or "list[str]"): keep only the field path.
    parts = [str(p) for p in loc if p != "body" and not _UNION_MEMBER.search(str(p))]
    return ".".join(parts) if parts else None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return "The request body is missing or empty; send a JSON object.", None
    param = _param_from_loc(first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    text = f"Invalid value for '{param}': {msg}" if param else f"Invalid request: {msg}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI clients expect 400 for any invalid request field.
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else None
        if status == 400 and detail == "There was an error parsing the body":
            detail = "The request body could not be decoded; send UTF-8 encoded JSON."
        message = detail or HTTPStatus(status).phrase
        return error_response(message, status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in request handler")
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)
