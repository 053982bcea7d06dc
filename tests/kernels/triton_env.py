"""Where the Triton kernel tests run: the device, whether the interpreter is on (tests/conftest.py
turns it on without CUDA), and the module mark that skips them when neither is there."""

from __future__ import annotations

import os

import pytest
import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
triton_kernels = pytest.mark.skipif(
    DEV.type == "cpu" and not INTERP, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
