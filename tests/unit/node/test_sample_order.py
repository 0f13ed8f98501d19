"""The sample order over several epochs, in one process: the ranks of any world size with the same
effective batch split the same samples in each step, also across epoch boundaries and after a resume
in the middle of an epoch; another effective batch continues from the samples consumed.

The multi-process runs (tests/local/test_resume_world_size.py) show it for real training; an epoch there is
thousands of steps, here it is 4, so the boundaries are crossed.
"""

from __future__ import annotations

import torch

from trainer.node.data import Corpus, ShardedBatches
from trainer.node.order import START, Position

BLOCK = 4
SAMPLES = 50
#: 50 samples of 4 characters (and the next one as the last target).
CORPUS = Corpus(vocab="abcdefg", ids=torch.arange(SAMPLES * BLOCK + 1) % 7, block_size=BLOCK)


def ranks(world_size: int, accumulation: int, position: Position = START, micro_batch_size: int = 2):
    """Every rank's batches of one run, started at position."""
    found = [
        ShardedBatches(
            CORPUS, repeats=1, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, seed=7
        )
        for rank in range(world_size)
    ]
    for batches in found:
        batches.start(position, accumulation)
    return found


def step_samples(run, step: int) -> list[int]:
    """The samples of a step, every rank's micro-batches together, sorted."""
    return sorted(
        int(i)
        for batches in run
        for index in range(batches.accumulation)
        for i in batches.micro_batch_samples(step, index, batches.rank)
    )


def test_epochs_are_cut_to_whole_steps_and_every_world_size_continues_the_same_samples():
    uninterrupted = ranks(world_size=2, accumulation=3)  # E = 12: 4 steps an epoch, 2 samples left out
    steps = {step: step_samples(uninterrupted, step) for step in range(1, 13)}
    for epoch in range(3):
        trained = [i for step in range(4 * epoch + 1, 4 * epoch + 5) for i in steps[step]]
        assert len(trained) == len(set(trained)) == 48, f"epoch {epoch} repeats or misses a sample"
    assert steps[1] != steps[5], "each epoch draws its own permutation"

    # Stopped after step 6, in the middle of the second epoch; resumed on 1 and on 3 processes.
    position = uninterrupted[0].position_after(6)
    assert position == Position(step=6, samples_consumed=72, epoch=1, offset=24)
    for world_size, accumulation in ((1, 6), (3, 2)):
        resumed = ranks(world_size, accumulation, position)
        assert {s: step_samples(resumed, s) for s in range(7, 13)} == {s: steps[s] for s in range(7, 13)}

    # What a rank trains is what the corpus holds at its samples.
    inputs, targets = next(uninterrupted[1].micro_batches(3))
    first = int(uninterrupted[1].micro_batch_samples(3, 0, 1)[0])
    assert torch.equal(inputs[0], CORPUS.ids[first * BLOCK : (first + 1) * BLOCK])
    assert torch.equal(targets[0], CORPUS.ids[first * BLOCK + 1 : (first + 1) * BLOCK + 1])


def test_another_effective_batch_continues_from_the_samples_consumed_and_starts_the_next_epoch():
    uninterrupted = ranks(world_size=2, accumulation=3)
    position = uninterrupted[0].position_after(6)  # 24 of the second epoch's 50 trained
    smaller = ranks(world_size=1, accumulation=4, position=position)  # E = 8
    # Steps 7-9 train entries 24-47 of the epoch: what steps 7 and 8 trained at E = 12.
    continued = sorted(i for step in (7, 8, 9) for i in step_samples(smaller, step))
    assert continued == sorted(step_samples(uninterrupted, 7) + step_samples(uninterrupted, 8))
    # Entries 48-49 cannot fill a step of 8: step 10 starts the third epoch, as step 9 did at E = 12.
    assert set(step_samples(smaller, 10)) < set(step_samples(uninterrupted, 9))
    assert smaller[0].position_after(10) == Position(step=10, samples_consumed=72 + 4 * 8, epoch=2, offset=8)
