"""Micro-batches of rows for one rank, cut from the run's sample order (trainer.node.order) as for the
built-in model: the order is over rows (a packed row holds several samples), a function of the samples
consumed, so a resume continues sample-exact at any world size with the same effective batch.

A micro-batch is `(input_ids, labels, position_ids, num_items_in_batch)`, what the loss wrapper
(trainer.node.hf.model.CausalLMLoss) takes:
- rows padded on the right to the longest in the batch (causal attention never looks right, so no
  attention mask is needed; pads carry no label);
- in a packed row, each sample's first label is IGNORE (it would be predicted from the previous
  sample's last token) and, where the model keeps attention within samples, position_ids restart
  at 0 for every sample (None otherwise: plain packing);
- num_items_in_batch = label tokens of the whole optimizer step on all ranks / (world size ×
  accumulation). The loss is summed over tokens and divided by it, so after the engines average
  micro-batches and ranks the gradient is that of the mean over every label token of the step, the
  same however the tokens fall into micro-batches and ranks (Hugging Face Trainer's
  `average_tokens_across_devices`). Every rank computes it from the rows alone: no collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from trainer.node.hf.chat import IGNORE
from trainer.node.order import StepBatches

if TYPE_CHECKING:
    from trainer.node.hf.dataset import Samples
    from trainer.node.hf.packing import Rows

Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor]


class Collator:
    """Rows of samples to padded tensors on the device."""

    def __init__(self, samples: Samples, rows: Rows, *, pad_id: int, reset_positions: bool, device: str):
        self.samples, self.rows = samples, rows
        self.pad_id = pad_id
        self.reset_positions = reset_positions
        self.device = torch.device(device)
        # Tensor cores want multiples of 8; on the CPU the extra pads would be pure waste.
        self.multiple = 8 if self.device.type == "cuda" else 1

    def collate(self, row_indices: list[int], num_items: float) -> Batch:
        rows = [self.rows.row(i) for i in row_indices]
        lengths = [int(self.samples.offsets[r + 1].sum() - self.samples.offsets[r].sum()) for r in rows]
        width = -(-max(lengths) // self.multiple) * self.multiple
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64) if self.reset_positions else None
        for b, members in enumerate(rows):
            at = 0
            for sample in members:
                ids, sample_labels = self.samples.sample(int(sample))
                end = at + len(ids)
                input_ids[b, at:end] = ids
                labels[b, at:end] = sample_labels
                labels[b, at] = IGNORE
                if positions is not None:
                    positions[b, at:end] = np.arange(len(ids))
                at = end
            if positions is not None:  # the pads as a sample of their own: they never touch a real one
                positions[b, at:] = np.arange(width - at)
        tensors = [torch.from_numpy(input_ids), torch.from_numpy(labels)]
        if positions is not None:
            tensors.append(torch.from_numpy(positions))
        if self.device.type != "cpu":
            tensors = [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]
        position_ids = tensors[2] if positions is not None else None
        # Filled on the device: torch.tensor(value, device=...) copies from pageable memory, which
        # waits for the GPU to finish the work queued before it (a sync per micro-batch).
        count = torch.full((), float(num_items), device=self.device)
        return tensors[0], tensors[1], position_ids, count


class FinetuneBatches(StepBatches):
    """This rank's micro-batches of each step (see the module docstring); the order is over rows."""

    def __init__(
        self,
        collator: Collator,
        *,
        repeats: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ):
        rows = collator.rows
        super().__init__(
            num_samples=len(rows),
            repeats=repeats,
            micro_batch_size=micro_batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
        self.collator = collator
        self.row_labels = rows.totals(collator.samples.label_counts())
        self.row_tokens = rows.totals(collator.samples.lengths())

    def _collate(self, chosen: np.ndarray, step: int) -> Batch:
        # Every rank sums the same rows of the step: the same divisor everywhere, with no collective.
        step_labels = int(self.row_labels[self.step_samples(step)].sum())
        num_items = max(1, step_labels) / (self.world_size * self.accumulation)
        return self.collator.collate(chosen.tolist(), num_items)

    def step_tokens(self, step: int) -> int:
        """Tokens (pads not counted) that all ranks train on in step `step`."""
        return int(self.row_tokens[self.step_samples(step)].sum())

    def logged_ids(self, chosen: np.ndarray) -> list[int]:
        return [int(sample) for row in chosen for sample in self.collator.rows.row(int(row))]


class EvalBatches:
    """This rank's eval micro-batches with their label-token counts, collated as they are used. Every
    rank gets the same count of batches: a rank with nothing left repeats a row with no labels."""

    def __init__(self, collator: Collator, *, micro_batch_size: int, rank: int, world_size: int):
        self.collator = collator
        total = len(collator.rows)
        mine = list(range(rank, total, world_size))
        per_rank = math.ceil(total / world_size)
        batch_count = math.ceil(per_rank / micro_batch_size)
        self.chunks = [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(batch_count)]
        self.row_labels = collator.rows.totals(collator.samples.label_counts())

    def __iter__(self) -> Iterator[tuple[Batch, int]]:
        for chosen in self.chunks:
            if chosen:
                # num_items 1: the loss comes back summed over tokens; eval_loss divides by the total.
                yield self.collator.collate(chosen, 1.0), int(self.row_labels[chosen].sum())
            else:
                input_ids, labels, positions, count = self.collator.collate([0], 1.0)
                yield (input_ids, torch.full_like(labels, IGNORE), positions, count), 0
