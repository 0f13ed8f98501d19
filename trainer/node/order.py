"""The run's sample order: which samples each optimizer step trains, as a function of the samples
consumed, the same whatever the number of processes.

An epoch is a seeded permutation of all samples × repeats (torch.randperm seeded with seed + epoch,
the permutation DistributedSampler drew before); an entry `i` stands for sample `i % samples`. Steps
take an epoch's permutation E entries at a time (E = effective batch = micro batch × world size ×
accumulation), so with one E throughout, optimizer step s (1-based) trains positions [(s-1)·E, s·E)
of the run's order: the epochs one after the other, each cut to a whole number of steps. The last
`length mod E` entries of an epoch are not trained (as before, when the sampler dropped what did not
fill a micro-batch on every rank) and a step never spans two epochs.

Within a step, micro-batch `a` of rank `r` holds entries [(a·W + r)·m, (a·W + r + 1)·m) of the step's E
(W the world size, m the micro batch). So any world size with the same E trains the same E samples in
each step, and with the same micro batch even the same micro-batches: a run resumed on 1 process with
the accumulation doubled computes what 2 processes did, summed in another order.

A checkpoint records the `Position` after its step (the samples consumed, the epoch and how far into
it); a resumed run continues from there. With the same E at any world size that is sample-exact: no
sample skipped or seen twice. With another E it continues at the same place of the epoch, and a step
that no longer fits the rest of the epoch starts the next one.

Test hook: TRAINER_TEST_SAMPLE_LOG=<dir> makes each rank append a JSON line per micro-batch it trains to
`<dir>/rank-<R>.jsonl`: {"step", "micro_batch", "rank", "world_size", "samples"} (the samples' ids:
indices into the training samples; a packed row's samples for Hugging Face fine-tuning).

numpy and torch are imported inside functions: trainer.node.data (loaded with the configuration on
the controller) imports this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

SAMPLE_LOG_VARIABLE = "TRAINER_TEST_SAMPLE_LOG"


@dataclass(frozen=True)
class Position:
    """Where a run stands in its sample order after `step` optimizer steps."""

    step: int
    samples_consumed: int
    """Samples trained so far, all ranks and steps together (the epochs' cut ends not counted)."""
    epoch: int
    offset: int
    """Entries of the epoch's permutation trained so far."""

    def to_state(self, *, effective_batch: int, epoch_length: int) -> dict[str, int]:
        """The checkpoint's record (clustertrain_state.json `data_position`)."""
        return {
            "epoch": self.epoch,
            "epoch_offset": self.offset,
            "epoch_length": epoch_length,
            "effective_batch": effective_batch,
        }


START = Position(step=0, samples_consumed=0, epoch=0, offset=0)


def position_after_steps(steps: int, *, effective_batch: int, epoch_length: int) -> Position:
    """The position after `steps` steps of E = effective_batch from the start (an older checkpoint,
    which did not record its position, resumes from here: step × E)."""
    per_epoch = epoch_length // effective_batch
    epoch, within = divmod(steps, per_epoch)
    if within == 0 and epoch > 0:  # the end of an epoch, not the start of the next
        epoch, within = epoch - 1, per_epoch
    return Position(
        step=steps, samples_consumed=steps * effective_batch, epoch=epoch, offset=within * effective_batch
    )


class SampleOrder:
    """The samples of each step after `start`, for one effective batch (see the module docstring)."""

    def __init__(self, *, num_samples: int, repeats: int, seed: int, effective_batch: int, start: Position):
        self.num_samples = num_samples
        self.length = num_samples * repeats
        self.seed = seed
        self.effective_batch = effective_batch
        self.start = start
        self.steps_per_epoch = self.length // effective_batch
        if self.steps_per_epoch < 1:  # data.required_repeats refuses this before anything starts
            raise ValueError(f"{self.length} samples cannot fill one effective batch of {effective_batch}")
        self._first_epoch_steps = max(0, self.length - start.offset) // effective_batch
        self._permutation = lru_cache(maxsize=2)(self._draw)

    def _draw(self, epoch: int) -> np.ndarray:
        import torch

        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator).numpy()

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, offset of the step's first entry) for a step after the start."""
        if step <= self.start.step:
            raise ValueError(f"step {step} is not after the start of this order (step {self.start.step})")
        index = step - self.start.step - 1
        if index < self._first_epoch_steps:
            return self.start.epoch, self.start.offset + index * self.effective_batch
        index -= self._first_epoch_steps
        epoch, within = divmod(index, self.steps_per_epoch)
        return self.start.epoch + 1 + epoch, within * self.effective_batch

    def samples(self, step: int) -> np.ndarray:
        """The E sample indices step `step` trains, in the order the ranks' micro-batches split them."""
        epoch, offset = self.locate(step)
        return self._permutation(epoch)[offset : offset + self.effective_batch] % self.num_samples

    def position_after(self, step: int) -> Position:
        epoch, offset = self.locate(step)
        consumed = self.start.samples_consumed + (step - self.start.step) * self.effective_batch
        return Position(
            step=step, samples_consumed=consumed, epoch=epoch, offset=offset + self.effective_batch
        )


