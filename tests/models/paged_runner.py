"""Run a model through the engine's pure-torch reference attention over real KV pages.

Test-side stand-in for the model runner: builds `AttentionMetadata` for steps of a few requests
(request r owns a fixed run of pages) and keeps the pages between steps, so prefill in chunks and
decode read what earlier steps stored.
"""

from __future__ import annotations

import torch

from tqserve.attention.backend import AttentionMetadata
from tqserve.attention.reference import KVCacheStore, ReferenceBackend
from tqserve.kvquant.base import ExactFormat
from tqserve.layers.attention import ForwardContext


class PagedRunner:
    def __init__(self, model, max_reqs: int = 4, max_len: int = 256, block_size: int = 16):
        self.model = model
        self.block_size = block_size
        self.blocks_per_req = -(-max_len // block_size)
        formats = [
            ExactFormat(hkv, d, model.dtype, i, storage_dtype=torch.float32)
            for i, (hkv, d) in enumerate(model.kv_layer_specs())
        ]
        num_blocks = 1 + max_reqs * self.blocks_per_req  # page 0 is the null page
        self.backend = ReferenceBackend(
            KVCacheStore(formats, num_blocks, block_size, max_reqs + 1, max_reqs + 1, "cpu")
        )

    def _pages(self, req: int) -> list[int]:
        first = 1 + req * self.blocks_per_req
        return list(range(first, first + self.blocks_per_req))

    def step(self, chunks: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """chunks: (request index, number of tokens it already has, its new token ids).
        Returns logits [sum of new tokens, vocab], float32."""
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        bs = self.block_size
        for req, start, new in chunks:
            pages = self._pages(req)
            for p in range(start, start + len(new)):
                positions.append(p)
                slots.append(pages[p // bs] * bs + p % bs)
            ids += new
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(start + len(new))
            tables.append(pages)
        n = len(chunks)
        seq_slots = [req + 1 for req, _, _ in chunks]
        meta = AttentionMetadata(
            num_reqs=n,
            num_tokens=len(ids),
            max_query_len=max(len(c[2]) for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.as_tensor(qsl, dtype=torch.int32),
            seq_lens=torch.as_tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.as_tensor(tables, dtype=torch.int32),
            slot_mapping=torch.as_tensor(slots, dtype=torch.int64),
            positions=torch.as_tensor(positions, dtype=torch.int64),
            seq_slots=torch.as_tensor(seq_slots, dtype=torch.int32),
            sink_slots=torch.as_tensor(seq_slots, dtype=torch.int32),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            seq_slots_cpu=seq_slots,
            sink_slots_cpu=seq_slots,
            block_tables_cpu=tables,
            slot_mapping_cpu=slots,
        )
        with torch.no_grad():
            hidden = self.model(meta.positions.new_tensor(ids), meta.positions, ForwardContext(self.backend, meta))
            return self.model.compute_logits(hidden)


def prefill_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of one request, prefilled in a single step."""
    return PagedRunner(model, max_reqs=1, max_len=max(16, input_ids.numel())).step([(0, 0, input_ids.tolist())])
