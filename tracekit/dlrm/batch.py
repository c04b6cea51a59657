"""The batch layout shared by every data source and the sharded embeddings.

Sparse features use the KeyedJaggedTensor layout of TorchRec, flattened:

    lengths  int64 [T, b]   ids in the bag of table t for local sample s
    values   int64 [sum(lengths)]   row ids, ordered (table, sample, position)

Example, 2 tables, 2 samples: lengths [[1, 2], [0, 1]] and values [7, 3, 9, 4] mean
sample 0 looks up row 7 of t0 and nothing of t1; sample 1 rows 3, 9 of t0 and row 4 of t1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    dense: torch.Tensor  # float32 [b, num_dense]
    lengths: torch.Tensor  # int64 [T, b]
    values: torch.Tensor  # int64 [lengths.sum()], ordered (table, sample, position)
    labels: torch.Tensor  # float32 [b], 0 or 1

    @property
    def size(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in (self.dense, self.lengths, self.values, self.labels)))

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        """Join batches sample-wise (for tests and for readers that build a batch in pieces)."""
        T = batches[0].lengths.shape[0]
        per_table = [torch.cat([b.values[_table_slice(b.lengths, t)] for b in batches]) for t in range(T)]
        return Batch(
            dense=torch.cat([b.dense for b in batches]),
            lengths=torch.cat([b.lengths for b in batches], dim=1),
            values=torch.cat(per_table),
            labels=torch.cat([b.labels for b in batches]),
        )


def _table_slice(lengths: torch.Tensor, t: int) -> slice:
    per_table = lengths.sum(dim=1)
    start = int(per_table[:t].sum())
    return slice(start, start + int(per_table[t]))
