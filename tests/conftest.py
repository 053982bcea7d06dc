"""Shared fixtures: the default model loaded once per session, CUDA-less skipping of gpu tests."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without CUDA every Triton kernel runs in the interpreter. The switch is set here, before any test module
# imports a kernel (`triton.jit` reads TRITON_INTERPRET when it decorates a function) and before the
# speed-up imports Triton (which, imported first, left interpreted kernels failing).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_speedup

    interpreter_speedup.install()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_loaded():
    """(model, hf_config, tokenizer) of the default model in float32 on the CPU, shared by tests."""
    from tqserve.models.loader import load_model

    return load_model(None, torch.float32, "cpu")
