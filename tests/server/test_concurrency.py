"""32 concurrent streaming clients; disconnects abort requests and free their pages."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
from srv_testlib import API_KEY, CONCURRENT_MAX_TOKENS, CONCURRENT_PROMPTS, metric_value

MODEL = "SmolLM2-135M-Instruct"


async def _one_stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[str], int, str | None]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=CONCURRENT_MAX_TOKENS,
        temperature=0,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, tokens, usage, finish = "", [], -1, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
            finish = c.finish_reason or finish
    return text, tokens, usage, finish


def test_32_concurrent_streams_match_requests_run_alone(live, refs):
    async def run_all():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=900)
        try:
            return await asyncio.gather(*[_one_stream(client, p) for p in CONCURRENT_PROMPTS])
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert len(results) == 32
    for i, ((text, tokens, usage, finish), ref) in enumerate(zip(results, refs.concurrent)):
        assert text == ref.text, f"stream {i}"
        # Each generated token arrives exactly once: per-token strings rebuild the text, counts match.
        assert len(tokens) == len(ref.token_ids) == usage, f"stream {i}"
        assert "".join(tokens) == text, f"stream {i}"
        assert finish == ref.finish_reason, f"stream {i}"


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics").text


def _wait_idle(url: str, aborted_before: float, timeout: float = 300) -> str:
    """Until one more request is counted aborted and no request holds pages."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = _metrics(url)
        if (
            metric_value(text, "tqserve:num_requests_aborted_total") > aborted_before
            and metric_value(text, "tqserve:num_requests_running") == 0
            and metric_value(text, "tqserve:kv_cache_usage_perc") == 0
        ):
            return text
        time.sleep(0.05)
    raise AssertionError("the aborted request still holds pages:\n" + _metrics(url))


def _ok(url: str) -> None:
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=600,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnect_mid_stream_aborts_and_frees_pages(live):
    before = _metrics(live.url)
    aborted = metric_value(before, "tqserve:num_requests_aborted_total")
    generated = metric_value(before, "tqserve:generation_tokens_total")
    body = {"prompt": "Count from one to a thousand:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(timeout=600) as c,
        c.stream("POST", live.url + "/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break  # one token seen: hang up
    after = _wait_idle(live.url, aborted)
    # Aborted long before its 200 tokens.
    assert metric_value(after, "tqserve:generation_tokens_total") - generated < 150
    _ok(live.url)


def test_disconnect_while_waiting_for_non_streaming_response(live):
    aborted = metric_value(_metrics(live.url), "tqserve:num_requests_aborted_total")
    body = b'{"prompt": "Count from one to a thousand:", "max_tokens": 200, "ignore_eos": true}'
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(request)
        # Wait until the request is running, then go away without reading the answer.
        deadline = time.monotonic() + 300
        while metric_value(_metrics(live.url), "tqserve:num_requests_running") < 1:
            assert time.monotonic() < deadline, "request never started"
            time.sleep(0.02)
    _wait_idle(live.url, aborted)
    _ok(live.url)
