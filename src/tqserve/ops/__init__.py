"""GPU kernels beside the model layers (each module names its torch reference).

`FUSED` switches the one-launch elementwise kernels (`rms_norm`, `rope`, `silu_mul`) on for CUDA
tensors; CPU tensors always take the layers' torch expressions, which are the references.
"""

import os

import torch

FUSED = os.environ.get("TQSERVE_FUSED_OPS", "1") != "0"  # the environment switch is for A/B runs


def fused(x: torch.Tensor) -> bool:
    """Whether a layer should call its one-launch kernel for x (CUDA tensors while `FUSED`)."""
    return FUSED and x.is_cuda
