"""Invariant 2: no host/device syncs in model, layer, attention, kernel or codec code."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2] / "src" / "tqserve"
GUARDED = ["models", "layers", "attention", "ops", "kvquant", "spec_decode"]
PATTERN = re.compile(r"\.item\(\)|\.tolist\(\)|\.cpu\(\)|torch\.tensor\(\s*\[|\.nonzero\(")


def test_no_host_sync_in_device_code():
    offenders = []
    for sub in GUARDED:
        for path in (ROOT / sub).rglob("*.py"):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if PATTERN.search(code):
                    offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "host syncs in device code:\n" + "\n".join(offenders)


def test_the_check_catches_a_sync(tmp_path):
    assert PATTERN.search("x = logits.argmax().item()")
    assert PATTERN.search("t = torch.tensor([1, 2])")
    assert not PATTERN.search("t = torch.as_tensor(buf)")