class StepBatches:
    """This rank's micro-batches of each step, cut from the run's SampleOrder: the part the built-in
    model's (trainer.node.data.ShardedBatches) and fine-tuning's (trainer.node.hf.batches.
    FinetuneBatches) batches share. Subclasses turn sample indices into tensors (`_collate`).

    The loop calls `start` (where the data continues, the accumulation) before the first step."""

    def __init__(
        self, *, num_samples: int, repeats: int, micro_batch_size: int, rank: int, world_size: int, seed: int
    ):
        self.num_samples, self.repeats, self.seed = num_samples, repeats, seed
        self.length = num_samples * repeats
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.accumulation = 0
        self.order: SampleOrder | None = None
        self._step: tuple[int, np.ndarray] | None = None
        self._log = SampleLog.from_env(rank, world_size)

    def start(self, position: Position, accumulation: int) -> None:
        self.accumulation = accumulation
        self.order = SampleOrder(
            num_samples=self.num_samples,
            repeats=self.repeats,
            seed=self.seed,
            effective_batch=self.effective_batch,
            start=position,
        )
        self._step = None

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.world_size * self.accumulation

    def step_samples(self, step: int) -> np.ndarray:
        """Every sample step `step` trains on, all ranks (kept for the step: its micro-batches, its
        token count and the fine-tuning loss's divisor all ask)."""
        if self.order is None:
            raise RuntimeError("StepBatches.start() was not called")
        if self._step is None or self._step[0] != step:
            self._step = (step, self.order.samples(step))
        return self._step[1]

    def micro_batch_samples(self, step: int, index: int, rank: int) -> np.ndarray:
        """The samples of micro-batch `index` of `rank` in step `step`."""
        first = (index * self.world_size + rank) * self.micro_batch_size
        return self.step_samples(step)[first : first + self.micro_batch_size]

    def micro_batches(self, step: int) -> Iterator[Any]:
        """This rank's micro-batches of step `step`, as the engines' train_step takes them."""
        for index in range(self.accumulation):
            chosen = self.micro_batch_samples(step, index, self.rank)
            if self._log is not None:
                self._log.write(step, index, self.logged_ids(chosen))
            yield self._collate(chosen, step)

    def position_after(self, step: int) -> Position:
        if self.order is None:
            raise RuntimeError("StepBatches.start() was not called")
        return self.order.position_after(step)

    def step_tokens(self, step: int) -> int:
        """Tokens all ranks train on in step `step`."""
        raise NotImplementedError

    def logged_ids(self, chosen: np.ndarray) -> list[int]:
        """The sample ids the test log records for a micro-batch of these indices."""
        return [int(i) for i in chosen]

    def _collate(self, chosen: np.ndarray, step: int) -> Any:
        raise NotImplementedError


class SampleLog:
    """The TRAINER_TEST_SAMPLE_LOG hook (module docstring): one JSON line per micro-batch trained."""

    def __init__(self, directory: Path, rank: int, world_size: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank-{rank}.jsonl"
        self.rank, self.world_size = rank, world_size

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> SampleLog | None:
        raw = os.environ.get(SAMPLE_LOG_VARIABLE, "")
        return cls(Path(raw), rank, world_size) if raw else None

    def write(self, step: int, index: int, samples: list[int]) -> None:
        record = {
            "step": step,
            "micro_batch": index,
            "rank": self.rank,
            "world_size": self.world_size,
            "samples": samples,
        }
        # Opened per line: a killed rank leaves every line it wrote, and a test hook need not be fast.
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
