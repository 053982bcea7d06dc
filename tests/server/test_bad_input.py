"""Table of bad requests: each gets a 4xx with the OpenAI error envelope, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from srv_testlib import API_KEY, MAX_BODY_BYTES

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
MSG = [{"role": "user", "content": "Hi"}]
LONG_TEXT = "hello " * 400  # about 400 tokens: over max_model_len = 256

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"

# (case id, method, path, body: dict | bytes | None, headers, status, param the error should name or None)
CASES = [
    ("malformed-json", "POST", CHAT, b'{"messages": [', JSON, 400, None),
    ("body-not-object", "POST", CHAT, b"[1, 2]", JSON, 400, None),
    ("empty-body", "POST", CHAT, b"", JSON, 400, None),
    ("missing-messages", "POST", CHAT, {"max_tokens": 2}, AUTH, 400, "messages"),
    ("messages-wrong-type", "POST", CHAT, {"messages": "hi"}, AUTH, 400, "messages"),
    ("empty-messages", "POST", CHAT, {"messages": []}, AUTH, 400, "messages"),
    ("unknown-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400, "messages.0.role"),
    ("image-part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, AUTH, 400, None),
    ("max-tokens-negative", "POST", CHAT, {"messages": MSG, "max_tokens": -5}, AUTH, 400, "max_tokens"),
    (
        "max-tokens-zero",
        "POST",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 0},
        AUTH,
        400,
        "max_completion_tokens",
    ),
    ("max-tokens-huge", "POST", CHAT, {"messages": MSG, "max_tokens": 10**9}, AUTH, 400, "max_tokens"),
    ("max-tokens-string", "POST", CMPL, {"prompt": "a", "max_tokens": "many"}, AUTH, 400, "max_tokens"),
    ("n-zero", "POST", CHAT, {"messages": MSG, "n": 0}, AUTH, 400, "n"),
    ("n-over-max-num-seqs", "POST", CMPL, {"prompt": "a", "n": 100, "max_tokens": 1}, AUTH, 400, None),
    ("temperature-negative", "POST", CHAT, {"messages": MSG, "temperature": -0.5}, AUTH, 400, "temperature"),
    ("top-p-over-one", "POST", CHAT, {"messages": MSG, "top_p": 1.5}, AUTH, 400, "top_p"),
    ("presence-penalty-range", "POST", CMPL, {"prompt": "a", "presence_penalty": 5}, AUTH, 400, "presence_penalty"),
    (
        "top-logprobs-too-many",
        "POST",
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 50},
        AUTH,
        400,
        "top_logprobs",
    ),
    ("top-logprobs-without-logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, AUTH, 400, "top_logprobs"),
    ("completion-logprobs-too-many", "POST", CMPL, {"prompt": "a", "logprobs": 99}, AUTH, 400, "logprobs"),
    ("stop-wrong-type", "POST", CHAT, {"messages": MSG, "stop": 5}, AUTH, 400, "stop"),
    ("seed-not-int", "POST", CMPL, {"prompt": "a", "seed": "x"}, AUTH, 400, "seed"),
    (
        "response-format-unsupported",
        "POST",
        CHAT,
        {"messages": MSG, "response_format": {"type": "json_schema"}},
        AUTH,
        400,
        "response_format",
    ),
    (
        "chat-prompt-over-max-model-len",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
        AUTH,
        400,
        "messages",
    ),
    ("prompt-over-max-model-len", "POST", CMPL, {"prompt": LONG_TEXT, "max_tokens": 1}, AUTH, 400, "prompt"),
    ("prompt-missing", "POST", CMPL, {"max_tokens": 1}, AUTH, 400, "prompt"),
    ("prompt-empty-string", "POST", CMPL, {"prompt": "", "max_tokens": 1}, AUTH, 400, "prompt"),
    ("prompt-empty-list", "POST", CMPL, {"prompt": [], "max_tokens": 1}, AUTH, 400, "prompt"),
    ("token-id-out-of-vocab", "POST", CMPL, {"prompt": [1, 2, 10**7], "max_tokens": 1}, AUTH, 400, "prompt"),
    ("token-id-negative", "POST", CMPL, {"prompt": [[1, -3]], "max_tokens": 1}, AUTH, 400, "prompt"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [10**7]}, AUTH, 400, "tokens"),
    ("unknown-model", "POST", CHAT, {"model": "no-such-model", "messages": MSG}, AUTH, 404, "model"),
    ("missing-api-key", "POST", CHAT, {"messages": MSG}, {}, 401, None),
    ("wrong-api-key", "POST", CHAT, {"messages": MSG}, {"Authorization": "Bearer nope"}, 401, None),
    ("models-needs-key", "GET", "/v1/models", None, {}, 401, None),
    ("oversized-body", "POST", CHAT, b'{"messages": "' + b"x" * MAX_BODY_BYTES + b'"}', JSON, 413, None),
    ("invalid-utf8", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', JSON, 400, None),
    ("wrong-method", "GET", CHAT, None, AUTH, 405, None),
    ("unknown-path", "POST", "/v1/nothing-here", {}, AUTH, 404, None),
]


def _send(http_url: str, method: str, path: str, body, headers) -> httpx.Response:
    kwargs: dict = {"headers": headers, "timeout": 600}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["json"] = body
    return httpx.request(method, http_url + path, **kwargs)


def _assert_ok_after(url: str) -> None:
    r = httpx.post(url + CMPL, json={"prompt": "Hello", "max_tokens": 1}, headers=AUTH, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "headers", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input(live, case, method, path, body, headers, status, param):
    r = _send(live.url, method, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status
    assert "param" in err
    if param is not None:
        assert err["param"] == param, err
    _assert_ok_after(live.url)


def test_oversized_chunked_body(live):
    # No Content-Length: the limit must hold while the body streams in.
    def chunks():
        yield b'{"messages": "'
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    r = httpx.post(live.url + CHAT, content=chunks(), headers=JSON, timeout=600)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413
    _assert_ok_after(live.url)


def test_health_and_metrics_need_no_key(live):
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/metrics").status_code == 200


def test_form_encoded_json_is_accepted(live):
    # `curl -d` without a Content-Type header sends form encoding; the body is still JSON.
    body = json.dumps({"prompt": "Hello", "max_tokens": 1}).encode()
    headers = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(live.url + CMPL, content=body, headers=headers, timeout=600)
    assert r.status_code == 200, r.text
