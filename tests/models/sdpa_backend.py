"""A test-only attention backend: causal SDPA over the step's own tokens, ignoring pages.

Correct only when every request's whole sequence is in the step (a full prefill), which is all
the model-vs-transformers tests need. With `meta=None` the step is one request.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tqserve.attention.backend import AttentionBackend


class PrefillSDPABackend(AttentionBackend):
    def forward(self, layer_idx, q, k, v, meta, scale):
        bounds = [0, q.shape[0]] if meta is None else meta.query_start_loc_cpu
        groups = q.shape[1] // k.shape[1]
        outs = []
        for start, end in itertools.pairwise(bounds):
            qi, ki, vi = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, t, d]
            ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(outs)
