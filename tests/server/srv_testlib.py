"""Constants and helpers of the server tests (a uniquely named module so tests can import it)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MAX_MODEL_LEN = 256
API_KEY = "test-key"
MAX_BODY_BYTES = 64 * 1024
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION_PROMPT = "The quick brown fox"
REF_MAX_TOKENS = 8
CONCURRENT_PROMPTS = [f"Write a word about the number {i}:" for i in range(32)]
CONCURRENT_MAX_TOKENS = 5


@dataclass
class Reference:
    prompt_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class Refs:
    chat: Reference
    completion: Reference
    concurrent: list[Reference] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a background thread; `stop()` shuts it down and joins."""

    def __init__(self, app: Any):
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health").status_code == 200:
                return
            time.sleep(0.1)
        raise RuntimeError("server never became ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def run_alone(engine: Any, request_id: str, prompt_ids: list[int], max_tokens: int) -> Reference:
    from tqserve.sampling_params import SamplingParams

    engine.add_request(request_id, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.request_id == request_id
    comp = final.outputs[0]
    return Reference(list(prompt_ids), comp.text, list(comp.token_ids), comp.finish_reason)


def build_engine() -> Any:
    from tqserve.config import EngineArgs
    from tqserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=40))
    # The server on a GPU processes each step's outputs while the next step runs (off on the CPU, where
    # nothing overlaps): these tests serve that way too, so streams, aborts and disconnects are checked
    # with outputs arriving one step late.
    engine.async_output_proc = True
    return engine


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != name:
                continue
            if labels and any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            total += sample.value
            found = True
    assert found, f"metric {name} not exported"
    return total
