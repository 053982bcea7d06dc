"""Server behaviour that needs a controllable engine: loading state, load failure, a failing step,
and the `tqserve serve` flags. A tiny fake engine obeys the engine contract (byte-level tokens)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from srv_testlib import LiveServer

from tqserve.outputs import CompletionOutput, RequestOutput
from tqserve.server.api_server import ServerConfig, build_app
from tqserve.server.args import add_serve_args, engine_kwargs, parse_size


class ByteTokenizer:
    vocab_size = 256
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
            "assistant: " if add_generation_prompt else ""
        )
        return self.encode(text) if tokenize else text


@dataclass
class _Req:
    prompt: list[int]
    max_tokens: int
    out: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)


@dataclass
class _ModelConfig:
    model: str = "fake"
    max_model_len: int = 64


class FakeEngine:
    """Emits `script` one byte per step ('a' forever by default), cutting at a stop string the way
    the real engine does (the text loses the stop string and what follows); `fail_on_step` raises."""

    def __init__(self, fail_on_step: int | None = None, script: str | None = None):
        self.script = script
        self.tokenizer = ByteTokenizer()
        self.model_config = _ModelConfig()
        self.reqs: dict[str, _Req] = {}
        self.steps = 0
        self.fail_on_step = fail_on_step
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt_token_ids, params):
        self.reqs[request_id] = _Req(list(prompt_token_ids), params.max_tokens or 8, stop=list(params.stop or []))

    def abort_request(self, request_ids):
        for rid in request_ids:
            if self.reqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("simulated device failure")
        time.sleep(0.01)
        outs = []
        for rid, r in list(self.reqs.items()):
            r.out.append(ord(self.script[len(r.out)]) if self.script else ord("a"))
            text = self.tokenizer.decode(r.out)
            done = len(r.out) >= r.max_tokens
            reason = "length" if done else None
            for stop in r.stop:
                if stop in text:
                    text, done, reason = text[: text.index(stop)], True, "stop"
            comp = CompletionOutput(0, text, list(r.out), finish_reason=reason)
            outs.append(RequestOutput(rid, None, r.prompt, [comp], done))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self) -> dict:
        return {"num_running": len(self.reqs), "num_waiting": 0, "kv_cache_usage": 0.0}


def _serve(factory, **config) -> LiveServer:
    return LiveServer(build_app(ServerConfig(warmup=False, **config), factory))


def test_health_is_503_until_the_engine_is_ready():
    gate = threading.Event()

    def slow_factory():
        gate.wait(30)
        return FakeEngine()

    srv = _serve(slow_factory)
    try:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503
        assert r.json()["error"] == {
            "message": "Loading model",
            "type": "unavailable_error",
            "param": None,
            "code": 503,
        }
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        gate.set()
        srv.wait_ready(30)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaa"
    finally:
        gate.set()
        srv.stop()


def test_load_failure_is_reported_and_stops_the_server():
    failures = []

    def broken_factory():
        raise OSError("weights not found")

    app = build_app(ServerConfig(warmup=False), broken_factory, on_load_failure=failures.append)
    srv = LiveServer(app)
    try:
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.02)
        assert failures and isinstance(failures[0], OSError)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "weights not found" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_engine_error_mid_stream_is_an_sse_error_event_and_serving_continues():
    engine = FakeEngine(fail_on_step=3)
    srv = _serve(lambda: engine)
    try:
        srv.wait_ready(30)
        body = {"prompt": "x", "max_tokens": 10, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 500 and "simulated device failure" in err["message"]
        assert json.loads(events[0])["choices"][0]["text"] == "a"  # tokens before the failure arrived
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aa"
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 200
    finally:
        srv.stop()


def test_stream_never_shows_text_a_stop_string_later_removes():
    # The stop string "world" arrives over five steps; the engine only cuts it at the last one.
    srv = _serve(lambda: FakeEngine(script="hello world, again"))
    try:
        srv.wait_ready(30)
        body = {"prompt": "x", "max_tokens": 16, "stop": ["world"], "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == "hello "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        srv.stop()


class BrokenLoopEngine(FakeEngine):
    """has_unfinished_requests() itself fails once a request is in: a bug outside step()."""

    def has_unfinished_requests(self) -> bool:
        if self.reqs:
            raise RuntimeError("scheduler invariant broken")
        return False


def test_a_dead_engine_loop_fails_requests_and_health_instead_of_hanging():
    srv = _serve(BrokenLoopEngine)
    try:
        srv.wait_ready(30)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "scheduler invariant broken" in r.json()["error"]["message"]
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "engine loop died" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503
    finally:
        srv.stop()


def test_engine_error_without_stream_is_a_500_envelope():
    srv = _serve(lambda: FakeEngine(fail_on_step=1))
    try:
        srv.wait_ready(30)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
    finally:
        srv.stop()


def test_serve_flags_use_vllm_names():
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "my/model",
            "--host", "0.0.0.0", "--port", "9000", "--max-model-len", "32k", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "4096", "--block-size", "32", "--kv-cache-dtype", "fp8",
            "--gpu-memory-utilization", "0.8", "--no-enable-prefix-caching", "--enable-chunked-prefill",
            "--served-model-name", "a", "b", "--api-key", "k", "--dtype", "bfloat16", "--seed", "3",
            "--device", "cpu", "--kv-cache-memory", "2GiB", "--max-request-body-bytes", "1M",
        ]
    )  # fmt: skip
    kw = engine_kwargs(args)
    assert kw == {
        "model": "my/model",
        "dtype": "bfloat16",
        "max_model_len": 32000,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 4096,
        "block_size": 32,
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": 0.8,
        "kv_cache_memory_bytes": 2 * 2**30,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        "seed": 3,
        "device": "cpu",
        "served_model_name": "a",
    }
    assert (args.host, args.port, args.api_key, args.max_request_body_bytes) == ("0.0.0.0", 9000, "k", 10**6)
    assert ServerConfig.from_args(args).served_model_names == ["a", "b"]


def test_no_model_means_default_and_env_api_key(monkeypatch):
    monkeypatch.setenv("TQSERVE_API_KEY", "from-env")
    args = add_serve_args(argparse.ArgumentParser()).parse_args([])
    assert engine_kwargs(args) == {"model": None}
    assert args.api_key == "from-env"


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("2G", 2 * 10**9), ("1.5GiB", 3 * 2**29), ("512k", 512000)]
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_run_server_exits_1_when_the_model_cannot_load(tmp_path):
    import os
    import subprocess
    import sys

    from srv_testlib import free_port

    code = (
        "import argparse, sys\n"
        "from tqserve.server.args import add_serve_args\n"
        "from tqserve.server.api_server import run_server\n"
        "run_server(add_serve_args(argparse.ArgumentParser()).parse_args(sys.argv[1:]))\n"
    )
    missing = str(tmp_path / "no-such-model")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [sys.executable, "-c", code, missing, "--port", str(free_port()), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "engine failed to load" in proc.stderr
