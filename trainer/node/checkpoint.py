"""Checkpoints that are either complete or absent: OUTPUT_DIR/checkpoints/step-<N>/ and `latest`.

Writing step N (every rank takes part; engines with sharded state write their own shards):
  1. rank 0 makes `checkpoints/.tmp-step-N/` (removing a leftover from a killed run);
  2. every rank writes its part there: the engine's model/optimizer/scheduler state, its RNG state;
  3. rank 0 writes `clustertrain_state.json` last, renames the directory to `step-N` (atomic on one file
     system), then replaces `latest` atomically (write `latest.tmp`, os.replace) and removes the
     oldest `step-*` beyond `save_total_limit`.
A kill at any moment leaves `latest` naming a complete checkpoint; `.tmp-*` leftovers are ignored
and removed by the next run before it writes anything (`remove_leftovers`).

A full disk: before each write rank 0 compares the free space with the size of the newest checkpoint
(the next one is the same size) and every rank stops together if it cannot fit; a write that still
runs out of space (the first checkpoint, or something else filling the disk) is recognised by its
errno or by a small probe write. Either way the run ends with `DiskFull` (exit NO_SPACE): one line
naming the directory, the bytes free and the checkpoint's size; `latest` still names the previous,
intact checkpoint, and the incomplete `.tmp-step-N` is removed when the run starts again.

Test hook: TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S=<seconds> makes rank 0 sleep inside step 2 (the
temporary directory exists, the checkpoint is incomplete), so a test can kill the trainer in the
middle of a write deterministically; TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP=<N> limits it to step N.

torch is imported inside functions: this module's config is loaded on the controller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import random
import re
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
#: DeepSpeed's universal copy of a step (engines/ds_universal.py, made when a run resumes it at another
#: world size) lives inside it under this name: part of the step's disk usage, not of the next step's.
UNIVERSAL_DIR = "universal"
DELAY_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_S"
DELAY_STEP_ENV = "TRAINER_TEST_CHECKPOINT_WRITE_DELAY_STEP"
#: Version of the RNG file layout (rng_state); older trainers pickled numpy objects instead.
RNG_FORMAT = 2
#: errno values that mean "the file system (or this account's quota) is full".
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


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


#: Fingerprint entries that say what the model was trained on (see data_identity in trainer.node.data
#: and trainer.node.hf.job): each a dict whose `sha256` is compared.
IDENTITY_KEYS = ("vocabulary", "tokenizer", "data")


def content_hash(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))  # parts cannot run into each other
        digest.update(data)
    return digest.hexdigest()


def file_hash(path: Path) -> str:
    """SHA-256 of a file's bytes, read in pieces (a dataset may be larger than memory allows twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def resume_fingerprint(config: Any, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint must share with the config that resumes it (saved in its state file).
    identity: what the data and vocabulary are (IDENTITY_KEYS), from the corpus or fine-tuning job."""
    return {
        "model": dataclasses.asdict(config.model),
        "block_size": config.data.block_size,
        "engine": config.distributed.engine,
        # A LoRA checkpoint holds the adapter only; a packed run's data order is over other rows.
        "lora": dataclasses.asdict(config.lora),
        "packing": config.data.packing,
        **(identity or {}),
    }


def _identity_problem(
    checkpoint: Path, key: str, saved: dict, now: dict, allow_data_change: bool
) -> str | None:
    """Why resuming with a changed vocabulary, tokenizer or data is refused (None: not refused)."""
    if saved.get("sha256") == now.get("sha256"):
        return None
    new_run = "start a new run: another output_dir (or run name), or checkpoint.resume=never"
    if key == "vocabulary":
        return (
            f"{checkpoint} was trained on another vocabulary ({saved.get('size')} tokens, sha256 "
            f"{str(saved.get('sha256'))[:12]}), this run's has {now.get('size')} tokens (sha256 "
            f"{str(now.get('sha256'))[:12]}): its token ids would mean other tokens; {new_run}"
        )
    if allow_data_change:
        return None
    what = (
        f"the tokenizer's files ({now.get('source')}) changed since {checkpoint} was written: text is split "
        "into other tokens"
        if key == "tokenizer"
        else f"the training data ({now.get('path')}) changed since {checkpoint} was written (sha256 "
        f"{str(saved.get('sha256'))[:12]}, now {str(now.get('sha256'))[:12]}): resuming would continue the "
        "old data order over other samples"
    )
    return f"{what}; {new_run}; or set checkpoint.allow_data_change=true to go on training on the new data"


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
    fix = (
        "use the settings it was written with, or checkpoint.resume=never or another output_dir to start over"
    )
    warnings = []
    current = resume_fingerprint(config, identity)
    recorded = [key for key in IDENTITY_KEYS if isinstance(saved.get(key), dict) and key in current]
    if not recorded and any(key in current for key in IDENTITY_KEYS):
        warnings.append(
            f"warning: {checkpoint} was written by an older trainer that did not record which data and "
            "vocabulary it was trained on: resuming without checking that they are unchanged"
        )
    for key in recorded:
        problem = _identity_problem(
            checkpoint, key, saved[key], current[key], config.checkpoint.allow_data_change
        )
        if problem:
            raise ConfigError("checkpoint.resume", problem)
    for key, value in current.items():
        if key in IDENTITY_KEYS:
            continue
        if isinstance(value, dict) and isinstance(saved.get(key), dict):
            # Settings added since the checkpoint was written are not in it: compare the ones it has.
            value = {name: setting for name, setting in value.items() if name in saved[key]}
        if key in saved and saved[key] != value:
            raise ConfigError(
                "checkpoint.resume",
                f"{checkpoint} was written with {key} = {saved[key]}, this config has {value}; {fix}",
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
            f"re-cut; resume it with {state.get('world_size')} processes, or {fix}",
        )
    return warnings


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


def seed_rng(seed: int, step: int, rank: int) -> None:
    """Seed this rank's generators for a resume at `step` when the checkpoint has no random state for
    it: it was written by fewer processes (a job restarted on more nodes), or the file was deleted.
    From (train.seed, step, rank): each such rank its own streams, the same on every resume from this
    step, and not the ones step 1 started with (seed + rank), which would repeat their dropout masks."""
    import numpy as np
    import torch

    value = int(content_hash(f"rng:{seed}:{step}:{rank}")[:8], 16)  # 32 bits: numpy's limit
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # every CUDA device too


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


class DiskFull(Exception):
    """Output_dir's file system has no room for what the run must write (exit code NO_SPACE); the
    message is one line naming the directory, the bytes free and what did not fit. `everywhere`: every
    rank raised it together (rank 0 says it); else only the rank whose write failed knows."""

    def __init__(self, message: str, *, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere


def human_size(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int:
    """Bytes this process may still write on the file system holding path (root may use the blocks
    reserved for it, other accounts may not)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    info = os.statvfs(path)
    return (info.f_bfree if os.geteuid() == 0 else info.f_bavail) * info.f_frsize


