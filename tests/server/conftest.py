"""A live tqserve server on 127.0.0.1 for the whole session, backed by the default model.

The engine is built once. Before it is handed to the server, the reference outputs the tests
compare against are computed on it offline (add_request/step, one request at a time), so "equal
to the offline engine" and "equal to the request run alone" need no second model load.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from srv_testlib import (
    API_KEY,
    CHAT_MESSAGES,
    COMPLETION_PROMPT,
    CONCURRENT_MAX_TOKENS,
    CONCURRENT_PROMPTS,
    MAX_BODY_BYTES,
    REF_MAX_TOKENS,
    LiveServer,
    Refs,
    build_engine,
    run_alone,
)


@pytest.fixture(scope="session")
def engine_and_refs() -> tuple[Any, Refs]:
    engine = build_engine()
    tok = engine.tokenizer
    chat_ids = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True)
    refs = Refs(
        chat=run_alone(engine, "ref-chat", chat_ids, REF_MAX_TOKENS),
        completion=run_alone(engine, "ref-cmpl", tok.encode(COMPLETION_PROMPT), REF_MAX_TOKENS),
    )
    for i, prompt in enumerate(CONCURRENT_PROMPTS):
        refs.concurrent.append(run_alone(engine, f"ref-c{i}", tok.encode(prompt), CONCURRENT_MAX_TOKENS))
    return engine, refs


@pytest.fixture(scope="session")
def live(engine_and_refs) -> LiveServer:
    from tqserve.server.api_server import ServerConfig, build_app

    engine, _ = engine_and_refs
    config = ServerConfig(api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    server = LiveServer(build_app(config, lambda: engine))
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def refs(engine_and_refs) -> Refs:
    return engine_and_refs[1]


@pytest.fixture(scope="session")
def tokenizer(engine_and_refs) -> Any:
    return engine_and_refs[0].tokenizer


@pytest.fixture()
def client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture()
def http(live):
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600) as c:
        yield c
