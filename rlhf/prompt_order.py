"""The order in which prompts are drawn: a seeded shuffle per epoch, with a resumable position."""

from __future__ import annotations

import torch


class PromptOrder:
    """Global batches of `batch_size` dataset indices, each epoch a permutation drawn from (seed, epoch) alone, so
    the state is (epoch, position). An epoch's last partial batch is dropped."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        if num_examples < batch_size:
            raise ValueError(f"the training set has {num_examples} prompts, fewer than one batch of {batch_size}.")
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices, starting the next epoch's permutation when this one runs out."""
        if self.position + self.batch_size > self.num_examples:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict:
        """(epoch, position): all a resumed run needs to draw the same batches."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