def disk_usage(path: Path) -> int:
    """Bytes that the files under path occupy on disk (blocks, so a compressing file system counts
    what it really stores)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we counted
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def says_no_space(error: BaseException) -> bool:
    """Does `error` (or what caused it) say the file system or quota is full: an OSError's errno, or the
    OS's words in a library's own error (safetensors: "No space left on device (os error 28)")?"""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in NO_SPACE_ERRNOS:
            return True
        if any(os.strerror(number) in str(cause) for number in NO_SPACE_ERRNOS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def is_disk_full(error: BaseException, directory: Path) -> bool:
    """Did a write into directory fail because its file system (or quota) is full? says_no_space, else,
    for torch's C++ writer, whose RuntimeError has no errno ("iostream error"), a small probe write in
    directory decides. Only for errors of a write there: any error looks like this on a full disk."""
    if says_no_space(error):
        return True
    if not isinstance(error, OSError | RuntimeError):
        return False
    probe = Path(directory) / f"{TMP_PREFIX}space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 65536)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        return err.errno in NO_SPACE_ERRNOS
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return False


def latest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint `latest` names (else the newest complete one), or None."""
    latest = directory / LATEST
    if latest.is_file():
        named = directory / latest.read_text().strip()
        if named.name.startswith("step-") and is_complete(named):
            return named
    candidates = complete_checkpoints(directory) if directory.is_dir() else []
    return candidates[-1] if candidates else None


