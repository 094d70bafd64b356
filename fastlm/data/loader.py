"""An endless, seeded, resumable stream of micro-batches over packed rows.

Rows are drawn from a per-epoch permutation; a batch that runs past the end of an epoch continues in
the next, so no row is dropped and tiny datasets still fill a batch. The state is two integers, which
is what makes resume exact.
"""

from __future__ import annotations

import torch

from fastlm.data.batch import Batch, batch_from_rows
from fastlm.data.datasets import Rows


class BatchLoader:
    """Yields `Batch`es of `batch_size` rows (of `batch_type`: preference pairs count their documents in pairs);
    `state_dict()` / `load_state_dict()` give exact resume."""

    def __init__(self, rows: Rows, batch_size: int, seed: int, shuffle: bool = True, batch_type: type[Batch] = Batch):
        if len(rows) == 0:
            raise ValueError("BatchLoader needs at least one packed row")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.batch_type = batch_type
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=generator)

    def next_index(self) -> int:
        if self.position == len(self.rows):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        index = int(self._order[self.position])
        self.position += 1
        return index

    def next_batch(self) -> Batch:
        picks = torch.tensor([self.next_index() for _ in range(self.batch_size)])
        batch = batch_from_rows(*self.rows.take(picks))
        return batch if self.batch_type is Batch else self.batch_type(**vars(batch))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where `state` was taken; refuse a state taken over different data."""
        if state["rows"] != len(self.rows) or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['rows']} rows / seed {state['seed']}, but this data has "
                f"{len(self.rows)} rows / seed {self.seed}; the data or seed changed since the checkpoint"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)

