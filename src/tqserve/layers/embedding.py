"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tqserve.layers.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits in float32. With `tied` the weight is the embedding's own Parameter (one copy in memory)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None, tied: VocabEmbedding | None = None
    ):
        super().__init__()
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype (an fp32 copy of a large vocab matrix per step would
        # cost more than it buys); only the [N, vocab] result is widened for the sampler.
        return linear(hidden, self.weight).float()
