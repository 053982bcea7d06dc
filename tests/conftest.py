"""Shared fixtures: the default model loaded once per session, CUDA-less skipping of gpu tests."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import interpreter_speedup  # noqa: E402

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
