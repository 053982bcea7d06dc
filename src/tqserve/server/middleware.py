"""A pure-ASGI guard in front of the app: API key check and request-body size limit.

Both run before FastAPI parses anything, so a client without the key gets 401 even with a broken
body, and an oversized body is refused (413) without being read in full. The body is buffered here
and replayed to the app; later `receive()` calls go to the server so disconnects are still seen.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from tqserve.server.errors import error_body

# Open without a key: probes and scrapers must not need the secret.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


async def _send_error(send: Any, status: int, message: str, extra_headers: list | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        needs_key = self.api_key and scope["path"] not in PUBLIC_PATHS and scope["method"] != "OPTIONS"
        if needs_key and not self._authorized(headers):
            message = "Missing or invalid API key: send 'Authorization: Bearer <key>'."
            await _send_error(send, 401, message, [(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body_bytes
            except ValueError:
                await _send_error(send, 400, "Invalid Content-Length header.")
                return
            if too_big:
                await _send_error(send, 413, self._too_large_message())
                return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        # Chunked bodies carry no length: read up to the limit, then replay.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, 413, self._too_large_message())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json" and not ctype.endswith(b"+json"):
            # `curl -d` sends form encoding by default; every POST route here takes JSON, so read it as such.
            raw = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope = dict(scope, headers=[*raw, (b"content-type", b"application/json")])
        await self.app(scope, replay, send)

    def _too_large_message(self) -> str:
        return f"Request body too large: the limit is {self.max_body_bytes} bytes (--max-request-body-bytes)."
