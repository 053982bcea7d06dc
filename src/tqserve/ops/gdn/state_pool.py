"""Per-request recurrent state of every Gated DeltaNet layer, in fixed slots allocated at startup.

Layout (K-first, the transformers / fla default, `state_v_first=False`):
    conv[l]: [num_slots, conv_dim, K] fp32   the last K conv inputs, most recent last
    ssm[l]:  [num_slots, Hv, dk, dv]  fp32   the delta-rule state
Slot 0 is the null slot: padded rows point at it, kernels skip it, nothing real lives there.
The engine owns slot assignment (running requests and prefix-cache checkpoints); layers only read
and write the slot named in `AttentionMetadata.seq_slots`.
"""

from __future__ import annotations

import torch

# (conv_shape (conv_dim, K), ssm_shape (Hv, dk, dv)) per GDN layer, as `Model.state_specs()` returns.
StateSpec = tuple[tuple[int, int], tuple[int, int, int]]


class StatePool:
    def __init__(self, state_specs: list[StateSpec], num_slots: int, device: torch.device | str) -> None:
        if num_slots < 2:
            raise ValueError("a StatePool needs the null slot 0 plus at least one real slot")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.conv = [torch.zeros(num_slots, *conv, dtype=torch.float32, device=device) for conv, _ in state_specs]
        self.ssm = [torch.zeros(num_slots, *ssm, dtype=torch.float32, device=device) for _, ssm in state_specs]

    @property
    def num_layers(self) -> int:
        return len(self.conv)

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.conv + self.ssm)

    def total_bytes(self) -> int:
        return self.bytes_per_slot() * self.num_slots

    @torch.no_grad()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """state[dst[j]] = state[src[j]] in every layer (checkpoint save / restore for prefix caching).
        src, dst: int device tensors of equal length; dst entries must be distinct."""
        src, dst = src.to(self.device, torch.long), dst.to(self.device, torch.long)
        for t in self.conv + self.ssm:
            t.index_copy_(0, dst, t.index_select(0, src))

    @torch.no_grad()
    def zero_slots(self, slots: torch.Tensor) -> None:
        slots = slots.to(self.device, torch.long)
        for t in self.conv + self.ssm:
            t.index_fill_(0, slots, 0.0)
