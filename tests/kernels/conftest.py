"""Kernel tests run on CUDA or, without it, under the Triton interpreter. The switch is set here, before the
test modules import any kernel: `triton.jit` reads TRITON_INTERPRET when it decorates a function."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
