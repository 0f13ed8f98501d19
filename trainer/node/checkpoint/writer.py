"""Checkpoints that are either complete or absent: OUTPUT_DIR/checkpoints/step-<N>/ and `latest`.

Writing step N (every rank takes part; engines with sharded state write their own shards):
  1. rank 0 makes `checkpoints/.tmp-step-N/` (removing a leftover from a killed run);
  2. every rank writes its part there: the engine's model/optimizer/scheduler state, its RNG state;
  3. rank 0 writes `clustertrain_state.json` last, renames the directory to `step-N` (atomic on one file
     system), then replaces `latest` atomically (write `latest.tmp`, os.replace) and removes the
     oldest `step-*` beyond `save_total_limit`.
A kill at any moment leaves `latest` naming a complete checkpoint; `.tmp-*` leftovers are ignored
and removed by the next run before it writes anything (layout.remove_leftovers). A full disk stops
every rank with DiskFull (trainer.node.checkpoint.space).

Test hook: TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S=<seconds> makes rank 0 sleep inside step 2 (the
temporary directory exists, the checkpoint is incomplete), so a test can kill the trainer in the
middle of a write deterministically; TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP=<N> limits it to step N.

torch is imported inside functions: this package's config is loaded on the controller.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.node.checkpoint.layout import (
    LATEST,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointConfig,
    beyond_limit,
    checkpoints_dir,
    latest_checkpoint,
)
from trainer.node.checkpoint.rng import rng_file, rng_state
from trainer.node.checkpoint.space import (
    DiskFull,
    disk_usage,
    free_bytes,
    is_disk_full,
    no_space_message,
    space_problem,
)

DELAY_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S"
DELAY_STEP_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP"


class CheckpointWriter:
    """Saves checkpoints with the protocol in the module docstring; call `save` on every rank."""

    def __init__(
        self,
        config: CheckpointConfig,
        output_dir: str | Path,
        *,
        rank: int,
        barrier: Callable[[], None],
        log: Callable[[str], None],
        share: Callable[[Any], Any] = lambda value: value,
    ):
        self.config = config
        self.directory = checkpoints_dir(output_dir)
        self.rank = rank
        self.barrier = barrier
        self.log = log
        self.share = share
        """Rank 0's value, on every rank (a collective: every rank calls it)."""

    def save(self, step: int, save_engine_state: Callable[[Path], None], state: dict[str, Any]) -> Path:
        import torch

        final = self.directory / f"step-{step}"
        tmp = self.directory / f"{TMP_PREFIX}step-{step}"
        limit = self.config.save_total_limit
        problem = self.share(
            space_problem(self.directory, step=step, save_total_limit=limit, log=self.log)
            if self.rank == 0
            else None
        )
        if problem:  # every rank got the same answer: they stop together, nothing half-written
            raise DiskFull(problem, everywhere=True)
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.barrier()
            save_engine_state(tmp)
            torch.save(rng_state(), rng_file(tmp, self.rank))
        except Exception as err:
            self._raise_if_disk_full(err, step, tmp)
            raise
        self.barrier()
        if self.rank == 0:
            renamed = False
            try:
                _test_delay(step)
                write_atomically(tmp / STATE_FILE, json.dumps(state, indent=2) + "\n")
                if final.exists():  # a rerun with resume: never reaches the same step again
                    shutil.rmtree(final)
                os.rename(tmp, final)
                renamed = True
                write_atomically(self.directory / LATEST, final.name + "\n")
            except Exception as err:
                if renamed:  # `latest` still names the previous one: this one goes, its space with it
                    os.rename(final, tmp)
                self._raise_if_disk_full(err, step, tmp)
                raise
            self._rotate(step)
        self.barrier()
        return final

    def _raise_if_disk_full(self, err: Exception, step: int, tmp: Path) -> None:
        """DiskFull (one line) for a write that ran out of space. The incomplete directory stays (another
        rank may still be writing into it) and is removed when the run starts again; the free space
        reported counts it as free."""
        if not is_disk_full(err, self.directory):
            return
        written = disk_usage(tmp)
        previous = latest_checkpoint(self.directory)
        needed = max(written, disk_usage(previous)) if previous else written
        raise DiskFull(
            no_space_message(
                self.directory,
                step=step,
                needed=needed,
                measured=previous is not None,
                free=free_bytes(self.directory) + written,
                partial=True,
            )
        ) from None

    def _rotate(self, step: int) -> None:
        """Keep the newest `save_total_limit` checkpoints up to this step (layout.beyond_limit)."""
        for old in beyond_limit(self.directory, step=step, limit=self.config.save_total_limit):
            shutil.rmtree(old, ignore_errors=True)


def write_atomically(path: Path, text: str) -> None:
    """`path` whole and on disk before it replaces the old one (a crash leaves `latest` naming a whole
    checkpoint). The temporary file is made exclusively without following a link, as
    trainer.safe_files does, and durably (fsync), which that helper does not."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a killed save, or a planted link: removed, not opened
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with open(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _test_delay(step: int) -> None:
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    only_step = os.environ.get(DELAY_STEP_ENV)
    if delay > 0 and (not only_step or int(only_step) == step):
        time.sleep(delay)
