"""Programmatic dependent launch (PDL) along the decode chain: query rotation -> attention -> split-K combine
-> finish.

A kernel launched with `launch_pdl` may be scheduled before the kernel ahead of it in the stream has
finished (Hopper and newer): its programs become resident and wait in `griddepcontrol.wait` (`wait`
below) until that kernel has completed and its writes are visible, instead of the launch itself waiting
for the grid to drain. At 1 x 128K the chain's two small kernels around the attention kernel (rotation
3.3 us, combine 3.8 us of a 79.5 us step, H100, docs/benchmarks.md) are mostly launch ramp.

Rules every kernel here keeps (so the chain stays correct whatever runs before it, in or out of a CUDA
graph): a kernel launched with PDL calls `wait` before its first load, so it reads nothing that the
kernel ahead of it may still be writing, and ends after that kernel (which makes completion transitive:
whatever follows a PDL kernel with an ordinary launch sees every earlier write). `trigger` only lets the
next kernel's launch start; it never releases data.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# 0: every launch of the chain is an ordinary one (benchmarks compare both; TQSERVE_PDL=0 in the environment)
PDL = int(os.environ.get("TQSERVE_PDL", "1"))


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: a CUDA device of compute capability 9.0+, not under the
    Triton interpreter (which runs no PTX)."""
    if not PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Extra keyword arguments of a PDL kernel's launch (the kernel's GDC constexpr is `enabled`)."""
    return {"launch_pdl": True} if enabled(device) else {}


@triton.jit
def wait(GDC: tl.constexpr):
    """Block until the kernel ahead in the stream has completed (no-op without GDC or without PDL)."""
    if GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def trigger(GDC: tl.constexpr):
    """Let the next kernel of the stream start its launch (its programs still `wait` for our writes)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
