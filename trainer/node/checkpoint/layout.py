"""Where checkpoints live: OUTPUT_DIR/checkpoints/step-<N>/, `latest` naming the newest complete one,
the state file whose presence makes a step complete, which step to resume from, how many are kept
(checkpoint.save_total_limit), and the names of the trainer's own leftovers of an interrupted write.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError, require
from trainer.run_paths import LATEST, RunPaths

#: Written last into a checkpoint, so its presence means "complete". Not `trainer_state.json`: that is
#: the Hugging Face Trainer's file, with another schema, and tools that know it would misread ours.
STATE_FILE = "clustertrain_state.json"
#: The name older versions of this trainer wrote; their checkpoints still resume and export.
LEGACY_STATE_FILES = ("trainer_state.json",)
TMP_PREFIX = ".tmp-"
#: DeepSpeed's universal copy of a step (engines/ds_universal.py, made when a run resumes it at another
#: world size) lives inside it under this name: part of the step's disk usage, not of the next step's.
UNIVERSAL_DIR = "universal"


@dataclass(kw_only=True)
class CheckpointConfig:
    save_steps: int = 40
    """Save every this many optimizer steps (0 = only at the end); the last step is always saved."""
    save_total_limit: int = 2
    """Keep the newest this many checkpoints and delete older ones (0 = keep all)."""
    resume: str = "auto"
    """`auto`: continue from checkpoints/latest if there is one; `never`: start fresh (existing
    checkpoints are overwritten as the run goes); or the path of a `step-N` directory to start from."""
    allow_data_change: bool = False
    """Resume even though the training data (data.path's content) or, for a Hugging Face model, the
    tokenizer's files changed since the checkpoint was written: training continues from its step on the
    new data. A changed vocabulary (token ids that mean other tokens) is refused all the same."""

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
    return Path(RunPaths(Path(output_dir)).checkpoints)


def step_of(path: Path) -> int:
    """N of a `step-N` directory."""
    return int(path.name.removeprefix("step-"))


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete `step-N` directories, oldest first."""
    found = [p for p in directory.glob("step-*") if p.name[5:].isdigit() and is_complete(p)]
    return sorted(found, key=step_of)


def state_path(checkpoint: Path) -> Path | None:
    """The checkpoint's state file (this version's name, else an older one), or None."""
    for name in (STATE_FILE, *LEGACY_STATE_FILES):
        if (checkpoint / name).is_file():
            return checkpoint / name
    return None


def is_complete(checkpoint: Path) -> bool:
    return state_path(checkpoint) is not None


def read_state(checkpoint: Path) -> dict[str, Any]:
    path = state_path(checkpoint)
    if path is None:
        raise FileNotFoundError(f"{checkpoint / STATE_FILE} does not exist")
    return json.loads(path.read_text())


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


def latest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint `latest` names (else the newest complete one), or None."""
    latest = directory / LATEST
    if latest.is_file():
        named = directory / latest.read_text().strip()
        if named.name.startswith("step-") and is_complete(named):
            return named
    candidates = complete_checkpoints(directory) if directory.is_dir() else []
    return candidates[-1] if candidates else None


def beyond_limit(directory: Path, *, step: int, limit: int) -> list[Path]:
    """The complete checkpoints that save_total_limit=`limit` deletes once `step` is saved: all but the
    newest `limit` up to this step (0: none). Higher-numbered ones left by an earlier run (resume: never)
    are not this run's and are left alone."""
    if limit <= 0:
        return []
    ours = [p for p in complete_checkpoints(directory) if step_of(p) <= step]
    return ours[:-limit]


#: The names of the trainer's own temporary files, and only those: a user's `notes.tmp` or `data.tmp/`
#: in output_dir is theirs, never a leftover. Per directory, (pattern, what it is); written by
#: CheckpointWriter.save (`.tmp-step-N`), writer.write_atomically (`latest.tmp`), space.is_disk_full's
#: probe, Reporter.write_json (run.json, summary.json), trainer.node.report (report.json),
#: train._check_output_dir_is_shared (its marker: a uuid4 hex) and hf.final.save_pretrained. The
#: curves' `.NAME.png.tmp` are not here: the next report rewrites the same names.
CHECKPOINT_LEFTOVERS = (
    (re.compile(rf"{re.escape(TMP_PREFIX)}step-\d+"), "incomplete checkpoint"),
    (re.compile(rf"{re.escape(LATEST)}\.tmp"), "incomplete write"),
    (re.compile(rf"{re.escape(TMP_PREFIX)}space-probe-\d+"), "free-space probe"),
)
OUTPUT_DIR_LEFTOVERS = (
    (re.compile(r"(run|summary)\.json\.tmp|\.report\.json\.tmp"), "incomplete write"),
    (re.compile(r"\.shared-check-[0-9a-f]{32}"), "shared-dir check marker"),
    (re.compile(rf"{re.escape(TMP_PREFIX)}final"), "incomplete final model"),
)


def leftovers(output_dir: str | Path) -> list[tuple[Path, str]]:
    """What an interrupted run of the trainer left in output_dir, each with what it is."""
    output_dir = Path(output_dir)
    found = []
    for directory, patterns in (
        (checkpoints_dir(output_dir), CHECKPOINT_LEFTOVERS),
        (output_dir, OUTPUT_DIR_LEFTOVERS),
    ):
        names = sorted(os.listdir(directory)) if directory.is_dir() else []
        found += [
            (directory / name, what)
            for name in names
            for pattern, what in patterns
            if pattern.fullmatch(name)
        ]
    return found


def remove_leftovers(output_dir: str | Path, log: Callable[[str], None]) -> None:
    """Delete what an interrupted write of the trainer left behind (a kill, a full disk), each removal
    logged: rank 0, holding the output dir's job lock (trainer.joblock: no other job's write is in
    flight), before the run writes anything, so the space it holds is free for this run's first write."""
    for leftover, what in leftovers(output_dir):
        log(f"removing {what} {leftover} (a run stopped while writing it)")
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                leftover.unlink()
