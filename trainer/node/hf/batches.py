"""Micro-batches of rows for one rank, a pure function of (seed, step, rank, world size) as for the
built-in model (trainer.node.data.ShardedBatches): resuming at a step resumes the data.

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
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from trainer.node.hf.chat import IGNORE

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
        count = torch.tensor(float(num_items), device=self.device)
        return tensors[0], tensors[1], position_ids, count


class FinetuneBatches:
    """`batch(position)`: the position-th micro-batch this rank trains on (see the module docstring)."""

    def __init__(
        self,
        collator: Collator,
        *,
        repeats: int,
        micro_batch_size: int,
        accumulation: int,
        rank: int,
        world_size: int,
        seed: int,
    ):
        self.collator = collator
        rows = collator.rows
        self.row_count = len(rows)
        self.row_labels = rows.totals(collator.samples.label_counts())
        self.row_tokens = rows.totals(collator.samples.lengths())
        self.length = self.row_count * repeats
        self.micro_batch_size, self.accumulation = micro_batch_size, accumulation
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.batches_per_epoch = (self.length // world_size) // micro_batch_size
        self._epoch_order = lru_cache(maxsize=2)(self._order)

    def _order(self, epoch: int) -> np.ndarray:
        # What DistributedSampler(shuffle=True, drop_last=True) draws: randperm seeded with seed + epoch,
        # cut to a multiple of the world size; rank r takes every world_size-th index from r.
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(self.length, generator=generator).numpy()
        return order[: (self.length // self.world_size) * self.world_size] % self.row_count

    def rows_at(self, position: int, rank: int) -> list[int]:
        epoch, within = divmod(position, self.batches_per_epoch)
        mine = self._epoch_order(epoch)[rank :: self.world_size]
        return mine[within * self.micro_batch_size : (within + 1) * self.micro_batch_size].tolist()

    def _step_rows(self, position: int) -> list[int]:
        first = (position // self.accumulation) * self.accumulation
        return [
            row
            for p in range(first, first + self.accumulation)
            for rank in range(self.world_size)
            for row in self.rows_at(p, rank)
        ]

    def batch(self, position: int) -> Batch:
        step_labels = int(self.row_labels[self._step_rows(position)].sum())
        num_items = max(1, step_labels) / (self.world_size * self.accumulation)
        return self.collator.collate(self.rows_at(position, self.rank), num_items)

    def step_tokens(self, first_position: int, count: int) -> int:
        """Tokens (pads not counted) that all ranks train on in micro-batches [first, first + count)."""
        return sum(
            int(self.row_tokens[self.rows_at(p, rank)].sum())
            for p in range(first_position, first_position + count)
            for rank in range(self.world_size)
        )


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
