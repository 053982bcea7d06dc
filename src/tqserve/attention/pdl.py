"""Programmatic dependent launch (PDL) between the launches of one attention call.

A decode step over codebook keys is three launches: the query rotation, the attention kernel and
the split-K combine (or the finish kernel). Launched back to back, each one's blocks are scheduled only
after the previous grid has finished and flushed its memory, and at 1 request x 128K, where the whole
step is ~80 us on an H100, those launch gaps are a few microseconds of it. On sm_90 and later a kernel
launched with the programmatic-serialization attribute (`launch_pdl=True` in Triton) may be scheduled
while the previous grid is still running, once every block of that grid has executed
`griddepcontrol.launch_dependents` or exited; `griddepcontrol.wait` then blocks until the previous grid
has completed and its writes are visible.

The rule every kernel here follows (`wait_then_release`): wait first, then release the next launch, and
touch no tensor another launch writes before the wait. Waiting before releasing keeps the chain safe:
when a kernel passes its wait, the grid before it has completed, and that grid released its own
successor only after its own wait, so everything earlier in the stream has completed too. Kernels of
other libraries launched after these are launched without the attribute and wait for everything.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = 1  # 0: plain launches (benchmarks time both)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: on when switched on, on CUDA devices of sm_90 or later,
    never under the interpreter."""
    if not ENABLED or os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Extra launch options of a kernel that calls `wait_then_release` with GDC=`enabled(device)`."""
    return {"launch_pdl": True} if enabled(device) else {}


@triton.jit
def wait_then_release(GDC: tl.constexpr):
    """Wait for the previous grid (its writes visible), then let the next launch be scheduled."""
    if GDC:
        gdc_wait()
        gdc_launch_dependents()
