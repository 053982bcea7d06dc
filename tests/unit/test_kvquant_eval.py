"""The evaluation's own arithmetic: windows, KL / top-1 summaries, needle prompt construction, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from tqserve.eval import cli, needle, ppl, report


def test_token_windows_cover_prefix():
    ids = list(range(10))
    assert ppl.token_windows(ids, 4, 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail predicts nothing
    assert ppl.token_windows(ids, 4, 10) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_compare_and_summarize():
    ref = torch.log_softmax(torch.randn(50, 11), -1)
    same = ppl.summarize(ppl.compare(ref, ref.clone(), torch.randint(0, 11, (50,))))
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-6) and same["top1_agree"] == 1.0
    assert same["ppl_delta_pct"] == pytest.approx(0.0, abs=1e-9)
    flat = torch.full_like(ref, -torch.log(torch.tensor(11.0)))
    s = ppl.summarize(ppl.compare(ref, flat, torch.randint(0, 11, (50,))))
    assert s["kl_mean"] > 0.05 and s["kl_p99"] >= s["kl_mean"]


class _CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_needle_case_has_exact_length_and_answer():
    tok = _CharTokenizer()
    hay = tok.encode("lorem ipsum " * 400)
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = needle.build_case(tok, hay, 1500, depth, seed=3)
        assert len(prompt) + len(answer) == 1500
        text = "".join(map(chr, prompt))
        digits = "".join(map(chr, answer)).strip()
        assert text.count(f"secret number is {digits}") == 2
        assert text.endswith(needle.QUESTION)
    with pytest.raises(ValueError):
        needle.build_case(tok, hay[:100], 1500, 0.5, seed=0)


def test_report_table_and_cli_merge(tmp_path):
    rows = [{"preset": "a", "x": 1.23456}, {"preset": "b", "x": 2.0}]
    t = report.table(rows, [("preset", "p", ""), ("x", "x", ".2f")])
    assert "| a | 1.23 |" in t and t.count("\n") == 3
    # Integer columns may hold a per-layer preset's mean page bytes (a float).
    t = report.table([{"b": 68}, {"b": 68.0}, {"b": 71.8}], [("b", "b", "d")])
    assert t.splitlines()[2:] == ["| 68 |", "| 68 |", "| 71.80 |"]
    base = {"preset": "auto", "bits": 16.0, "ppl_delta_pct": 0.0, "kl_mean": 0.0}
    for i, name in enumerate(("one", "two")):
        row = dict(base, preset=name, bits=4.0 + i, ppl_delta_pct=0.1, kl_mean=0.01)
        data = {"window": 8, "max_tokens": 16, "num_windows": 2, "rows": [base, row]}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    inputs = ",".join(str(tmp_path / f"{n}.json") for n in ("one", "two"))
    assert cli.main(["merge", "--inputs", inputs, "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "ppl.json").read_text())
    assert [r["preset"] for r in merged["rows"]] == ["auto", "two", "one"]
    assert (tmp_path / "m" / "ppl.png").stat().st_size > 1000


def test_direct_runner_scores_the_last_rows():
    """`--backend direct` scores needle cells through `logprobs(ids, last=n)`, like the engine runner."""
    from tqserve.eval.runner import DirectRunner

    runner = DirectRunner("tq4", 64)
    ids = list(range(10, 40))
    full = runner.logprobs(ids)
    assert full.shape[0] == len(ids) - 1
    assert torch.equal(runner.logprobs(ids, last=4), full[-4:])


def test_engine_runner_scores_a_case_as_long_as_the_context(monkeypatch):
    """Needle cells of the model's full length (8,192 on SmolLM2) go through the engine: the final
    token is never an input, so the request fits `max_model_len`; the rows equal the full scoring."""
    from tqserve.eval import runner as runner_mod

    monkeypatch.setattr(runner_mod, "_model_max", lambda device: 48)
    runner = runner_mod.EngineRunner("tq4", 48)
    assert runner.llm.engine.model_config.max_model_len == 48
    ids = list(range(100, 148))
    last = runner.logprobs(ids, last=5)
    assert last.shape[0] == 5
    shorter = runner.logprobs(ids[:-1])  # 47 tokens: rows predicting tokens 1..46
    torch.testing.assert_close(last[:-1], shorter[-4:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        runner.logprobs(ids)  # the whole case as a prompt needs a position past the model's context