def no_space_message(
    directory: Path,
    *,
    step: int,
    needed: int,
    measured: bool,
    free: int,
    partial: bool = False,
) -> str:
    """The one line a full disk gets (see DiskFull). partial: `free` counts an incomplete write that the
    next start removes."""
    previous = latest_checkpoint(directory)
    need = (
        f"about {human_size(needed)} (the size of {previous.name if previous else 'the last checkpoint'})"
        if measured
        else f"more than {human_size(needed)} (written before the disk filled)"
    )
    kept = (
        f"{previous.name} is intact and stays `latest`"
        if previous
        else "there is no earlier checkpoint (the run starts from step 0 again)"
    )
    older = [p.name for p in complete_checkpoints(directory) if previous and p != previous]
    room = f"delete an older checkpoint ({', '.join(older)}), " if older else ""
    counted = " without the incomplete write (removed at the next start)" if partial else ""
    return (
        f"no space left on device for checkpoint step-{step} in {directory}: it needs {need}, "
        f"{human_size(free)} free{counted}; {kept}; free space there ({room}other files, or use "
        "another output_dir), then run the same command again to resume"
    )


def space_problem(
    directory: Path, *, step: int, save_total_limit: int, log: Callable[[str], None] | None = None
) -> str | None:
    """The no-space line if checkpoint `step` cannot fit, else None. Its size is the newest checkpoint's
    (the next one holds the same tensors); with no checkpoint yet it is not known: None.

    Room that can be made is no problem: the checkpoints save_total_limit deletes after this save anyway
    (never the one `latest` names); with `log` they are deleted now, before the write, and logged."""
    previous = latest_checkpoint(directory)
    if previous is None:
        return None
    needed = disk_usage(previous) - disk_usage(previous / UNIVERSAL_DIR)
    free = free_bytes(directory)
    if free >= needed:
        return None
    if save_total_limit > 0:
        ours = [p for p in complete_checkpoints(directory) if _step_of(p) < step]
        doomed = [p for p in ours[: len(ours) - (save_total_limit - 1)] if p != previous]
        if doomed and free + sum(disk_usage(p) for p in doomed) >= needed:
            if log is None:
                return None
            names = ", ".join(p.name for p in doomed)
            log(
                f"making room for step-{step} ({human_size(needed)}, {human_size(free)} free): removing "
                f"{names} now, which checkpoint.save_total_limit={save_total_limit} removes after it anyway"
            )
            for old in doomed:
                shutil.rmtree(old, ignore_errors=True)
            return None
    return no_space_message(directory, step=step, needed=needed, measured=True, free=free)


#: The names of the trainer's own temporary files, and only those: a user's `notes.tmp` or `data.tmp/`
#: in output_dir is theirs, never a leftover. Per directory, (pattern, what it is); written by
#: CheckpointWriter.save (`.tmp-step-N`), _write_atomically (`latest.tmp`), is_disk_full's probe,
#: Reporter.write_json (run.json, summary.json), trainer.node.report (report.json),
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
                _write_atomically(tmp / STATE_FILE, json.dumps(state, indent=2) + "\n")
                if final.exists():  # a rerun with resume: never reaches the same step again
                    shutil.rmtree(final)
                os.rename(tmp, final)
                renamed = True
                _write_atomically(self.directory / LATEST, final.name + "\n")
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
        """Keep the newest `save_total_limit` checkpoints up to this step. Higher-numbered ones left by
        an earlier run (resume: never) are not this run's and are left alone."""
        limit = self.config.save_total_limit
        if limit <= 0:
            return
        ours = [p for p in complete_checkpoints(self.directory) if _step_of(p) <= step]
        for old in ours[:-limit]:
            shutil.rmtree(old, ignore_errors=True)
