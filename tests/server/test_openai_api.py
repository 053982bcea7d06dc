"""The official openai client against a live server: results equal the offline engine's."""

from __future__ import annotations

import json

import pytest
from srv_testlib import CHAT_MESSAGES, COMPLETION_PROMPT, MAX_MODEL_LEN, REF_MAX_TOKENS, metric_value

MODEL = "SmolLM2-135M-Instruct"


def test_chat_matches_offline_engine(client, refs, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=REF_MAX_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == refs.chat.text
    assert choice.finish_reason == refs.chat.finish_reason
    # Usage equals the tokenizer's own counts.
    assert r.usage.prompt_tokens == len(refs.chat.prompt_ids)
    assert r.usage.completion_tokens == len(refs.chat.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.model == MODEL and r.object == "chat.completion"


def test_chat_stream_with_usage(client, refs):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_completion_tokens=REF_MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == refs.chat.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [refs.chat.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == len(refs.chat.prompt_ids)
    assert last.usage.completion_tokens == len(refs.chat.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(http, refs):
    body = {"messages": CHAT_MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    usage_chunk = json.loads(lines[-2][6:])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


def test_completion_matches_offline_engine(client, refs):
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0)
    assert r.choices[0].text == refs.completion.text
    assert r.choices[0].finish_reason == refs.completion.finish_reason
    assert r.usage.prompt_tokens == len(refs.completion.prompt_ids)
    assert r.usage.completion_tokens == len(refs.completion.token_ids)


def test_completion_stream(client, refs):
    stream = client.completions.create(
        model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == refs.completion.text
    assert chunks[-1].choices[0].finish_reason == refs.completion.finish_reason


def test_completion_prompt_forms(client, refs):
    ids = refs.completion.prompt_ids
    for prompt in (ids, [ids, ids], [COMPLETION_PROMPT, COMPLETION_PROMPT]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=REF_MAX_TOKENS, temperature=0)
        n_prompts = 2 if isinstance(prompt[0], (list, str)) else 1
        assert [c.index for c in r.choices] == list(range(n_prompts))
        assert all(c.text == refs.completion.text for c in r.choices)
        assert r.usage.prompt_tokens == n_prompts * len(ids)
        assert r.usage.completion_tokens == n_prompts * len(refs.completion.token_ids)


def test_completion_echo(client, refs):
    r = client.completions.create(
        model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0, echo=True
    )
    assert r.choices[0].text == COMPLETION_PROMPT + refs.completion.text


def test_completion_echo_logprobs_scores_the_prompt(client, refs):
    # What lm-eval's loglikelihood requests look like: echo + logprobs + max_tokens=1.
    n_prompt = len(refs.completion.prompt_ids)
    for stream in (False, True):
        kwargs = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 1, "temperature": 0}
        r = client.completions.create(echo=True, logprobs=1, stream=stream, **kwargs)
        if stream:
            chunks = [c for c in r if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            token_lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
        else:
            lp = r.choices[0].logprobs
            text, tokens, token_lps = r.choices[0].text, lp.tokens, lp.token_logprobs
        assert text == COMPLETION_PROMPT + refs.completion.text[: len(text) - len(COMPLETION_PROMPT)]
        assert len(tokens) == len(token_lps) == n_prompt + 1
        assert "".join(tokens) == text
        assert token_lps[0] is None
        assert all(x is not None and x <= 0 for x in token_lps[1:])


def test_n2_and_seed_reproducible(client):
    kwargs = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 1234}
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 2 <= a.usage.completion_tokens <= 12
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=4, temperature=0.8, n=2, seed=7
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens <= 8


def test_n2_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=3, temperature=0, n=2, stream=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1] and texts[0]  # greedy: both samples agree


def test_stop_string(client, refs):
    text = refs.chat.text
    words = text.split()
    assert len(words) >= 3, f"reference too short to pick a stop string: {text!r}"
    stop = words[2]
    cut = text.index(stop)
    for stream in (False, True):
        kwargs = {
            "model": MODEL,
            "messages": CHAT_MESSAGES,
            "max_tokens": REF_MAX_TOKENS,
            "temperature": 0,
            "stop": [stop],
        }
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        else:
            r = client.chat.completions.create(**kwargs)
            got, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == text[:cut]
        assert reason == "stop"


def test_chat_logprobs(client, refs):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-4)
        assert e.top_logprobs[0].token == e.token


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) >= 2 for t in lp.top_logprobs)


def test_models_health_version(http):
    r = http.get("/v1/models")
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == MAX_MODEL_LEN
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/v1/models/other").status_code == 404
    assert http.get("/health").json() == {"status": "ok"}
    assert "version" in http.get("/version").json()


def test_tokenize_detokenize(http, tokenizer, refs):
    r = http.post("/tokenize", json={"prompt": COMPLETION_PROMPT}).json()
    assert r["tokens"] == tokenizer.encode(COMPLETION_PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    r = http.post("/tokenize", json={"messages": CHAT_MESSAGES}).json()
    assert r["tokens"] == refs.chat.prompt_ids
    r = http.post("/detokenize", json={"tokens": refs.completion.prompt_ids}).json()
    assert r["prompt"] == COMPLETION_PROMPT


def test_list_content_and_chat_template_kwargs(client, refs):
    messages = [{"role": "user", "content": [{"type": "text", "text": CHAT_MESSAGES[0]["content"]}]}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=REF_MAX_TOKENS,
        temperature=0,
        extra_body={"chat_template_kwargs": {}, "top_k": 1, "ignore_eos": False},
    )
    assert r.choices[0].message.content == refs.chat.text


def test_ignore_eos_and_length(client):
    r = client.completions.create(
        model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_metrics_exported(http):
    http.post("/v1/completions", json={"prompt": COMPLETION_PROMPT, "max_tokens": 2})
    text = httpx_get_metrics(http)
    for name in (
        "tqserve:num_requests_running",
        "tqserve:num_requests_waiting",
        "tqserve:kv_cache_usage_perc",
        "tqserve:prefix_cache_queries_total",
        "tqserve:prefix_cache_hits_total",
        "tqserve:num_preemptions_total",
        "tqserve:time_to_first_token_seconds_count",
        "tqserve:inter_token_latency_seconds_count",
        "tqserve:e2e_request_latency_seconds_count",
        "tqserve:request_queue_time_seconds_count",
    ):
        metric_value(text, name)
    assert metric_value(text, "tqserve:prompt_tokens_total") > 0
    assert metric_value(text, "tqserve:generation_tokens_total") > 0
    assert metric_value(text, "tqserve:request_success_total") > 0
    assert metric_value(text, "tqserve:e2e_request_latency_seconds_count") > 0


def httpx_get_metrics(http) -> str:
    r = http.get("/metrics")
    assert r.status_code == 200
    return r.text
