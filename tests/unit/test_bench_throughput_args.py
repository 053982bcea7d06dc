"""`tqserve bench throughput` argument checks that run before any model is loaded."""

from __future__ import annotations

import pytest

from tqserve.bench.throughput import main


@pytest.mark.parametrize("spread", ["-1", "10", "15"])
def test_prompt_len_spread_must_leave_a_prompt(spread, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--prompt-len", "10", "--prompt-len-spread", spread, "--skip-transformers"])
    assert e.value.code == 2
    assert "--prompt-len-spread" in capsys.readouterr().err
