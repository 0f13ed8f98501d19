"""Checkpoints that are either complete or absent: OUTPUT_DIR/checkpoints/step-<N>/ and `latest`.

Writing step N (every rank takes part; engines with sharded state write their own shards):
  1. rank 0 makes `checkpoints/.tmp-step-N/` (removing a leftover from a killed run);
  2. every rank writes its part there: the engine's model/optimizer/scheduler state, its RNG state;
  3. rank 0 writes `clustertrain_state.json` last, renames the directory to `step-N` (atomic on one file
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
#: Written last into a checkpoint, so its presence means "complete". Not `trainer_state.json`: that is
#: the Hugging Face Trainer's file, with another schema, and tools that know it would misread ours.
STATE_FILE = "clustertrain_state.json"
#: The name older versions of this trainer wrote; their checkpoints still resume and export.
LEGACY_STATE_FILES = ("trainer_state.json",)
TMP_PREFIX = ".tmp-"
DELAY_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S"
DELAY_STEP_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP"
#: Version of the RNG file layout (rng_state); older trainers pickled numpy objects instead.
RNG_FORMAT = 2


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
    found = [p for p in directory.glob("step-*") if p.name[5:].isdigit() and is_complete(p)]
    return sorted(found, key=_step_of)


def state_path(checkpoint: Path) -> Path | None:
    """The checkpoint's state file (this version's name, else an older one), or None."""
    for name in (STATE_FILE, *LEGACY_STATE_FILES):
        if (checkpoint / name).is_file():
            return checkpoint / name
    return None


def is_complete(checkpoint: Path) -> bool:
    return state_path(checkpoint) is not None


def find_resume_point(config: CheckpointConfig, output_dir: str | Path) -> tuple[Path | None, str | None]:
    """The checkpoint to resume from (or None) and a note for the log; ConfigError for a bad path."""
    if config.resume == "never":
        return None, None
    if config.resume != "auto":
        path = Path(config.resume).expanduser()
        if not is_complete(path):
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
    if is_complete(named):
        return named, None
    # `latest` is only replaced after the rename, so this means someone deleted the directory.
    candidates = complete_checkpoints(directory)
    fallback = candidates[-1] if candidates else None
    return fallback, f"{latest} names {named.name}, which is missing or incomplete; using {fallback}"


def read_state(checkpoint: Path) -> dict[str, Any]:
    path = state_path(checkpoint)
    if path is None:
        raise FileNotFoundError(f"{checkpoint / STATE_FILE} does not exist")
    return json.loads(path.read_text())


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
    """ConfigError (before training starts) if this config cannot continue from checkpoint, or if the
    checkpoint is not safe to load (check_trusted, and RNG files that are tensors only)."""
    check_trusted(checkpoint)
    # Every rank reads every rank's RNG file here, before the process group: all stop together.
    for path in sorted(checkpoint.glob("rng-rank*.pt")):
        load_rng_state(path)
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
    """This rank's random generators as plain numbers and tensors: torch.load(weights_only=True) reads it
    back, so the file can hold no code (a pickle of numpy objects could)."""
    import numpy as np
    import torch

    python_version, python_words, python_gauss = random.getstate()
    numpy_kind, numpy_words, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {
        "format": RNG_FORMAT,
        "python": {"version": python_version, "words": torch.tensor(python_words, dtype=torch.int64)},
        "python_gauss": python_gauss,
        "numpy": {
            "kind": numpy_kind,
            "words": torch.from_numpy(numpy_words.astype(np.int64)),
            "pos": int(numpy_pos),
            "has_gauss": int(numpy_has_gauss),
            "gauss": float(numpy_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    python, numpy_state = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["words"].tolist()), state["python_gauss"]))
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["words"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rng-rank{rank}.pt"


def load_rng_state(path: Path) -> dict[str, Any]:
    """A rank's RNG file, read with torch.load(weights_only=True): no code in it can run. ConfigError
    naming the file for anything else (a pickle of objects, an older trainer's format, a damaged file)."""
    import torch

    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:  # whatever is wrong with the file, the answer is the same
        raise ConfigError(
            "checkpoint.resume",
            f"{path} is not a random-state file this trainer wrote (it may hold code: not loaded; "
            f"{type(err).__name__}); delete it to resume without its random streams, or start over "
            "with checkpoint.resume=never",
        ) from None
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        raise ConfigError(
            "checkpoint.resume",
            f"{path} is not a random-state file this trainer wrote (format {RNG_FORMAT}); delete it to "
            "resume without its random streams, or start over with checkpoint.resume=never",
        )
    return state


def check_trusted(checkpoint: Path, *, uid: int | None = None) -> None:
    """ConfigError naming the first file that makes `checkpoint` unsafe to load.

    Engines and libraries unpickle what they find in a checkpoint (DeepSpeed's shards, accelerate's
    random states), and the shared dir is writable by its group: so before anything is loaded, every
    file and directory in the checkpoint, and the directory holding it (whoever can write there can
    swap the checkpoint), must be owned by the training account (this process's uid) and writable by
    it alone; symbolic links are refused (they could point anywhere)."""
    import stat

    uid = os.getuid() if uid is None else uid
    fix = (
        "a checkpoint must be written by the training account and writable by it alone; if you trust the "
        "files, fix them (chown/chmod go-w), else start over with checkpoint.resume=never"
    )

    def check(path: Path) -> os.stat_result:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            problem = "is a symbolic link"
        elif info.st_uid != uid:
            problem = f"is owned by uid {info.st_uid}, not the training account (uid {uid})"
        elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
        else:
            return info
        raise ConfigError("checkpoint.resume", f"refusing to load {checkpoint}: {path} {problem}; {fix}")

    checkpoint = Path(os.path.abspath(checkpoint))
    check(checkpoint.parent)
    check(checkpoint)
    for root, directories, files in os.walk(checkpoint):
        for name in sorted(directories) + sorted(files):
            check(Path(root) / name)


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
