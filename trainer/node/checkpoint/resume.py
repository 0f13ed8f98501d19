"""Whether this run may resume from a checkpoint, decided on every rank before the process group starts
and before anything in it is loaded: its files are the training account's alone (check_trusted), its
RNG files are tensors only, and it was written with this run's settings, vocabulary and data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError
from trainer.node.checkpoint.identity import RESUME_FIX, check_fingerprint, resume_fingerprint
from trainer.node.checkpoint.layout import read_state
from trainer.node.checkpoint.rng import load_rng_state


def check_resumable(
    checkpoint: Path, config: Any, *, world_size: int, identity: dict[str, Any] | None = None
) -> list[str]:
    """ConfigError (before training starts) if this config cannot continue from checkpoint, or if the
    checkpoint is not safe to load (check_trusted, and RNG files that are tensors only). Returns
    warnings for the log (a checkpoint too old to say what data it was trained on)."""
    check_trusted(checkpoint)
    # Every rank reads every rank's RNG file here, before the process group: all stop together.
    for path in sorted(checkpoint.glob("rng-rank*.pt")):
        load_rng_state(path)
    state = read_state(checkpoint)
    saved = state.get("fingerprint", {})
    warnings = check_fingerprint(
        checkpoint,
        saved,
        resume_fingerprint(config, identity),
        allow_data_change=config.checkpoint.allow_data_change,
    )
    # A DeepSpeed checkpoint of another world size is resumed through DeepSpeed's universal checkpoint
    # (engines.ds_universal), converted once when the engine loads. Optimizer state offloaded to NVMe is
    # in per-process swap files (step-N/deepspeed/offloaded_tensors/rank*) it does not cover: refused.
    if (
        saved.get("engine") == "deepspeed"
        and state.get("world_size") != world_size
        and (checkpoint / "deepspeed" / "offloaded_tensors").is_dir()
    ):
        raise ConfigError(
            "checkpoint.resume",
            f"{checkpoint} was written by {state.get('world_size')} DeepSpeed processes, this run has "
            f"{world_size}: its optimizer state was offloaded to NVMe per process, which DeepSpeed cannot "
            f"re-cut; resume it with {state.get('world_size')} processes, or {RESUME_FIX}",
        )
    return warnings


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
