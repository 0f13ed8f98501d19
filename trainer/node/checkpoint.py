"""Checkpoints that are either complete or absent: OUTPUT_DIR/checkpoints/step-<N>/ and `latest`.

Writing step N (every rank takes part; engines with sharded state write their own shards):
  1. rank 0 makes `checkpoints/.tmp-step-N/` (removing a leftover from a killed run);
  2. every rank writes its part there: the engine's model/optimizer/scheduler state, its RNG state;
  3. rank 0 writes `trainer_state.json` last, renames the directory to `step-N` (atomic on one file
     system), then replaces `latest` atomically (write `latest.tmp`, os.replace) and removes the
     oldest `step-*` beyond `save_total_limit`.
A kill at any moment leaves `latest` naming a complete checkpoint; `.tmp-*` leftovers are ignored
and removed by the next run.

Test hook: TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S=<seconds> makes rank 0 sleep inside step 2 (the
temporary directory exists, the checkpoint is incomplete), so a test can kill the trainer in the
middle of a write deterministically; TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP=<N> limits it to step N.

torch is imported inside functions: this module's config is loaded on the controller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError, require

LATEST = "latest"
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp-"
DELAY_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S"
DELAY_STEP_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP"


@dataclass(kw_only=True)
class CheckpointConfig:
    save_steps: int = 40
    """Save every this many optimizer steps (0 = only at the end); the last step is always saved."""
    save_total_limit: int = 2
    """Keep the newest this many checkpoints and delete older ones (0 = keep all)."""
    resume: str = "auto"
    """`auto`: continue from checkpoints/latest if there is one; `never`: start fresh (existing
    checkpoints are overwritten as the run goes); or the path of a `step-N` directory to start from."""

    def __post_init__(self) -> None:
        require(
            self.save_steps >= 0, "save_steps", f"must be 0 (only at the end) or more (got {self.save_steps})"
        )
        require(
            self.save_total_limit >= 0,
            "save_total_limit",
            f"must be 0 (keep all) or more (got {self.save_total_limit})",
        )
        require(bool(self.resume.strip()), "resume", "must be auto, never or a checkpoint path")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete `step-N` directories, oldest first."""
    found = [p for p in directory.glob("step-*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=_step_of)


def find_resume_point(config: CheckpointConfig, output_dir: str | Path) -> tuple[Path | None, str | None]:
    """The checkpoint to resume from (or None) and a note for the log; ConfigError for a bad path."""
    if config.resume == "never":
        return None, None
    if config.resume != "auto":
        path = Path(config.resume).expanduser()
        if not (path / STATE_FILE).is_file():
            raise ConfigError(
                "checkpoint.resume",
                f"{path} is not a complete checkpoint (no {STATE_FILE}); "
                "use auto, never or a step-N directory",
            )
        return path, None
    directory = checkpoints_dir(output_dir)
    latest = directory / LATEST
    if not latest.is_file():
        return None, None
    named = directory / latest.read_text().strip()
    if (named / STATE_FILE).is_file():
        return named, None
    # `latest` is only replaced after the rename, so this means someone deleted the directory.
    candidates = complete_checkpoints(directory)
    fallback = candidates[-1] if candidates else None
    return fallback, f"{latest} names {named.name}, which is missing or incomplete; using {fallback}"


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def resume_fingerprint(config: Any) -> dict[str, Any]:
    """What a checkpoint must share with the config that resumes it (saved in trainer_state.json)."""
    return {
        "model": dataclasses.asdict(config.model),
        "block_size": config.data.block_size,
        "engine": config.distributed.engine,
        # A LoRA checkpoint holds the adapter only; a packed run's data order is over other rows.
        "lora": dataclasses.asdict(config.lora),
        "packing": config.data.packing,
    }


def check_resumable(checkpoint: Path, config: Any, *, world_size: int) -> None:
    """ConfigError (before training starts) if this config cannot continue from checkpoint."""
    state = read_state(checkpoint)
    saved = state.get("fingerprint", {})
    fix = (
        "use the settings it was written with, or checkpoint.resume=never or another output_dir to start over"
    )
    for key, value in resume_fingerprint(config).items():
        if isinstance(value, dict) and isinstance(saved.get(key), dict):
            # Settings added since the checkpoint was written are not in it: compare the ones it has.
            value = {name: setting for name, setting in value.items() if name in saved[key]}
        if key in saved and saved[key] != value:
            raise ConfigError(
                "checkpoint.resume",
                f"{checkpoint} was written with {key} = {saved[key]}, this config has {value}; {fix}",
            )
    if saved.get("engine") == "deepspeed" and state.get("world_size") != world_size:
        raise ConfigError(
            "checkpoint.resume",
            f"{checkpoint} holds DeepSpeed ZeRO shards for {state.get('world_size')} processes, this run has "
            f"{world_size}; {fix}",
        )


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rng-rank{rank}.pt"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _test_delay(step: int) -> None:
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    only_step = os.environ.get(DELAY_STEP_ENV)
    if delay > 0 and (not only_step or int(only_step) == step):
        time.sleep(delay)


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
    ):
        self.config = config
        self.directory = checkpoints_dir(output_dir)
        self.rank = rank
        self.barrier = barrier
        self.log = log

    def remove_leftovers(self) -> None:
        """Rank 0: delete temporary directories of writes that a kill interrupted."""
        if self.rank == 0 and self.directory.is_dir():
            for leftover in self.directory.glob(TMP_PREFIX + "*"):
                self.log(f"removing incomplete checkpoint {leftover} (a run stopped while writing it)")
                shutil.rmtree(leftover, ignore_errors=True)

    def save(self, step: int, save_engine_state: Callable[[Path], None], state: dict[str, Any]) -> Path:
        import torch

        final = self.directory / f"step-{step}"
        tmp = self.directory / f"{TMP_PREFIX}step-{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        save_engine_state(tmp)
        torch.save(rng_state(), rng_file(tmp, self.rank))
        self.barrier()
        if self.rank == 0:
            _test_delay(step)
            _write_atomically(tmp / STATE_FILE, json.dumps(state, indent=2) + "\n")
            if final.exists():  # a rerun with resume: never reaches the same step again
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_atomically(self.directory / LATEST, final.name + "\n")
            self._rotate(step)
        self.barrier()
        return final

    def _rotate(self, step: int) -> None:
        """Keep the newest `save_total_limit` checkpoints up to this step. Higher-numbered ones left by
        an earlier run (resume: never) are not this run's and are left alone."""
        limit = self.config.save_total_limit
        if limit <= 0:
            return
        ours = [p for p in complete_checkpoints(self.directory) if _step_of(p) <= step]
        for old in ours[:-limit]:
            shutil.rmtree(old, ignore_errors=True)
